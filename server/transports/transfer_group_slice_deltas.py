"""The worker's part of a delta update whose every trainer rank is a source: a slices bucket whose
regions carry ``SliceTransfer.delta``, received as the sources' streams of encodings
(``weightwire.core.transports.transfer_group_slice_deltas``) and applied into the kept tensors at
the update's commit. No gRPC in here.

In order, per bucket (``GroupImporter.fill`` calls ``check_slice_deltas`` and then
``receive_delta_bucket``):

1. before anything waits: every region carries a delta (a delta bucket is all deltas; a region
   the trainer has no base for comes as a DENSE one), each delta's size derives from its counts and
   dtypes alone (``encoded_nbytes``), and each carries a result checksum of a known algorithm for
   the region (``piece`` unset: the regions tile the kept pieces exactly, so verifying every
   region verifies every kept element);
2. every member compares the plan's fingerprint (``agree``), then each source's stream arrives
   whole into a buffer of this worker's (not the model);
3. every delta is read and checked against its region (``read_delta``, ``check_delta``: indices in
   range and strictly ascending, the bitmap's bits, the value count) before anything is written:
   INVALID_DELTA leaves the model untouched;
4. at the commit (or at once without deferred landings) each delta is applied into the region of
   the kept tensor (``apply_delta``) and the region's checksum compared with the trainer's
   (``verify_result``): DELTA_RESULT_MISMATCH then fails the commit, the worker INCONSISTENT.
   A worker whose adapter applies deltas itself (SGLang, vLLM: ``FillTarget.changes``) is handed
   the checked deltas instead (``weightwire.server.worker.staged_deltas`` applies them).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping

import torch
from weightwire.core import dtypes
from weightwire.core.delta import VERIFIED_ALGORITHMS, check_delta, read_delta, verify_result
from weightwire.core.delta.encoding import Delta, apply_delta
from weightwire.core.delta.errors import invalid_delta
from weightwire.core.errors import raises_without_frames
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.transfer_group_agreement import agree
from weightwire.core.transports.transfer_group_slice_deltas import (
    encoded_nbytes,
    receive_streams,
    stream_layout,
)
from weightwire.core.transports.transfer_group_slices import kept_region
from weightwire.core.transports.transfer_plan import Transfer, box_elements
from weightwire.server.transports.importer import RegionChange
from weightwire.server.transports.transfer_group_member import JoinedGroup
from weightwire.server.transports.transfer_group_slices import SlicePlan, backend_device
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = [
    "RegionDeltas",
    "apply_regions",
    "carries_slice_deltas",
    "check_slice_deltas",
    "read_regions",
    "receive_delta_bucket",
]


@dataclasses.dataclass(frozen=True)
class RegionDelta:
    """One region's delta: where its encoding lies in its source's stream."""

    transfer: Transfer
    msg: pb.TensorDelta
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class RegionDeltas:
    """A checked delta bucket: its regions' deltas and each source's stream bytes."""

    regions: tuple[RegionDelta, ...]
    sizes: dict[int, int]

    @property
    def changed_elements(self) -> int:
        return sum(r.msg.changed_count for r in self.regions)


def carries_slice_deltas(payload: pb.Payload) -> bool:
    """Whether any region of a slices payload carries a delta (the bucket is then all deltas)."""
    return any(s.HasField("delta") for s in payload.transfer_group.slices)


def check_slice_deltas(payload: pb.Payload, checked: SlicePlan, manifest: ShardManifest) -> RegionDeltas:
    """Rule 1 of the module docstring, for a payload ``check_slices`` passed; raises INVALID_DELTA."""
    slices = payload.transfer_group.slices
    by_source: dict[int, list[int]] = {}
    sizes: list[int] = []
    for i, (s, t) in enumerate(zip(slices, checked.plan.transfers, strict=True)):
        where = {"tensor": t.tensor, "region": str(i)}
        if not s.HasField("delta"):
            raise invalid_delta(
                f"region {i} of {t.tensor!r} carries no delta, but other regions of its bucket do; in a delta "
                "update every region carries one (a region without a base as a DENSE delta)",
                **where,
            )
        owned = manifest.tensors[t.tensor]
        sizes.append(encoded_nbytes(s.delta, box_elements(t.box), dtypes.itemsize(owned.dtype), **where))
        region_sums = [c for c in s.delta.result_checksums if not c.HasField("piece")]
        if not region_sums or any(c.checksum.algorithm not in VERIFIED_ALGORITHMS for c in region_sums):
            raise invalid_delta(
                f"region {i} of {t.tensor!r}: a delta of a region needs a result checksum of the region (piece "
                "unset) in one of the manifest's delta_checksum_algorithms",
                **where,
            )
        by_source.setdefault(t.source, []).append(i)
    regions: list[RegionDelta | None] = [None] * len(sizes)
    totals: dict[int, int] = {}
    for source, indices in by_source.items():
        offsets, totals[source] = stream_layout([sizes[i] for i in indices])
        for i, at in zip(indices, offsets, strict=True):
            regions[i] = RegionDelta(checked.plan.transfers[i], slices[i].delta, at, sizes[i])
    return RegionDeltas(tuple(r for r in regions if r is not None), totals)


def read_regions(
    deltas: RegionDeltas, streams: Mapping[int, torch.Tensor], manifest: ShardManifest
) -> list[tuple[RegionDelta, Delta]]:
    """Rule 3: every region's delta read from its source's stream and checked against the region
    (INVALID_DELTA); nothing is written."""
    read: list[tuple[RegionDelta, Delta]] = []
    for r in deltas.regions:
        t = r.transfer
        dtype = dtypes.to_torch(manifest.tensors[t.tensor].dtype)
        where = {"tensor": t.tensor}
        view = streams[t.source][r.offset : r.offset + r.nbytes]
        delta = read_delta(r.msg, dtype, box_elements(t.box), view, 0, **where)
        # The region's elements and dtype are all the check needs of it (no bytes are read).
        check_delta(torch.empty([b - a for a, b in t.box], dtype=dtype, device="meta"), delta, **where)
        read.append((r, delta))
    return read


def apply_regions(
    read: list[tuple[RegionDelta, Delta]], kept: Mapping[str, torch.Tensor], manifest: ShardManifest
) -> None:
    """Rule 4: each checked delta applied into its region of the kept tensor, then the region's
    checksum compared with the trainer's (DELTA_RESULT_MISMATCH)."""
    for r, delta in read:
        t = r.transfer
        target = kept_region(kept[t.tensor], manifest.tensors[t.tensor], t.box)
        apply_delta(target, delta, checked=True, tensor=t.tensor)
        verify_result(r.msg.result_checksums, [(None, target)], tensor=t.tensor)
    if any(kept[r.transfer.tensor].is_cuda for r, _ in read):
        torch.cuda.synchronize()  # the commit's result promises the bytes are in the model


