"""Direct copies into a vLLM layer's kernel tensors, for layers whose reload was checked to be a copy.

Every update through vLLM's layerwise reload puts the layer back into model format, buffers what
its weight loaders receive, materialises, loads, post-processes and copies the result into the
kernel tensors the forward pass reads (and CUDA graphs captured). For most layers on a GPU that
whole round trip ends in a plain copy of the pushed tensors into regions of those kernel tensors;
its cost is the reload's Python, not the bytes.

``DirectLayers`` keeps, per vLLM layer, whether that was proven. The first time a layer arrives
whole in one ``load``, it goes through the reload, and afterwards (the pushed tensors still at
hand) the adapter asks ``verify``:

- the layer's kernel tensors (parameters and buffers) are the same objects, at the same storage,
  shape and strides, as before the reload (what the forward pass and CUDA graphs read stayed put);
- nothing else the layer or its ``quant_method`` holds changed identity or appeared, and neither
  holds a tensor outside its parameters and buffers (a kernel that repacks keeps its own copy
  there: on CPU every unquantized linear and embedding builds a new packed ``cpu_linear``);
- the regions the manifest's slice geometry names (this rank's piece of each checkpoint tensor at
  its shard's rows of the fused parameter) cover every parameter and buffer of the layer (a
  vocabulary's padding rows excepted), and each holds exactly the pushed piece.

A proven layer is copied directly from then on, in one grouped copy per ``load``, whenever all of
its tensors arrive in one ``load``; a layer that fails the check, cannot be stated (experts, tied
layers, submodules, a parameter vLLM replaced), is quantized (the manifest's ``reload_only``: its
post-load processing may repack), or arrives split over buckets keeps going through the reload. A
proven layer's regions are re-derived whenever its kernel tensors are no longer the objects they
were (another reload path replaced them): it is then unproven again.

Used by ``weightwire.adapters.vllm.adapter`` on the worker service's gRPC thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from weightwire.adapters.vllm.manifest import LoadTarget, ModelLayout

_GROUP_COPY: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = getattr(
    torch, "_foreach_copy_", None
)
_QKV_ORDER = ("q", "k", "v")


@dataclasses.dataclass(frozen=True)
class _TensorState:
    tensor: torch.Tensor
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class LayerSnapshot:
    """What a layer held before a reload: its kernel tensors and every other attribute, by identity."""

    tensors: Mapping[str, _TensorState]
    attributes: Mapping[str, object]
    method_attributes: Mapping[str, object] | None


def _tensor_states(layer: torch.nn.Module) -> dict[str, _TensorState]:
    held: dict[str, torch.Tensor] = {n: t for n, t in layer._parameters.items() if t is not None}
    held.update({n: t for n, t in layer._buffers.items() if t is not None})
    return {
        n: _TensorState(t, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype) for n, t in held.items()
    }


def snapshot(layer: torch.nn.Module) -> LayerSnapshot:
    method = getattr(layer, "quant_method", None)
    return LayerSnapshot(
        tensors=_tensor_states(layer),
        attributes=dict(layer.__dict__),
        method_attributes=dict(vars(method)) if method is not None and hasattr(method, "__dict__") else None,
    )


# Set on the module that vLLM's initialize_layerwise_reload is given (here each layer): its own
# bookkeeping for torchao models, not state of the layer's kernel.
_RELOAD_BOOKKEEPING = frozenset({"_do_torchao_reload", "_original_do_torchao_reload"})


def _changed(before: Mapping[str, object], now: Mapping[str, object]) -> list[str]:
    """Attributes added, removed or holding another object than before."""
    return sorted(
        k
        for k in (before.keys() | now.keys()) - _RELOAD_BOOKKEEPING
        if k not in before or k not in now or now[k] is not before[k]
    )


def _holds_tensor(attributes: Mapping[str, object]) -> bool:
    return any(isinstance(v, torch.Tensor) for v in attributes.values())


class DirectLayers:
    """Per vLLM layer: unchecked, proven (direct copies) or refused (reload only); see the module
    docstring. ``enabled=False``: every layer through the reload."""

    def __init__(self, layout: ModelLayout, layers: Mapping[str, torch.nn.Module], *, enabled: bool) -> None:
        self.layout = layout
        self.layers = layers
        self.enabled = enabled
        self._proven: dict[str, dict[str, tuple[torch.Tensor, _TensorState, torch.Tensor]]] = {}
        self.refused: dict[str, str] = {}
        # Layers copied directly so far (each time one is), for tests and the worker's logs.
        self.copied = 0
        tied = set(layout.tied_layers) | {t for names in layout.tied_layers.values() for t in names}
        for name, layer in layers.items():
            why = None
            if name in layout.reload_only:
                why = layout.reload_only[name]
            elif name in tied:
                why = "shares a parameter with another layer (its kernels are rebuilt after each reload)"
            elif any(True for _ in layer.children()):
                why = "has submodules"
            elif _holds_tensor(layer.__dict__):
                why = "holds a tensor outside its parameters and buffers"
            if why is not None:
                self.refused[name] = why

    @property
    def proven(self) -> frozenset[str]:
        return frozenset(self._proven)

    def forget(self) -> int:
        """Forget every proof (the engine discarded the layers' bytes: a level-2 sleep): each layer
        goes through the reload once more and is checked again. Returns how many were proven."""
        forgotten = len(self._proven)
        self._proven.clear()
        return forgotten

    def candidate(self, layer_name: str) -> bool:
        """Whether a layer arriving whole should be checked after its reload."""
        return self.enabled and layer_name not in self._proven and layer_name not in self.refused

    def direct_pairs(
        self, layer_name: str, tensors: Mapping[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(kernel region, pushed piece) for every tensor of a proven layer whose tensors all arrived
        in ``tensors``; None when the layer goes through the reload this time."""
        if not self.enabled:
            return None
        regions = self._proven.get(layer_name)
        if regions is None or regions.keys() != self.layout.names_by_layer[layer_name]:
            return None
        layer = self.layers[layer_name]
        pairs = []
        for name, (dst, state, _) in regions.items():
            src = tensors.get(name)
            if src is None:
                return None
            leaf = self.layout.targets[name].param_name.rpartition(".")[2]
            if _current(layer, leaf) is not state.tensor or state.tensor.data_ptr() != state.data_ptr:
                # Something other than weightwire replaced the kernel tensor: check again.
                del self._proven[layer_name]
                return None
            pairs.append((dst, narrowed(self.layout.targets[name], src)))
        self.copied += 1
        return pairs

    def verify(
        self, layer_name: str, before: LayerSnapshot, pushed: Mapping[str, torch.Tensor]
    ) -> str | None:
        """After the layer's reload: None and the layer proven, or why it keeps going through the reload."""
        why = self._why_not(layer_name, before, pushed)
        if why is None:
            return None
        self.refused[layer_name] = why
        return why

    def _why_not(
        self, layer_name: str, before: LayerSnapshot, pushed: Mapping[str, torch.Tensor]
    ) -> str | None:
        layer = self.layers[layer_name]
        after = snapshot(layer)
        if before.tensors.keys() != after.tensors.keys():
            return "its reload changed which parameters and buffers it holds"
        for name, was in before.tensors.items():
            now = after.tensors[name]
            if now.tensor is not was.tensor or (now.data_ptr, now.shape, now.stride, now.dtype) != (
                was.data_ptr,
                was.shape,
                was.stride,
                was.dtype,
            ):
                return f"its reload replaced or moved {name!r}"
        changed = _changed(before.attributes, after.attributes)
        if changed:
            return f"its reload set {', '.join(changed)} (a kernel that repacks, or state derived from the weights)"
        method_before, method_after = before.method_attributes or {}, after.method_attributes or {}
        changed = _changed(method_before, method_after)
        if changed or _holds_tensor(method_after):
            return (
                f"its reload set its quant_method's {', '.join(changed) or 'tensors'} (a kernel that repacks, "
                "or state derived from the weights)"
            )
        regions = layer_regions(self.layout, layer_name, layer)
        if regions is None:
            return "the slice geometry cannot state where each tensor lies in its parameter"
        for name, (dst, _, _) in regions.items():
            src = pushed.get(name)
            if src is None or not torch.equal(dst, narrowed(self.layout.targets[name], src)):
                return f"its kernel tensors do not hold {name} where the slice geometry says"
        self._proven[layer_name] = regions
        return None


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One grouped copy for pairs on one device, one copy each otherwise."""
    same = [(d, s) for d, s in pairs if d.device == s.device]
    if _GROUP_COPY is not None and same:
        _GROUP_COPY([d for d, _ in same], [s for _, s in same])
        rest: Iterable[tuple[torch.Tensor, torch.Tensor]] = (p for p in pairs if p[0].device != p[1].device)
    else:
        rest = pairs
    for d, s in rest:
        d.copy_(s)


def _current(layer: torch.nn.Module, leaf: str) -> torch.Tensor | None:
    return layer._parameters.get(leaf, layer._buffers.get(leaf))


def narrowed(target: LoadTarget, full: torch.Tensor) -> torch.Tensor:
    src = full
    for piece in target.pieces:
        src = src.narrow(piece.dim, piece.offset, piece.length)
    return src


def _is_vocab(layer: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return isinstance(layer, VocabParallelEmbedding)


def layer_regions(
    layout: ModelLayout, layer_name: str, layer: torch.nn.Module
) -> dict[str, tuple[torch.Tensor, _TensorState, torch.Tensor]] | None:
    """Where each checkpoint tensor of the layer lies in its kernel tensor: a fused parameter holds
    its shards' rows one after another in shard order (q, k, v; 0, 1), an unfused one from row 0.
    None unless the regions cover every parameter and buffer whole (a vocabulary's padding rows
    excepted): anything else the layer holds could be derived from the weights."""
    by_leaf: dict[str, list[LoadTarget]] = {}
    for name in layout.names_by_layer[layer_name]:
        target = layout.targets[name]
        if getattr(target, "expert_id", None) is not None:
            return None
        by_leaf.setdefault(target.param_name.rpartition(".")[2], []).append(target)
    states = _tensor_states(layer)
    if states.keys() != by_leaf.keys():
        return None
    vocab = _is_vocab(layer)
    out: dict[str, tuple[torch.Tensor, _TensorState, torch.Tensor]] = {}
    for leaf, targets in by_leaf.items():
        state = states[leaf]
        param = state.tensor
        if all(t.shard_id is None for t in targets) and len(targets) == 1:
            ordered, fused = targets, False
        elif all(t.shard_id in _QKV_ORDER for t in targets):
            ordered, fused = sorted(targets, key=lambda t: _QKV_ORDER.index(str(t.shard_id))), True
        elif all(isinstance(t.shard_id, int) for t in targets):
            ordered, fused = sorted(targets, key=lambda t: int(t.shard_id or 0)), True
        else:
            return None
        if param.dim() == 0:
            return None
        row = 0
        for t in ordered:
            local = list(t.shape)
            for piece in t.pieces:
                local[piece.dim] = piece.length
            if (
                t.dtype != param.dtype
                or len(local) != param.dim()
                or tuple(local[1:]) != tuple(param.shape[1:])
            ):
                return None
            if row + local[0] > param.shape[0]:
                return None
            out[t.name] = (param.data.narrow(0, row, local[0]), state, param)
            row += local[0]
        if row != param.shape[0] and not (vocab and not fused):
            return None
    return out
