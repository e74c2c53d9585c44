"""Slices from every trainer rank into an SGLang rank: the kept regions its parameters hold, and
the staged write into them.

An update whose every trainer rank is a source (``TRANSFER_MODE_SLICES``) fills the tensors a worker
keeps (``KeepsTensors``). For SGLang these are the regions ``direct_copy.destinations`` states: this
rank's piece of each checkpoint tensor at its shard's rows of the fused parameter (q/k/v, gate/up),
an embedding's rows without its vocabulary padding, and for a tied model with its own lm_head
parameter both regions (each gets the same bytes). The worker receives a bucket into staging of
those shapes and hands it to ``write_kept`` only once it arrived whole and checked; the write then
runs on the engine thread through the adapter's pause gate, like every other write.

A block-FP8 layer (dense ``Fp8LinearMethod`` or ``Fp8MoEMethod`` experts: the only quantized layers
the manifest takes) has no region: its post-load processing may requantise or rebind weight and
scale (DeepGEMM's UE8M0 scales, the CPU's AMX prepacking), so nothing is copied into it directly.
Its tensors (each FP8 ``weight`` and each ``weight_scale_inv``, owned tensors of their own on whole
128 x 128 blocks, ``core.fp8_geometry``; a bias of such a layer too) are kept in staging only, and
``write_kept`` loads them through SGLang's own ``load_weights`` (``SGLangAdapter._load_one``, its
weight loaders instrumented), between the update's begin and end weight update steps like a load
from one source, so the post-load processing reruns: each staged piece is widened into a tensor
of the checkpoint's shape with this rank's rows (columns) in place, where its TP loader reads them
(``checkpoint_tensor``; the other rows are never read). Memory beyond the staging of the update:
one checkpoint tensor at a time, on the staging's device (host memory over gloo), freed once loaded.

What may be written is decided twice. At start (``build_adapter``): every owned tensor must have a
stated region of its kept shape or belong to a block-FP8 layer; a rank where one does neither (a
layout these rules do not know) is built without ``kept_tensors``, so its manifest says
``receives_slices`` false, and the reason is logged. Per update (``refuse_slices``): every tensor of
a slices bucket with a region must have been loaded once through ``load_weights`` and found where
the regions say (``SGLangAdapter.proven``); until then the bucket is refused before a byte moves
(TRANSPORT_UNAVAILABLE), and a single-source push does that first load. Tensors of FP8 layers need
no such proof: they always go through ``load_weights``.

The same proven regions take delta updates (``DeltasSGLangAdapter``, ``AppliesDeltas``): a rank
whose every target keeps exactly its manifest's part (``deltas.delta_layout``) applies each delta
into them in place and hands them to the worker as the parts its result checksums cover. That
holds for deltas from every trainer rank too: the worker asks ``refuse_deltas`` before anything of
such a bucket waits, holds the checked region deltas (not the model) until the commit, and then
hands them to ``apply_deltas`` (``weightwire.server.worker.staged_deltas``). A rank with FP8 layers
applies no deltas (they have no region to apply them in).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from weightwire.adapters.sglang.adapter import SGLangAdapter
from weightwire.adapters.sglang.deltas import KeptPart, apply_to_parts, delta_layout, refuse_unproven
from weightwire.adapters.sglang.direct_copy import DirectCopy, quantized_layer
from weightwire.core.delta import Delta
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import OwnedTensor
from weightwire.server.transports.transfer_group_slices import kept_shape

log = logging.getLogger(__name__)

__all__ = ["DeltasSGLangAdapter", "SlicesSGLangAdapter", "build_adapter", "checkpoint_tensor", "kept_regions"]


def kept_regions(adapter: SGLangAdapter) -> tuple[dict[str, tuple[torch.Tensor, ...]], str | None]:
    """Every owned tensor's regions in the parameters (one per target it fills; none for a tensor
    of a block-FP8 layer, which loads through ``load_weights``), or why a rank cannot take slices:
    the first tensor whose region cannot be stated or has another shape."""
    if not adapter._direct_copy:
        return {}, "direct copies are off (WEIGHTWIRE_SGLANG_DIRECT_COPY=0), so no region is ever checked"
    manifest = adapter.manifest()
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, targets in adapter.layout.targets.items():
        quantized = [quantized_layer(adapter.model, t.param_name) for t in targets]
        if all(quantized):
            out[name] = ()  # staged, then loaded through load_weights (module docstring)
            continue
        if any(quantized):
            return {}, f"{name}: fills parameters of quantized and unquantized layers alike"
        want = kept_shape(manifest.tensors[name])
        regions = []
        for t in targets:
            region = adapter._dst.get((t.param_name, t.shard_id, name))
            if region is None:
                return {}, f"{name} -> {t.param_name}: its place in the parameter cannot be stated"
            if tuple(region.shape) != want or region.dtype != targets[0].dtype:
                return (
                    {},
                    f"{name} -> {t.param_name}: its region is {tuple(region.shape)}, not the kept {want}",
                )
            regions.append(region)
        out[name] = tuple(regions)
    return out, None


def checkpoint_tensor(owned: OwnedTensor, kept: torch.Tensor) -> torch.Tensor:
    """A tensor of ``owned``'s checkpoint shape with ``kept`` (its pieces one after another along
    their dimension, in manifest order) in place; ``kept`` itself when this rank keeps it whole.
    The rest is left unset: this rank's weight loaders never read it."""
    if not owned.pieces:
        return kept
    full = torch.empty(tuple(owned.shape), dtype=kept.dtype, device=kept.device)
    at = 0
    for piece in owned.pieces:
        full.narrow(piece.dim, piece.offset, piece.length).copy_(kept.narrow(piece.dim, at, piece.length))
        at += piece.length
    return full


