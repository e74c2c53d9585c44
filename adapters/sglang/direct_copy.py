"""Direct copies into an SGLang rank's parameters: where each checkpoint tensor's kept region lies.

Once a set of tensor names went through ``load_weights`` and every region the manifest's slice
geometry names held exactly what SGLang's loaders wrote there, later loads of the same names copy
those regions straight into the parameters (``DirectCopy``), in one grouped copy. ``destinations``
states each target's region once per model; a target whose place cannot be stated (a layout these
rules do not know, a quantized layer whose post-load processing may rebind its parameters) has
none, and its loads stay on ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from weightwire.adapters.sglang.manifest import LoadTarget, ModelLayout

_GROUP_COPY: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = getattr(
    torch, "_foreach_copy_", None
)
_QKV_ORDER = ("q", "k", "v")

Destinations = dict[tuple[str, str | int | None, str], torch.Tensor]
"""(parameter name, shard id, checkpoint name) -> the parameter region that checkpoint tensor's kept piece fills."""


class DirectCopy:
    """The regions a load writes, as (parameter view, source view) pairs."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = pairs
        same = [(d, s) for d, s in pairs if d.device == s.device]
        self._grouped = ([d for d, _ in same], [s for _, s in same]) if _GROUP_COPY is not None else ([], [])
        self._each = [(d, s) for d, s in pairs if _GROUP_COPY is None or d.device != s.device]

    def matches(self) -> bool:
        return all(torch.equal(d, s) for d, s in self.pairs)

    def copy(self) -> None:
        dsts, srcs = self._grouped
        if dsts:
            assert _GROUP_COPY is not None
            _GROUP_COPY(dsts, srcs)
        for d, s in self._each:
            d.copy_(s)


def direct_pairs(
    layout: ModelLayout, dst: Destinations, named: Sequence[tuple[str, torch.Tensor]]
) -> DirectCopy | None:
    """(parameter region, source region) for every target of ``named``, or None when the
    geometry of one cannot be stated (``load_weights`` then does it all)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, full in named:
        for target in layout.targets[name]:
            region = dst.get((target.param_name, target.shard_id, name))
            if region is None:
                return None
            src = full
            for piece in target.pieces:
                src = src.narrow(piece.dim, piece.offset, piece.length)
            if src.shape != region.shape or src.dtype != region.dtype:
                return None
            pairs.append((region, src))
    return DirectCopy(pairs)


def destinations(
    model: torch.nn.Module, params: Mapping[str, torch.Tensor], layout: ModelLayout
) -> Destinations:
    """Where each target's rows lie in its parameter: a fused parameter holds its shards' rows
    one after another in the layer's shard order (q, k, v; gate, up), an unfused one from row 0
    (a vocabulary's padding rows past the checkpoint's are never written). Targets whose place
    cannot be stated are left out (their loads go through ``load_weights``)."""
    by_param: dict[str, list[LoadTarget]] = {}
    for found in layout.targets.values():
        for t in found:
            by_param.setdefault(t.param_name, []).append(t)
    out: Destinations = {}
    for param_name, targets in by_param.items():
        param = params[param_name]
        if param.dim() == 0 or quantized_layer(model, param_name):
            continue
        if any(t.expert_id is not None for t in targets):
            out.update(_expert_destinations(model, param_name, param, targets))
            continue
        if all(t.shard_id is None for t in targets):
            ordered = targets
            fused = False
        elif all(t.shard_id in _QKV_ORDER for t in targets):
            ordered = sorted(targets, key=lambda t: _QKV_ORDER.index(t.shard_id))  # type: ignore[arg-type]
            fused = True
        elif all(isinstance(t.shard_id, int) for t in targets):
            ordered = sorted(targets, key=lambda t: int(t.shard_id))  # type: ignore[arg-type]
            fused = True
        else:
            continue
        row = 0
        for t in ordered:
            local = list(t.shape)
            for piece in t.pieces:
                local[piece.dim] = piece.length
            start = row if fused else 0
            if fused:
                row += local[0]
            if (
                t.dtype != param.dtype
                or len(local) != param.dim()
                or tuple(local[1:]) != tuple(param.shape[1:])
            ):
                continue
            if start + local[0] > param.shape[0]:
                continue
            if not fused and local[0] != param.shape[0] and not _is_vocab(model, param_name):
                continue
            out[(param_name, t.shard_id, t.name)] = param.data.narrow(0, start, local[0])
    return out


def _expert_destinations(
    model: torch.nn.Module, param_name: str, param: torch.Tensor, targets: list[LoadTarget]
) -> Destinations:
    """A routed expert's place in a ``FusedMoE`` parameter: its local slot, then gate (``w1``)
    in the first half of ``w13``'s rows and up (``w3``) in the second, ``w2`` whole."""
    module_name = param_name.rpartition(".")[0]
    layer = model.get_submodule(module_name)
    out: Destinations = {}
    for t in targets:
        if t.expert_id is None or t.dtype != param.dtype:
            continue
        slot = int(layer._map_global_expert_id_to_local_expert_id(t.expert_id))  # type: ignore[operator]
        if not 0 <= slot < param.shape[0]:
            continue
        local = list(t.shape)
        for piece in t.pieces:
            local[piece.dim] = piece.length
        expert = param.data[slot]
        if t.shard_id in ("w1", "w3") and len(local) == 2:
            # A padded intermediate size (CPU, unaligned TP): the checkpoint's rows come first.
            rows = expert.shape[0] // 2
            region = expert.narrow(0, 0 if t.shard_id == "w1" else rows, min(rows, local[0]))
        elif t.shard_id == "w2" and len(local) == 2:
            region = expert.narrow(1, 0, min(expert.shape[1], local[1]))
        else:
            continue
        if tuple(region.shape) == tuple(local):
            out[(param_name, t.shard_id, t.name)] = region
    return out


def _is_vocab(model: torch.nn.Module, param_name: str) -> bool:
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    module_name = param_name.rpartition(".")[0]
    return isinstance(model.get_submodule(module_name) if module_name else model, VocabParallelEmbedding)


def quantized_layer(model: torch.nn.Module, param_name: str) -> bool:
    """Whether the parameter belongs to a quantized layer: its post-load processing (rerun after
    every update) may rewrite or rebind what a direct copy would write into, so such layers always
    load through ``load_weights``."""
    module_name = param_name.rpartition(".")[0]
    method = getattr(model.get_submodule(module_name) if module_name else model, "quant_method", None)
    return method is not None and not type(method).__name__.startswith("Unquantized")
