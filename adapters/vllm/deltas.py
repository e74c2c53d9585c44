"""Delta updates into a vLLM worker (``AppliesDeltas``), through vLLM's layerwise reload.

A delta says which elements of a checkpoint tensor changed since the base version. vLLM's kernels
may keep a weight in another layout than the checkpoint's (on CPU every linear layer packs its
weight into a oneDNN handle and keeps a ``[0]``-shaped parameter; quantized kernels repack on a
GPU), so a delta is never written into a kernel tensor. Per vLLM layer a delta touches, this rank's
kept piece of each of the layer's checkpoint tensors is taken from where the layer's base is known
to be, the changes inside the piece are applied to a copy of it, and the layer is loaded again from
those pieces through ``VLLMAdapter.load``: vLLM's reload (which re-runs the kernels' repacking, so
the packed weights are right) or, for a layer proven to take a plain copy, the direct copy. A layer
none of whose tensors changed is not written at all.

Where a layer's base is (``LayerBases``), decided after each reload of the layer that received all
its tensors, with the pushed tensors still at hand:

- **in the model** when the layer's parameters hold exactly this rank's pushed pieces, bit for bit,
  at the regions the slice geometry states (``direct.layer_regions``: its shard's rows of a fused
  parameter, a vocabulary's rows without padding). An embedding and ``lm_head`` on CPU, the norms,
  and on a GPU every unquantized layer are such. The base is read from there, and the verification
  reads the same regions after the reload, so it checks what the model holds.
- **in a host copy** otherwise, when the engine allows it (``WEIGHTWIRE_VLLM_DELTA_COPIES=1``): the
  adapter keeps this rank's pieces of the layer's tensors as they were last pushed (host memory:
  those tensors' bytes of this rank; on CPU about the model's linear weights). The base is the copy,
  and the verification checks the copy the reload consumed: that the bytes vLLM's loader received
  are the trainer's, the same guarantee a FULL push through the reload gives.
- **nowhere** else: since start (the engine loaded from disk, not from a push), after a reload
  that failed, a layer left incomplete, vLLM deferring the layer's processing to the finalize, or a
  wake after a level-2 sleep (the weights' bytes discarded).

A delta update is refused with DELTA_BASE_MISMATCH (metadata ``tensor``) at its first delta,
before anything of the update is written, unless every tensor this worker owns has a base: a
FULL-scope delta names every owned tensor, and checking them all at the first call is what keeps
the refusal ahead of every write (a PARTIAL delta is refused the same way while any owned tensor
has none). The worker stays CONSISTENT at its version, and the trainer's automatic FULL reloads the
layers, which gives them their bases again.

Deltas from every trainer rank (a transfer group in ``TRANSFER_MODE_SLICES``) take the same path:
the worker asks ``refuse_deltas`` (the same check) before anything of such a bucket waits, holds
the checked region deltas (not the model) until the commit, and then hands them, one delta per
tensor, to ``apply_deltas`` in one call (``weightwire.server.worker.staged_deltas``), so a layer
whose tensors came in several buckets is reloaded once.

Whether a worker applies deltas at all is decided at start (``build_adapter``): not when a tensor
is split into more than one piece on this rank, when the model has experts (vLLM's CPU kernel
prepacks them in place after the reload, a layout not tested here), or when a layer's regions
cannot be stated and no host copies are allowed. Such a worker has no ``AppliesDeltas``, refuses a
delta update at its header, and the trainer sends it whole.

Built by ``weightwire.adapters.vllm.backend`` in every vLLM worker; called on the worker service's
gRPC thread inside vLLM's update window, like every load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from weightwire.adapters.torch.delta_pieces import apply_to_piece
from weightwire.adapters.vllm.direct import layer_regions, narrowed
from weightwire.adapters.vllm.manifest import ModelLayout
from weightwire.adapters.vllm.slices import SlicesVLLMAdapter, full_tensor
from weightwire.core.delta import DELTA_BASE_MISMATCH, Delta, apply_delta
from weightwire.core.delta.errors import delta_error
from weightwire.core.delta.record import as_bits
from weightwire.core.errors import WeightwireError

__all__ = ["DeltasVLLMAdapter", "LayerBases", "build_adapter", "why_no_deltas"]

log = logging.getLogger("vllm.weightwire")

Piece = tuple[int, int, int]


class LayerBases:
    """Per vLLM layer, where the base of a delta is: the model's regions, a host copy, or nowhere
    (module docstring). ``copies``: whether a layer whose regions do not hold its pieces keeps a copy."""

    def __init__(self, layout: ModelLayout, layers: Mapping[str, torch.nn.Module], *, copies: bool) -> None:
        self.layout = layout
        self.layers = layers
        self.copies = copies
        self._in_model: set[str] = set()
        self._copied: dict[str, dict[str, torch.Tensor]] = {}
        # Per layer still open for reload in this update: the tensors pushed to it so far (views
        # for those arriving in the call that completes it; the adapter's copies for the others).
        self._pushed: dict[str, dict[str, torch.Tensor]] = {}

    def where(self, layer: str) -> str | None:
        """'model', 'copy' or None (no base)."""
        if layer in self._in_model:
            return "model"
        return "copy" if layer in self._copied else None

    def arrived(self, batch: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in batch:
            self._pushed.setdefault(self.layout.targets[name].layer_name, {})[name] = tensor

    def settle(self, layer: str, *, processed: bool, plain_copy: bool) -> str | None:
        """After the call in which ``layer`` received its last tensor: where its base is now, or why
        it has none. ``processed``: vLLM loaded and repacked it in that call; ``plain_copy``: its
        direct copy is proven (its regions hold the pieces, as this check would find)."""
        pushed = self._pushed.pop(layer, {})
        self._in_model.discard(layer)
        self._copied.pop(layer, None)
        if not processed:
            return "vLLM defers its processing to the end of the update"
        if pushed.keys() != self.layout.names_by_layer[layer]:
            return "its tensors did not all pass through this adapter's reload"
        regions = layer_regions(self.layout, layer, self.layers[layer])
        if plain_copy or (
            regions is not None
            and all(_same_bits(regions[n][0], narrowed(self.layout.targets[n], t)) for n, t in pushed.items())
        ):
            self._in_model.add(layer)
            return None
        if not self.copies:
            return (
                "its parameters do not hold the pushed pieces (a kernel that repacks) and host copies are off"
            )
        self._copied[layer] = {n: _host_copy(narrowed(self.layout.targets[n], t)) for n, t in pushed.items()}
        return None

    def drop(self, layers: Iterable[str]) -> None:
        for layer in layers:
            self._pushed.pop(layer, None)
            self._in_model.discard(layer)
            self._copied.pop(layer, None)

    def drop_pending(self) -> None:
        """The update ended: layers still waiting for tensors keep their old weights, and no base."""
        self.drop(list(self._pushed))

    def forget(self) -> int:
        """Every base forgotten (the engine discarded the weights' bytes); how many layers had one."""
        count = len(self._in_model) + len(self._copied)
        self._in_model.clear()
        self._copied.clear()
        self._pushed.clear()
        return count

    def without_base(self, names: Iterable[str]) -> list[str]:
        """The tensors of ``names`` whose layer has no base (sorted)."""
        return sorted(n for n in names if self.base_of(n) is None)

    def base_of(self, name: str) -> torch.Tensor | None:
        """What holds this rank's piece of ``name`` at the base: a live region of the model or the
        copy; None when its layer has none (or its regions cannot be stated any more)."""
        layer = self.layout.targets[name].layer_name
        copied = self._copied.get(layer)
        if copied is not None:
            return copied[name]
        if layer not in self._in_model:
            return None
        regions = layer_regions(self.layout, layer, self.layers[layer])
        return None if regions is None else regions[name][0]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bits(a), as_bits(b.to(a.device)))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)


