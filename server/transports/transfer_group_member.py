"""One joined transfer group on a worker: the thread that receives each bucket's bytes in stream
order into at most ``MAX_STAGING_BUFFERS`` bounded staging buffers, with the group's timeout, and
hands them to the importer. No gRPC.

``GroupMembership`` (``transfer_group_membership``) makes one when a join succeeds and closes it on
a teardown; ``GroupImporter`` (``transfer_group``) claims each bucket's receive from it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports.transfer_group import TransferGroup, staging_device
from weightwire.core.transports.transfer_group_agreement import AgreedPlans
from weightwire.core.transports.transfer_group_plan import ANNOUNCEMENT_INDEX, check_ranges, clip, message_tag
from weightwire.core.transports.whole_messages import Arrivals
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["DEFAULT_MAX_STAGING_BYTES", "MAX_STAGING_BUFFERS", "BucketReceive", "JoinedGroup"]

log = logging.getLogger(__name__)

# Receive of bucket k+1 overlaps the load of bucket k; never more.
MAX_STAGING_BUFFERS = 2
# The largest bucket a worker stages unless configured otherwise (a trainer's default is 64 MiB).
DEFAULT_MAX_STAGING_BYTES = 1 << 30
# How long past the group's timeout the service thread waits for the receive thread's verdict.
_VERDICT_GRACE_S = 5.0
# How often a wait for a bucket's bytes looks whether the update's call ended.
_CALL_POLL_S = 0.05


@dataclasses.dataclass
class BucketReceive:
    """One bucket's bytes on their way in, in stream order."""

    sequence: int
    handle: pb.TransferGroupHandle
    size_bytes: int
    ranges: list[tuple[int, int]]
    buffer: torch.Tensor | None = None
    error: WeightwireError | None = None
    done: bool = False
    opened: bool = False

    @property
    def received_bytes(self) -> int:
        return sum(n for _, n in self.ranges)


class StagingBuffers:
    """At most MAX_STAGING_BUFFERS reusable byte buffers on one device (a too-small free one is
    replaced by a bigger one, so memory stays bounded by the count times the largest bucket)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.Tensor] = []
        self._count = 0
        self._bytes = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of at least ``nbytes``, or None when every buffer is in use (the caller waits)."""
        # (indices, not list.remove: tensors compare element-wise)
        fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        if self._count >= MAX_STAGING_BUFFERS and self._free:
            dropped = self._free.pop()
            self._count -= 1
            self._bytes -= dropped.numel()
        if self._count >= MAX_STAGING_BUFFERS:
            return None
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        self._count += 1
        self._bytes += buf.numel()
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        self._free.append(buf)

    def forget(self, buf: torch.Tensor) -> None:
        """A buffer that is not coming back (its group was torn down while it was in use)."""
        self._count -= 1
        self._bytes -= buf.numel()

    def clear(self) -> None:
        for buf in self._free:
            self._bytes -= buf.numel()
        self._count -= len(self._free)
        self._free.clear()

    def held(self) -> tuple[int, int]:
        """The buffers held (free or in use) and their bytes, what the group's status reports."""
        return self._count, self._bytes


