"""Slices from every trainer rank into an SGLang rank: the kept regions its parameters hold, and
the staged write into them.

An update whose every trainer rank is a source (``TRANSFER_MODE_SLICES``) fills the tensors a worker
keeps (``KeepsTensors``). For SGLang these are the regions ``direct_copy.destinations`` states: this
rank's piece of each checkpoint tensor at its shard's rows of the fused parameter (q/k/v, gate/up),
an embedding's rows without its vocabulary padding, and for a tied model with its own lm_head
parameter both regions (each gets the same bytes). The worker receives a bucket into staging of
those shapes and hands it to ``write_kept`` only once it arrived whole and checked; the copy then
runs on the engine thread through the adapter's pause gate, like every other write.

What may be written is decided twice. At start (``build_adapter``): every owned tensor must have a
stated region of its kept shape; a rank where one has none (a quantized layer, whose post-load
processing repacks or rebinds its parameters; a layout these rules do not know) is built without
``kept_tensors``, so its manifest says ``receives_slices`` false, and the reason is logged. Per
update (``refuse_slices``): every tensor of a slices bucket must have been loaded once through
``load_weights`` and found where the regions say (``SGLangAdapter.proven``); until then the bucket is
refused before a byte moves (TRANSPORT_UNAVAILABLE), and a single-source push does that first load.

The same proven regions take delta updates (``DeltasSGLangAdapter``, ``AppliesDeltas``): a rank
whose every target keeps exactly its manifest's part (``deltas.delta_layout``) applies each delta
into them in place and hands them to the worker as the parts its result checksums cover. That
holds for deltas from every trainer rank too: the worker asks ``refuse_deltas`` before anything of
such a bucket waits, holds the checked region deltas (not the model) until the commit, and then
hands them to ``apply_deltas`` (``weightwire.server.worker.staged_deltas``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from weightwire.adapters.sglang.adapter import SGLangAdapter
from weightwire.adapters.sglang.deltas import KeptPart, apply_to_parts, delta_layout, refuse_unproven
from weightwire.adapters.sglang.direct_copy import DirectCopy
from weightwire.core.delta import Delta
from weightwire.core.errors import Reason, WeightwireError
from weightwire.server.transports.transfer_group_slices import kept_shape

log = logging.getLogger(__name__)

__all__ = ["DeltasSGLangAdapter", "SlicesSGLangAdapter", "build_adapter", "kept_regions"]


def kept_regions(adapter: SGLangAdapter) -> tuple[dict[str, tuple[torch.Tensor, ...]], str | None]:
    """Every owned tensor's regions in the parameters (one per target it fills), or why a rank
    cannot take slices: the first tensor whose region cannot be stated or has another shape."""
    if not adapter._direct_copy:
        return {}, "direct copies are off (WEIGHTWIRE_SGLANG_DIRECT_COPY=0), so no region is ever checked"
    manifest = adapter.manifest()
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, targets in adapter.layout.targets.items():
        want = kept_shape(manifest.tensors[name])
        regions = []
        for t in targets:
            region = adapter._dst.get((t.param_name, t.shard_id, name))
            if region is None:
                if t.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"):
                    # SGLang's post-load processing of FP8 layers may requantise or rebind weight and
                    # scale (DeepGEMM's UE8M0 scales, the CPU's AMX prepacking).
                    why = (
                        "an FP8 layer (quantized or repacked: its post-load processing may requantise or rebind "
                        "it); push FP8 weights from one source"
                    )
                else:
                    why = "its place in the parameter cannot be stated (quantized or repacked)"
                return {}, f"{name} -> {t.param_name}: {why}"
            if tuple(region.shape) != want or region.dtype != targets[0].dtype:
                return (
                    {},
                    f"{name} -> {t.param_name}: its region is {tuple(region.shape)}, not the kept {want}",
                )
            regions.append(region)
        out[name] = tuple(regions)
    return out, None


class SlicesSGLangAdapter(SGLangAdapter):
    """An ``SGLangAdapter`` whose every owned tensor has a stated region: ``KeepsTensors``, and the
    staged write of a slices bucket (``refuse_slices`` / ``write_kept``). Made by ``build_adapter``."""

    _regions: dict[str, tuple[torch.Tensor, ...]]

    def kept_tensors(self) -> Mapping[str, torch.Tensor]:
        """The first region of each owned tensor (shape and dtype of what a worker keeps of it);
        writes go through ``write_kept``, which fills every region."""
        return {name: regions[0] for name, regions in self._regions.items()}

    def refuse_slices(self, names: frozenset[str]) -> None:
        """TRANSPORT_UNAVAILABLE unless every one of ``names`` was proven by a load through
        ``load_weights`` (module docstring); called before a byte of the bucket moves."""
        unproven = sorted(names - self.proven)
        if unproven:
            raise WeightwireError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"{self.worker_id}: {len(unproven)} tensor(s), first {unproven[0]!r}, were not loaded through SGLang's "
                "load_weights and checked yet; push once from one trainer rank (scope FULL) before pushing slices "
                "from every rank",
                tensor=unproven[0],
            )

    def write_kept(self, staged: Mapping[str, torch.Tensor]) -> None:
        """Copy a whole, checked bucket's staged tensors into every region they fill, on the engine
        thread in a pass whose gate allows writing (ENGINE_NOT_PAUSED otherwise, nothing written)."""
        self.refuse_slices(frozenset(staged))
        direct = DirectCopy([(region, src) for name, src in staged.items() for region in self._regions[name]])

        def copy_step() -> None:
            self._synchronize()  # a forward launched before the pause may still read the weights
            self._wrote = True
            with torch.no_grad():
                direct.copy()
            self._synchronize()  # the ack promises the bytes are in the model

        self._count_load(len(staged), direct=True)
        self._gated(copy_step, what=f"write {len(staged)} received tensor(s)", phase="load")


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
    only the regions are stated, else a plain one (its manifest says receives_slices false, and a
    delta update is refused at its header; the reason is logged)."""
    plain = SGLangAdapter(model, hf_config, **kwargs)
    regions, refusal = kept_regions(plain)
    if refusal is not None:
        log.warning(
            "%s does not receive slices from every trainer rank nor apply deltas: %s",
            plain.worker_id,
            refusal,
        )
        return plain
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