def why_no_deltas(adapter: SlicesVLLMAdapter, *, copies: bool) -> str | None:
    """Why this worker cannot apply deltas at all (module docstring), or None."""
    layout = adapter.layout
    for name, target in layout.targets.items():
        if len(target.pieces) > 1:
            return f"{name}: this rank keeps {len(target.pieces)} pieces of it, not one"
        if getattr(target, "expert_id", None) is not None:
            return f"{name}: an expert (vLLM's CPU kernel prepacks experts in place; not tested with deltas)"
    if not copies:
        for layer in layout.names_by_layer:
            if layer_regions(layout, layer, adapter._layers[layer]) is None:
                return (
                    f"{layer} keeps no checkpoint-layout weight to apply a delta to (a kernel that repacks, such as "
                    "every linear layer on CPU); WEIGHTWIRE_VLLM_DELTA_COPIES=1 keeps host copies for such layers"
                )
    return None


class DeltasVLLMAdapter(SlicesVLLMAdapter):
    """A ``SlicesVLLMAdapter`` that applies delta updates (``AppliesDeltas``; module docstring).
    Made by ``build_adapter``."""

    bases: LayerBases
    _first_delta: bool

    def begin_update(self, version: int) -> None:
        super().begin_update(version)
        self._first_delta = True

    def apply_deltas(self, deltas: Sequence[tuple[str, Delta]]) -> None:
        """Each layer a delta changes is loaded again from its base with the changes applied (module
        docstring); DELTA_BASE_MISMATCH before any write of the update when a tensor has no base."""
        if not deltas:
            return
        names = list(self._manifest.tensors) if self._first_delta else [n for n, _ in deltas]
        self._first_delta = False
        missing = self.bases.without_base(names)
        if missing:
            raise _no_base(self.worker_id, missing)
        by_layer: dict[str, dict[str, Delta]] = {}
        for name, delta in deltas:
            by_layer.setdefault(self.layout.targets[name].layer_name, {})[name] = delta
        waiting = sorted(layer for layer in by_layer if self._open_layers.get(layer))
        if waiting:
            raise delta_error(
                DELTA_BASE_MISMATCH,
                f"{self.worker_id}: {waiting[0]} received whole tensors in this update and waits for the rest of "
                "them, so vLLM holds none of its weights to apply a delta to; send the layer's tensors all whole or "
                "all as deltas",
                tensor=sorted(by_layer[waiting[0]])[0],
            )
        for layer, changes in by_layer.items():
            if all(d.changed_count == 0 for d in changes.values()):
                continue  # nothing of the layer changes: its base is the result
            # Loaded already in this update (its deltas came in another call): a new reload session.
            self._open_layers.pop(layer, None)
            self.load(
                [(n, self._applied(n, changes.get(n))) for n in sorted(self.layout.names_by_layer[layer])]
            )

    def refuse_deltas(self, names: frozenset[str]) -> None:
        """DELTA_BASE_MISMATCH unless every tensor this worker owns has a base (what the first delta
        of an update checks); called before anything of a delta bucket from every trainer rank waits
        (``RefusesDeltas``: its region deltas are handed to ``apply_deltas`` at the commit)."""
        missing = self.bases.without_base(self._manifest.tensors)
        if missing:
            raise _no_base(self.worker_id, missing)

    def delta_parts(self, name: str) -> Sequence[tuple[Piece | None, torch.Tensor]]:
        """This rank's piece of ``name`` where its base is now (module docstring), as its manifest's piece."""
        held = self.bases.base_of(name)
        if held is None:
            raise _no_base(self.worker_id, [name])
        return [(self._piece(name), held)]

    # --- internals -----------------------------------------------------------------------------

    def _piece(self, name: str) -> Piece | None:
        pieces = self._manifest.tensors[name].pieces
        return (pieces[0].dim, pieces[0].offset, pieces[0].length) if pieces else None

    def _applied(self, name: str, delta: Delta | None) -> torch.Tensor:
        """The full checkpoint tensor ``name`` with this rank's piece at its base plus ``delta``."""
        base = self.bases.base_of(name)
        assert base is not None  # checked before anything was written
        kept = base.clone()
        if delta is not None and delta.changed_count:
            piece = self._piece(name)
            with torch.no_grad():
                if piece is None:
                    apply_delta(kept, delta, checked=True)
                else:
                    apply_to_piece(kept, delta, tuple(self._manifest.tensors[name].shape), *piece)
        return full_tensor(self.layout.targets[name], kept)

    def _load_batch(self, batch: list[tuple[str, torch.Tensor]], arriving: dict[str, set[str]]) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        self.bases.arrived(batch)
        try:
            super()._load_batch(batch, arriving)
        except BaseException:
            self.bases.drop(arriving)
            raise
        for layer in arriving:
            if self._open_layers.get(layer):
                continue  # still waiting for tensors
            why = self.bases.settle(
                layer,
                processed=not get_layerwise_info(self._layers[layer]).can_load(),
                plain_copy=layer in self.direct.proven,
            )
            if why is not None:
                log.info(
                    "weightwire %s: %s takes no delta until its next reload: %s", self.worker_id, layer, why
                )

    def _restore(self, layers: dict[str, set[str]], *, why: str) -> None:
        super()._restore(layers, why=why)
        self.bases.drop(layers)

    def end_update(self, success: bool) -> None:
        try:
            super().end_update(success)
        finally:
            self.bases.drop_pending()

    def woken(self, tags: Sequence[str] | None) -> None:
        level = self.asleep_level
        super().woken(tags)
        if (tags is None or "weights" in tags) and level is not None and level >= 2:
            self.bases.forget()