@raises_without_frames
def receive_delta_bucket(
    member: JoinedGroup,
    checked: SlicePlan,
    deltas: RegionDeltas,
    max_message_bytes: int,
    kept: Mapping[str, torch.Tensor],
    manifest: ShardManifest,
    lock: threading.Lock,
    will_write: Callable[[], None],
    stopped: Callable[[], bool] | None = None,
    landings: list[Callable[[], None]] | None = None,
    changes: list[RegionChange] | None = None,
) -> int:
    """Rules 2 to 4 of the module docstring; returns the bytes received (the sources' streams).
    With ``landings`` the deltas are applied and verified when the caller runs what is appended
    to it (at the commit); without, at once. With ``changes`` they are appended there instead,
    checked and not applied (rule 4 is the caller's)."""
    group = member.group
    pg = group.process_group()
    timeout_s = group.timeout.total_seconds()
    # NCCL receives on the GPU: the streams land beside the kept tensors and apply there.
    device = backend_device(group, kept)
    with lock:
        agree(pg, checked.plan, group.rank, group.world_size, timeout_s, stopped, device)
        streams = receive_streams(
            pg,
            deltas.sizes,
            device,
            timeout_s=timeout_s,
            max_message_bytes=max_message_bytes,
            stopped=stopped,
        )
    read = read_regions(deltas, streams, manifest)

    def apply() -> None:
        will_write()
        apply_regions(read, kept, manifest)

    if changes is not None:
        changes.extend(
            RegionChange(r.transfer.tensor, r.transfer.box, r.msg.result_checksums, delta)
            for r, delta in read
        )
    elif landings is not None:
        landings.append(apply)
    else:
        apply()
    received = sum(deltas.sizes.values())
    with member.cond:
        member.bytes_received += received
    return received