class SlicesSGLangAdapter(SGLangAdapter):
    """An ``SGLangAdapter`` whose every owned tensor has a stated region or belongs to a block-FP8
    layer: ``KeepsTensors``, and the staged write of a slices bucket (``refuse_slices`` /
    ``write_kept``). Made by ``build_adapter``."""

    _regions: dict[str, tuple[torch.Tensor, ...]]

    def kept_tensors(self) -> Mapping[str, torch.Tensor]:
        """Per owned tensor, one of its kept shape and dtype: its first region, or for a tensor of
        an FP8 layer one that holds no bytes (one element, expanded). The worker stages into new
        tensors of these shapes; writes go through ``write_kept``, which fills every region."""
        out: dict[str, torch.Tensor] = {}
        for name, regions in self._regions.items():
            if regions:
                out[name] = regions[0]
            else:
                dtype = self.layout.targets[name][0].dtype
                out[name] = torch.empty((), dtype=dtype, device=self.device).expand(
                    kept_shape(self._manifest.tensors[name])
                )
        return out

    def refuse_slices(self, names: frozenset[str]) -> None:
        """TRANSPORT_UNAVAILABLE unless every one of ``names`` that has a region was proven by a
        load through ``load_weights`` (module docstring; tensors of FP8 layers always load through
        it); called before a byte of the bucket moves."""
        unproven = sorted(n for n in names - self.proven if self._regions.get(n))
        if unproven:
            raise WeightwireError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"{self.worker_id}: {len(unproven)} tensor(s), first {unproven[0]!r}, were not loaded through SGLang's "
                "load_weights and checked yet; push once from one trainer rank (scope FULL) before pushing slices "
                "from every rank",
                tensor=unproven[0],
            )

    def write_kept(self, staged: Mapping[str, torch.Tensor]) -> None:
        """Write a whole, checked bucket's staged tensors on the engine thread in a pass whose gate
        allows writing (ENGINE_NOT_PAUSED otherwise, nothing written): a tensor with regions copied
        into every one, a tensor of an FP8 layer widened to its checkpoint shape and loaded
        through ``load_weights``, one at a time (module docstring)."""
        self.refuse_slices(frozenset(staged))
        direct = DirectCopy([(region, src) for name, src in staged.items() for region in self._regions[name]])
        loaded = [name for name in staged if not self._regions[name]]

        def write_step() -> None:
            self._synchronize()  # a forward launched before the pause may still read the weights
            self._wrote = True
            with torch.no_grad():
                direct.copy()
                for name in loaded:
                    self._load_one(name, checkpoint_tensor(self._manifest.tensors[name], staged[name]))
            self._synchronize()  # the ack promises the bytes are in the model

        self._count_load(len(staged), direct=not loaded)
        self._gated(write_step, what=f"write {len(staged)} received tensor(s)", phase="load")