class JoinedGroup:
    """This worker's side of one formed group: its receive queue and its receive thread."""

    def __init__(self, group: TransferGroup, device: torch.device, max_bytes: int) -> None:
        self.group = group
        self.max_bytes = max_bytes
        self.staging = StagingBuffers(staging_device(group.backend, device))
        self.cond = threading.Condition()
        self.queue: collections.deque[BucketReceive] = collections.deque()
        self.last_sequence = 0
        self.bytes_received = 0
        self.closed = False
        self.broken: WeightwireError | None = None
        # The plan fingerprints every member compared over this group (``transfer_group_agreement``).
        self.agreed_plans = AgreedPlans()
        self.thread = threading.Thread(target=self._run, name=f"ww-group-{group.group_id[:16]}", daemon=True)
        self.thread.start()

    # --- the service side ----------------------------------------------------------------------

    def check_handle(self, payload: pb.Payload) -> BucketReceive:
        """Every rule of a transfer-group payload that needs no bytes; raises WeightwireError."""
        h = payload.transfer_group
        spec = self.group.spec
        if h.group_id != spec.group_id:
            raise WeightwireError(
                Reason.GROUP_NOT_JOINED,
                f"the bucket names transfer group {clip(h.group_id, 80)!r}, but this worker is in group {spec.group_id}; form the group again",
                group_id=clip(h.group_id, 80),
            )
        if (
            not 0 <= h.source_rank < spec.world_size
            or spec.members[h.source_rank].role != pb.TRANSFER_ROLE_TRAINER
        ):
            raise WeightwireError(
                Reason.INVALID_GROUP_SPEC,
                f"source rank {h.source_rank} is not a trainer member of group {spec.group_id}",
            )
        if h.mode == pb.TRANSFER_MODE_BROADCAST:
            sg = self.group.subgroup_spec(h.subgroup_id)
            if sg is None or self.group.rank not in sg.member_ranks or sg.root_rank != h.source_rank:
                raise WeightwireError(
                    Reason.GROUP_NOT_JOINED,
                    f"broadcast subgroup {h.subgroup_id} rooted at rank {h.source_rank} does not include this worker "
                    f"(group rank {self.group.rank}) in group {spec.group_id}",
                )
        elif h.mode != pb.TRANSFER_MODE_POINT_TO_POINT:
            raise WeightwireError(
                Reason.INVALID_GROUP_SPEC, f"transfer mode {h.mode} is unspecified or unknown"
            )
        if h.sequence <= 0:
            raise WeightwireError(
                Reason.INVALID_GROUP_SPEC, f"transfer sequence {h.sequence} must be positive"
            )
        if payload.size_bytes > self.max_bytes:
            raise WeightwireError(
                Reason.INVALID_SIZE,
                f"a transfer-group payload of {payload.size_bytes} bytes exceeds what this worker stages "
                f"({self.max_bytes} bytes per buffer)",
            )
        ranges = check_ranges(h.ranges, payload.size_bytes)
        return BucketReceive(h.sequence, h, payload.size_bytes, ranges)

    def enqueue(self, payload: pb.Payload) -> BucketReceive:
        recv = self.check_handle(payload)
        with self.cond:
            if self.closed:
                raise self.gone()
            if self.broken is not None:
                raise self.broken
            if recv.sequence <= self.last_sequence:
                raise WeightwireError(
                    Reason.INVALID_GROUP_SPEC,
                    f"transfer sequence {recv.sequence} is not after {self.last_sequence}; sequences must increase",
                )
            self.last_sequence = recv.sequence
            self.queue.append(recv)
            self.cond.notify_all()
        return recv

    def claim(self, payload: pb.Payload, call_ended: threading.Event | None = None) -> BucketReceive:
        """The receive of ``payload``'s bucket (queued ahead, or queued now), once its bytes are in.

        Receives queued ahead for buckets this worker then did not open (nothing owned in them) are
        finished and dropped first, in order. Once ``call_ended`` is set (the update's call was
        cancelled or passed its deadline) this stops waiting and raises CANCELLED: the update then
        fails at once and tears the group down, instead of holding the worker until the group's
        timeout.
        """
        seq = payload.transfer_group.sequence
        with self.cond:
            queued = next((r for r in self.queue if r.sequence == seq and not r.opened), None)
        recv = queued if queued is not None else self.enqueue(payload)
        if (recv.handle.SerializeToString(deterministic=True), recv.size_bytes) != (
            payload.transfer_group.SerializeToString(deterministic=True),
            payload.size_bytes,
        ):
            raise WeightwireError(
                Reason.MALFORMED_STREAM, f"transfer sequence {seq} arrived twice with different contents"
            )
        deadline = time.monotonic() + self.group.timeout.total_seconds() + _VERDICT_GRACE_S
        with self.cond:
            while True:
                while self.queue and self.queue[0] is not recv and self.queue[0].done:
                    self._finish(self.queue.popleft())
                if recv.done or self.closed:
                    break
                if call_ended is not None and call_ended.is_set():
                    raise WeightwireError(
                        Reason.CANCELLED,
                        f"the update's call ended (cancelled, or past its deadline) while bucket sequence {seq} was "
                        "still on its way over the transfer group; nothing was committed",
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    recv.error = WeightwireError(
                        Reason.TRANSFER_FAILED,
                        f"bucket sequence {seq}: no verdict from the receive within the group's timeout",
                    )
                    break
                # Woken by the receive thread; with a call to watch, also often enough to notice its end.
                self.cond.wait(min(left, _CALL_POLL_S if call_ended is not None else 1.0))
            if recv.error is None and not recv.done:
                recv.error = self.gone()
            if recv.error is not None:
                raise recv.error
            recv.opened = True
            if self.queue and self.queue[0] is recv:
                self.queue.popleft()
            self.bytes_received += recv.received_bytes
        return recv

    def release_buffer(self, recv: BucketReceive) -> None:
        with self.cond:
            self._finish(recv)

    def _finish(self, recv: BucketReceive) -> None:
        # (holding cond) hand the buffer back, or let it go when the group is gone
        buf, recv.buffer = recv.buffer, None
        if buf is not None:
            if self.closed:
                self.staging.forget(buf)
            else:
                self.staging.give_back(buf)
        self.cond.notify_all()

    def gone(self) -> WeightwireError:
        return WeightwireError(
            Reason.GROUP_NOT_JOINED,
            f"transfer group {self.group.group_id} was torn down on this worker; the trainer must form a new one",
            group_id=self.group.group_id,
        )

    def close(self, wait_s: float = 0.0) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            for recv in self.queue:
                if not recv.done and recv.error is None:
                    recv.error = self.gone()
            self.staging.clear()
            self.cond.notify_all()
        self.group.close(wait_s)

    # --- the receive thread --------------------------------------------------------------------

    def _next(self) -> BucketReceive | None:
        with self.cond:
            while True:
                if self.closed:
                    return None
                recv = next((r for r in self.queue if r.buffer is None and not r.done), None)
                if recv is not None:
                    buf = self.staging.take(recv.size_bytes)
                    if buf is not None:
                        recv.buffer = buf
                        return recv
                self.cond.wait(1.0)

    def _run(self) -> None:
        while True:
            try:
                recv = self._next()
            except Exception as e:  # a bug here must not leave the service thread waiting
                self._break(WeightwireError(Reason.TRANSFER_FAILED, f"the receive thread failed: {e!r}"))
                return
            if recv is None:
                return
            err = None
            try:
                self._receive(recv)
            except WeightwireError as e:
                err = e
            except Exception as e:  # a bug must not leave the service thread waiting
                err = WeightwireError(
                    Reason.TRANSFER_FAILED, f"receiving bucket sequence {recv.sequence}: {e!r}"
                )
            with self.cond:
                recv.done = True
                recv.error = recv.error or err
                self.cond.notify_all()
            if err is not None:
                self._break(err)
                return

    def _break(self, err: WeightwireError) -> None:
        """The group is broken: every receive still queued fails the same way, and so does every
        later one, until the service tears the group down."""
        log.warning("transfer group %s: %s", self.group.group_id, err.message)
        with self.cond:
            self.broken = err
            for later in self.queue:
                if not later.done:
                    later.error, later.done = later.error or err, True
            self.cond.notify_all()

    def _receive(self, recv: BucketReceive) -> None:
        group, h = self.group, recv.handle
        assert recv.buffer is not None
        what = (
            f"receiving bucket sequence {recv.sequence} from group rank {h.source_rank}"
            if h.mode == pb.TRANSFER_MODE_POINT_TO_POINT
            else f"receiving broadcast of bucket sequence {recv.sequence} in subgroup {h.subgroup_id}"
        )
        if not recv.ranges:
            return
        p2p = h.mode == pb.TRANSFER_MODE_POINT_TO_POINT

        def post(t: torch.Tensor, index: int) -> object:
            if p2p:
                return group.recv(t, h.source_rank, message_tag(recv.sequence, index))
            return group.broadcast(t, h.subgroup_id)

        # The sender announces each message's size and last byte first: a message that lands short
        # is then refused instead of counted (``whole_messages``).
        arrivals = Arrivals([size for _, size in recv.ranges], recv.buffer.device, what)
        group.wait(post(arrivals.buffer, ANNOUNCEMENT_INDEX), f"{what} (its announcement)")
        arrivals.open()
        views = [recv.buffer[offset : offset + size] for offset, size in recv.ranges]
        works = []
        for i, view in enumerate(views):
            arrivals.prime(i, view)
            works.append(post(view, i))
        for work in works:
            group.wait(work, what)
        for i, view in enumerate(views):
            arrivals.check(i, view)
