"""The worker's importer of transfer-group payloads: a bucket's bytes received over the worker's
group into a bounded staging buffer, checked against the byte ranges it announces, and handed to the
service as tensor views. No gRPC in here.

The transport table (``weightwire.core.transports.table.TRANSFER_GROUP``) names ``GroupImporter``.
It receives through the worker's ``GroupMembership`` (``transfer_group_membership``), which the
worker service owns for JoinTransferGroup / LeaveTransferGroup and the status. Per bucket whose payload
is a ``TransferGroupHandle``, ``open``: the bytes arrive from the source rank (a point-to-point
receive, or this worker's part of a broadcast in its subgroup) into one of at most
``MAX_STAGING_BUFFERS`` buffers on the worker's device. ``weightwire.server.transports.read_ahead``
calls ``ahead`` with the next bucket's payload while this one loads, so its receive overlaps the load.
A failed update (``release``) tears the group down.

A slices handle (``TRANSFER_MODE_SLICES``: every trainer rank a source) is the one kind of payload
this importer loads itself (``FillsModel``): ``plan_fill`` checks it against the manifest and
``fill`` receives its regions straight into the tensors the engine keeps (in a delta update, the
sources' streams of the regions' encodings, applied into them at the commit:
``transfer_group_slice_deltas``).
"""

from __future__ import annotations

import bisect
import hashlib
import threading
import zlib
from collections.abc import Sequence

import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports import table as transports
from weightwire.core.transports.transfer_group_plan import check_ranges, clip
from weightwire.server.rules.validation import CheckedSpec
from weightwire.server.rules.views import ReadBatch
from weightwire.server.transports.host_staging import HostStaging
from weightwire.server.transports.importer import (
    FillPlan,
    FillTarget,
    ImportContext,
    ImportedPayload,
    PayloadImporter,
)
from weightwire.server.transports.transfer_group_member import BucketReceive, JoinedGroup
from weightwire.server.transports.transfer_group_membership import GroupMembership
from weightwire.server.transports.transfer_group_slice_deltas import (
    carries_slice_deltas,
    check_slice_deltas,
    receive_delta_bucket,
)
from weightwire.server.transports.transfer_group_slices import (
    SlicePlan,
    check_kept,
    check_slices,
    receive_bucket,
)
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["GroupImporter"]

# Checked slices payloads kept for the next update (a trainer sends the same regions every step).
_CHECKED_SLICES = 256