def _no_base(worker_id: str, missing: list[str]) -> WeightwireError:
    return delta_error(
        DELTA_BASE_MISMATCH,
        f"{worker_id}: {len(missing)} tensor(s), first {missing[0]!r}, have no base this worker can apply a delta "
        "to (not loaded by a push through vLLM's reload since the engine started, or its layer's reload could not "
        "be checked); send the update whole",
        tensor=missing[0],
        no_base_count=str(len(missing)),
    )


def build_adapter(*args: Any, delta_copies: bool = False, **kwargs: Any) -> SlicesVLLMAdapter:
    """The adapter of one worker (``VLLMAdapter``'s arguments): a ``DeltasVLLMAdapter`` unless
    ``why_no_deltas`` says why not (logged), else a ``SlicesVLLMAdapter``."""
    plain = SlicesVLLMAdapter(*args, **kwargs)
    why = why_no_deltas(plain, copies=delta_copies)
    if why is not None:
        log.info("weightwire %s does not apply delta updates: %s", plain.worker_id, why)
        return plain
    # The same state under the class that publishes AppliesDeltas: the layout is worked out and
    # the forward hooks installed once.
    adapter = DeltasVLLMAdapter.__new__(DeltasVLLMAdapter)
    adapter.__dict__.update(plain.__dict__)
    adapter.bases = LayerBases(adapter.layout, adapter._layers, copies=delta_copies)
    adapter._first_delta = True
    return adapter