class DeltasSGLangAdapter(SlicesSGLangAdapter):
    """A ``SlicesSGLangAdapter`` that also applies delta updates (``AppliesDeltas``) into its proven
    regions (``weightwire.adapters.sglang.deltas``). Made by ``build_adapter``."""

    _parts: dict[str, list[KeptPart]]

    def apply_deltas(self, deltas: Sequence[tuple[str, Delta]]) -> None:
        """Write each checked delta into every region of its tensor, on the engine thread in a pass
        whose gate allows writing; a tensor whose regions are not proven is refused first
        (DELTA_BASE_MISMATCH), before any delta of the call is written."""
        if not deltas:
            return
        names = [name for name, _ in deltas]
        refuse_unproven(self.worker_id, names, self.proven)
        shapes = {name: tuple(self._manifest.tensors[name].shape) for name in names}

        def apply_step() -> None:
            # Again on the engine thread: a wake that dropped the weights' bytes forgets proofs there.
            refuse_unproven(self.worker_id, names, self.proven)
            self._synchronize()  # a forward launched before the pause may still read the weights
            self._wrote = True
            with torch.no_grad():
                for name, delta in deltas:
                    apply_to_parts(self._parts[name], delta, shapes[name])
            self._synchronize()  # the result is verified as soon as this returns

        self._count_load(len(deltas), direct=True)
        self._gated(apply_step, what=f"apply {len(deltas)} delta(s)", phase="load")

    def refuse_deltas(self, names: frozenset[str]) -> None:
        """DELTA_BASE_MISMATCH unless every one of ``names`` was proven (``deltas.refuse_unproven``);
        called before anything of a delta bucket from every trainer rank waits (``RefusesDeltas``:
        its region deltas are then handed to ``apply_deltas`` at the commit)."""
        refuse_unproven(self.worker_id, names, self.proven)

    def delta_parts(self, name: str) -> Sequence[KeptPart]:
        """Each region of ``name`` as the part it keeps (its manifest piece, or None for the whole)."""
        return self._parts[name]


def build_adapter(model: torch.nn.Module, hf_config: Any, **kwargs: Any) -> SGLangAdapter:
    """The adapter of one rank (``SGLangAdapter``'s arguments): a ``DeltasSGLangAdapter`` when every
    owned tensor has a stated region that is its manifest's part, a ``SlicesSGLangAdapter`` when
    only the regions are stated or some tensors belong to block-FP8 layers (loaded through
    ``load_weights``), else a plain one (its manifest says receives_slices false, and a delta
    update is refused at its header; the reason is logged)."""
    plain = SGLangAdapter(model, hf_config, **kwargs)
    regions, refusal = kept_regions(plain)
    fp8 = next((name for name, found in regions.items() if not found), None)
    if refusal is not None:
        log.warning(
            "%s does not receive slices from every trainer rank nor apply deltas: %s",
            plain.worker_id,
            refusal,
        )
        return plain
    if fp8 is not None:
        parts: dict[str, list[KeptPart]] = {}
        delta_refusal: str | None = (
            f"{fp8}: a block-FP8 layer's tensors load through load_weights, in no region"
        )
    else:
        parts, delta_refusal = delta_layout(plain.manifest(), plain.layout, regions)
    if delta_refusal is not None:
        log.warning("%s does not apply deltas: %s", plain.worker_id, delta_refusal)
    # The same state under the class that publishes KeepsTensors (and AppliesDeltas): the model's
    # layout is worked out once.
    cls = SlicesSGLangAdapter if delta_refusal is not None else DeltasSGLangAdapter
    adapter = cls.__new__(cls)
    adapter.__dict__.update(plain.__dict__)
    adapter._regions = regions
    if isinstance(adapter, DeltasSGLangAdapter):
        adapter._parts = parts
    return adapter