def covered_by(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``[start, end)`` lies inside the ``(offset, size)`` ranges (ascending, not
    overlapping: ``check_ranges``); adjacent ranges count as one."""
    if start == end:
        return True
    i = bisect.bisect_right(ranges, (start, float("inf"))) - 1
    if i < 0:
        return False
    offset, size = ranges[i]
    if start < offset:
        return False
    reach = offset + size
    while reach < end and i + 1 < len(ranges) and ranges[i + 1][0] == reach:
        i += 1
        reach += ranges[i][1]
    return end <= reach


def check_owned_in_ranges(owned: Sequence[CheckedSpec], ranges: list[tuple[int, int]]) -> None:
    """TENSOR_OUT_OF_BOUNDS for the first owned tensor whose bytes lie outside the bucket's ranges:
    they would never arrive, so the bucket is refused before anything waits for them."""
    for spec in owned:
        if not covered_by(ranges, spec.offset_bytes, spec.end_bytes):
            raise WeightwireError(
                Reason.TENSOR_OUT_OF_BOUNDS,
                f"tensor {spec.name!r} (bytes [{spec.offset_bytes}, {spec.end_bytes})) is owned by this worker but lies "
                "outside the byte ranges the bucket sends it over the transfer group; send every owned tensor's bytes",
                tensor=spec.name,
            )


class _Received:
    """An opened transfer-group payload: views into the staging buffer, only where bytes arrived."""

    copy_chunk_bytes: int | None = None

    def __init__(self, member: JoinedGroup, recv: BucketReceive) -> None:
        self._member = member
        self._recv: BucketReceive | None = recv
        self.size_bytes = recv.size_bytes
        self.bytes_received = recv.received_bytes
        self._ranges = recv.ranges
        self._whole = recv.ranges == [(0, recv.size_bytes)] or recv.size_bytes == 0

    def _buffer(self) -> torch.Tensor:
        recv = self._recv
        if recv is None or recv.buffer is None:
            raise WeightwireError(
                Reason.HANDLE_OPEN_FAILED, "the received transfer-group bytes were already released"
            )
        return recv.buffer

    def _covered(self, start: int, end: int) -> bool:
        return covered_by(self._ranges, start, end)

    def fetch(self, batch: ReadBatch) -> torch.Tensor:
        if not self._whole:
            for name, item, pos in zip(batch.names, batch.items, batch.positions, strict=True):
                if not self._covered(pos, pos + item.nbytes):
                    raise WeightwireError(
                        Reason.TENSOR_OUT_OF_BOUNDS,
                        f"tensor {name!r} (bytes [{pos}, {pos + item.nbytes})) is not inside the byte ranges sent over the transfer group",
                        tensor=name,
                    )
        return self._buffer()[: self.size_bytes]

    def crc32(self, size_bytes: int) -> int:
        if not self._whole:
            raise WeightwireError(
                Reason.INVALID_CHECKSUM,
                "a checksum covers the whole payload, but only some byte ranges were sent over the transfer group",
            )
        return zlib.crc32(self._buffer()[:size_bytes].cpu().numpy().data)

    def close(self) -> None:
        recv, self._recv = self._recv, None
        if recv is not None:
            self._member.release_buffer(recv)


class GroupImporter(PayloadImporter):
    """The importer of transfer-group payloads, receiving through ``membership`` (the worker's
    group; a new one unless given). ``JoinsGroups`` and ``FillsModel`` (slices handles)."""

    TRANSPORT = transports.TRANSFER_GROUP
    # Buffers and the group outlive an update; the service releases them when an update fails.
    reusable = True

    def __init__(self, membership: GroupMembership | None = None) -> None:
        self.membership = membership if membership is not None else GroupMembership()
        # Slices handles checked lately (a trainer sends the same regions every step), and the
        # message buffers of their receives, both of the group they were checked in.
        self._slices: dict[bytes, tuple[str, SlicePlan]] = {}
        self._slice_staging: tuple[str, dict[object, torch.Tensor]] = ("", {})
        self._slice_lock = threading.Lock()
        # Over gloo: an SGLang or vLLM worker's slices held until the commit (``stage``), a
        # worker's host copies of kept tensors on a GPU (``receive_bucket``).
        self._host_staging: tuple[str, HostStaging] = ("", HostStaging())

    def fills_model(self, payload: pb.Payload) -> bool:
        """A slices handle: its regions are received into the engine's kept tensors (``fill``)."""
        return payload.transfer_group.mode == pb.TRANSFER_MODE_SLICES

    def stage(self, name: str, kept: torch.Tensor) -> torch.Tensor:
        """gloo receives into host memory, so bytes bound for a kept tensor on a GPU are staged
        there (no GPU memory), in host buffers kept for the group's next update
        (``host_staging``); NCCL receives on the kept tensor's device (the caching allocator
        keeps that memory)."""
        member = self.membership.current()
        if member.group.backend != pb.TRANSFER_BACKEND_GLOO:
            return torch.empty(kept.shape, dtype=kept.dtype, device=kept.device)
        return self._host_staging_of(member.group.group_id).take(name, kept.shape, kept.dtype)

    def _host_staging_of(self, gid: str) -> HostStaging:
        """The host buffers of group ``gid`` (a new group starts with none)."""
        staging = self._host_staging
        if staging[0] != gid:
            staging = self._host_staging = (gid, HostStaging())
        return staging[1]

    def announce(self, manifest: pb.ShardManifest, *, keeps_tensors: bool) -> None:
        # Slices land in the tensors the engine keeps: only an adapter that exposes them takes them.
        manifest.receives_slices = keeps_tensors

    def check(self, payload: pb.Payload) -> None:
        if self.fills_model(payload):
            return  # checked against the manifest by ``plan_fill``, which the update calls first
        self.membership.current().check_handle(payload)

    # --- slices: every trainer rank a source --------------------------------------------------

    def plan_fill(self, payload: pb.Payload, manifest: ShardManifest) -> SlicePlan:
        """The checked plan of a slices payload (``transfer_group_slices.check_slices``)."""
        member = self.membership.current()
        gid = member.group.group_id
        regions = payload
        if carries_slice_deltas(payload):
            # A delta update's regions carry new counts and checksums every step, but what is
            # checked here is the regions alone: they are the key, so the same regions hit.
            regions = pb.Payload()
            regions.CopyFrom(payload)
            for s in regions.transfer_group.slices:
                s.ClearField("delta")
        # By digest: a handle may be megabytes, and what is kept must stay small whatever a client sends.
        key = hashlib.blake2b(regions.SerializeToString(deterministic=True), digest_size=16).digest()
        hit = self._slices.get(key)
        if hit is not None and hit[0] == gid:
            return hit[1]
        checked = check_slices(payload, member.group.spec, manifest)
        # One entry per bucket of an update (a worker's part may come as several buckets).
        if len(self._slices) >= _CHECKED_SLICES:
            self._slices.pop(next(iter(self._slices)))
        self._slices[key] = (gid, checked)
        return checked

    def fill(self, payload: pb.Payload, plan: FillPlan, into: FillTarget) -> int:
        """Receive a checked slices payload into ``into.kept``, calling ``into.will_write`` once
        every member agreed on the plan, before the first byte may land; a failed receive, or one
        whose call ended, tears the group down. Returns the bytes received."""
        if not isinstance(plan, SlicePlan):
            raise TypeError(f"a transfer group fills the model by a SlicePlan, not {type(plan).__name__}")
        member = self.membership.current()
        check_kept(into.kept, into.manifest, plan.names)
        gid = member.group.group_id
        if self._slice_staging[0] != gid:
            self._slice_staging = (gid, {})
        ended = into.call_ended
        try:
            if carries_slice_deltas(payload):
                deltas = check_slice_deltas(payload, plan, into.manifest)
                return receive_delta_bucket(
                    member,
                    plan,
                    deltas,
                    payload.transfer_group.max_message_bytes,
                    into.kept,
                    into.manifest,
                    self._slice_lock,
                    into.will_write,
                    ended.is_set if ended is not None else None,
                    into.landings,
                    into.changes,
                )
            return receive_bucket(
                member,
                plan,
                payload.transfer_group.max_message_bytes,
                into.kept,
                into.manifest,
                self._slice_staging[1],
                self._slice_lock,
                into.will_write,
                self._host_staging_of(gid),
                ended.is_set if ended is not None else None,
                into.landings,
                into.ordinal,
            )
        except WeightwireError as err:
            self.membership.teardown(f"{err.reason}: {clip(err.message, 200)}")
            raise

    def ahead(self, payload: pb.Payload) -> None:
        """The payload of a bucket the service will open next (``read_ahead``): start its receive
        now. Anything wrong with it is left for ``open`` to report, in order."""
        if self.fills_model(payload):
            return  # received by the update itself, into the model (``fill``)
        try:
            self.membership.current().enqueue(payload)
        except WeightwireError:
            pass

    def open(self, payload: pb.Payload, ctx: ImportContext) -> tuple[ImportedPayload, bool]:
        member = self.membership.current()
        if ctx.owned and payload.transfer_group.ranges:
            check_owned_in_ranges(ctx.owned, check_ranges(payload.transfer_group.ranges, payload.size_bytes))
        try:
            recv = member.claim(payload, ctx.call_ended)
        except WeightwireError as err:
            if err.kind is Reason.TRANSFER_FAILED:
                self.membership.teardown(f"{err.reason}: {clip(err.message, 200)}")
            raise
        # No handle is opened: the bytes land in this worker's own reused staging buffers.
        return _Received(member, recv), False

    def held_mappings(self) -> int:
        return 0

    def release(self) -> None:
        """An update failed: the group's streams may be out of step, so leave it."""
        self.membership.teardown("an update failed")
