"""Region deltas of an update whose every trainer rank is a source, applied by an adapter that writes
its model itself (``StagesSlices``: SGLang, vLLM) through its own delta path (``AppliesDeltas``).

In such an update (``TRANSFER_MODE_SLICES`` with ``UpdateHeader.delta_base``) each region of a
bucket carries its changes, received as the sources' streams and checked whole
(``weightwire.server.transports.transfer_group_slice_deltas``). An adapter that only
``KeepsTensors`` (the demo's ``TorchAdapter``) has them applied into its kept tensors at the
commit. SGLang and vLLM write nothing but through their engine's gates (their slices go through
staging of their own), and both already apply a single source's deltas through those gates: SGLang
in place into the regions its direct copy proved, vLLM through its layerwise reload, which keeps
repacked kernel weights right. So when such an adapter also ``RefusesDeltas``, the worker:

1. before anything of a bucket waits, asks it whether it holds a base for every tensor of the bucket
   (``refuse_deltas``): DELTA_BASE_MISMATCH otherwise, nothing received or written, the worker
   CONSISTENT at its version, and the trainer sends the update whole;
2. receives and checks the bucket's region deltas like any worker: nothing reaches the model;
3. at the commit (``apply_staged``) turns every region delta of the update (all its buckets) into
   one delta per tensor over the full checkpoint tensor (``full_tensor_delta``: each change moved
   from its place in the region to its place in the tensor), has the adapter apply them in one
   ``apply_deltas`` call (its gates, its base checks; a vLLM layer whose tensors came in two
   buckets is reloaded once), then verifies every region against the trainer's checksum in each
   part the adapter keeps of its tensor (``delta_parts``): DELTA_RESULT_MISMATCH fails the commit
   and leaves the worker INCONSISTENT, as a single source's delta does.

Memory beyond the model: the update's streams (its encoded bytes) until the commit; then, while
the deltas are applied, an int64 position per changed element (twice, for the sort) and the
values, plus what the adapter's ``apply_deltas`` holds (vLLM: one layer's pieces at a time).

Called by ``filled_bucket`` (steps 1 and 3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from weightwire.core import dtypes
from weightwire.core.delta import Delta, check_delta, verify_result
from weightwire.core.delta.encoding import Encoding, bits_dtype, changed_positions, index_dtype_for
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.transfer_group_slices import kept_region
from weightwire.server.transports.importer import RegionChange
from weightwire.server.worker.adapter import AppliesDeltas

Box = tuple[tuple[int, int], ...]

__all__ = ["RefusesDeltas", "StagedDeltas", "apply_staged", "full_tensor_delta"]


@runtime_checkable
class RefusesDeltas(Protocol):
    """An adapter that says, before anything of a bucket waits, whether it can apply deltas to
    these tensors now (module docstring, step 1)."""

    def refuse_deltas(self, names: frozenset[str]) -> None:
        """Raise DELTA_BASE_MISMATCH (metadata ``tensor``) unless a delta to each of ``names`` can be
        applied now; writes nothing."""
        ...


@dataclasses.dataclass(frozen=True)
class StagedDeltas:
    """One bucket's checked region deltas, held until the commit (``apply_staged`` applies every
    such bucket of the update in one ``apply_deltas``)."""

    adapter: AppliesDeltas
    changes: Sequence[RegionChange]
    manifest: ShardManifest
    will_write: Callable[[], None]

    def __call__(self) -> None:
        apply_staged([self])


def full_tensor_delta(
    shape: Sequence[int], dtype: torch.dtype, regions: Sequence[tuple[Box, Delta]]
) -> Delta:
    """One INDICES delta over the full tensor of ``shape`` from checked deltas of disjoint regions
    of it (each addressing its box's elements in row-major order): every change at its row-major
    place in the tensor, ascending."""
    numel = 1
    for n in shape:
        numel *= n
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    positions: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for box, delta in regions:
        local = changed_positions(delta)
        if local is None:  # DENSE: every element of the region
            local = torch.arange(delta.numel, dtype=torch.int64, device=delta.values.device)
        local = local.to(delta.values.device)
        if local.numel() == 0:
            continue
        sizes = [b - a for a, b in box]
        coords = torch.unravel_index(local, sizes) if sizes else ()
        at = torch.zeros_like(local)
        for d, c in enumerate(coords):
            at += (c + box[d][0]) * strides[d]
        positions.append(at)
        values.append(delta.values.reshape(-1))
    if not positions:
        return Delta(
            Encoding.INDICES,
            numel,
            dtype,
            0,
            values=torch.empty(0, dtype=bits_dtype(dtype)),
            indices=torch.empty(0, dtype=index_dtype_for(numel)),
        )
    at = torch.cat(positions)
    order = torch.argsort(at)
    return Delta(
        Encoding.INDICES,
        numel,
        dtype,
        at.numel(),
        values=torch.cat(values)[order],
        indices=at[order].to(index_dtype_for(numel)),
    )


def apply_staged(steps: Sequence[StagedDeltas]) -> None:
    """Step 3 of the module docstring for every bucket of ``steps`` (one adapter's, one update's)."""
    if not steps:
        return
    adapter, manifest = steps[0].adapter, steps[0].manifest
    by_tensor: dict[str, list[RegionChange]] = {}
    for step in steps:
        for change in step.changes:
            by_tensor.setdefault(change.tensor, []).append(change)
    deltas: list[tuple[str, Delta]] = []
    for name, changes in by_tensor.items():
        owned = manifest.tensors[name]
        dtype = dtypes.to_torch(owned.dtype)
        merged = full_tensor_delta(owned.shape, dtype, [(c.box, c.delta) for c in changes])
        # What a single source's delta passes before it reaches the adapter (regions overlapping,
        # which a checked plan rules out, would show here as positions not strictly ascending).
        check_delta(torch.empty(tuple(owned.shape), dtype=dtype, device="meta"), merged, tensor=name)
        deltas.append((name, merged))
    steps[0].will_write()
    adapter.apply_deltas(deltas)
    for name, changes in by_tensor.items():
        owned = manifest.tensors[name]
        parts = adapter.delta_parts(name)
        for c in changes:
            for _, part in parts:  # a tied embedding and lm_head: both verified
                verify_result(c.result_checksums, [(None, kept_region(part, owned, c.box))], tensor=name)
