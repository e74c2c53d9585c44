"""The worker's side of transfer groups: joining and leaving one, receiving a bucket's bytes over it
into a bounded staging buffer, and its status. No gRPC in here.

The transport table (``weightwire.core.transports.table.TRANSFER_GROUP``) names ``GroupImporter``. The
worker service hands it JoinTransferGroup / LeaveTransferGroup (``join``, ``leave``) and, per bucket
whose payload is a ``TransferGroupHandle``, ``open``: the bytes arrive from the source rank (a
point-to-point receive, or this worker's part of a broadcast in its subgroup) into one of at most
``MAX_STAGING_BUFFERS`` buffers on the worker's device, and the mapping hands the service views of
the tensors inside the byte ranges received. ``weightwire.server.transports.read_ahead`` calls ``ahead`` with
the next bucket's payload while this one loads, so its receive overlaps the load.

Receives run on one thread per group, strictly in stream order, each with the group's timeout. Any
failed receive, any failed update (``release``), a new join and a leave tear the group down: its
process groups are destroyed (so the sender's pending operations on it fail at once), its staging
buffers are freed, and the next update over it is refused with GROUP_NOT_JOINED until the trainer
forms a new one.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import socket
import threading
import time
import zlib
from collections.abc import Sequence

import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports import table as transports
from weightwire.core.transports.transfer_group import (
    TransferGroup,
    backend_name,
    check_backend,
    shut_down_sockets,
    staging_device,
    store_sockets,
)
from weightwire.core.transports.transfer_group_plan import (
    MemberIdentity,
    check_ranges,
    check_spec,
    clip,
    message_tag,
    own_rank,
)
from weightwire.server.rules.validation import CheckedSpec
from weightwire.server.rules.views import ReadBatch
from weightwire.server.transports.importer import ImportContext, ImportedPayload, PayloadImporter
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["DEFAULT_MAX_STAGING_BYTES", "MAX_STAGING_BUFFERS", "GroupImporter", "default_group_host"]

log = logging.getLogger(__name__)

# Receive of bucket k+1 overlaps the load of bucket k; never more.
MAX_STAGING_BUFFERS = 2
# The largest bucket a worker stages unless configured otherwise (a trainer's default is 64 MiB).
DEFAULT_MAX_STAGING_BYTES = 1 << 30
# How long past the group's timeout the service thread waits for the receive thread's verdict.
_VERDICT_GRACE_S = 5.0
# How often a wait for a bucket's bytes looks whether the update's call ended.
_CALL_POLL_S = 0.05
# How long past the group's timeout a join waits for its formation before giving up on it.
_FORM_GRACE_S = 5.0


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


@dataclasses.dataclass
class _Receive:
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


class _Staging:
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

    @property
    def buffers(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._bytes


class _Member:
    """This worker's side of one formed group: its receive queue and its receive thread."""

    def __init__(self, group: TransferGroup, device: torch.device, max_bytes: int) -> None:
        self.group = group
        self.max_bytes = max_bytes
        self.staging = _Staging(staging_device(group.backend, device))
        self.cond = threading.Condition()
        self.queue: collections.deque[_Receive] = collections.deque()
        self.last_sequence = 0
        self.bytes_received = 0
        self.closed = False
        self.broken: WeightwireError | None = None
        self.thread = threading.Thread(target=self._run, name=f"ww-group-{group.group_id[:16]}", daemon=True)
        self.thread.start()

    # --- the service side ----------------------------------------------------------------------

    def check_handle(self, payload: pb.Payload) -> _Receive:
        """Every rule of a transfer-group payload that needs no bytes; raises WeightwireError."""
        h = payload.transfer_group
        spec = self.group.spec
        if h.group_id != spec.group_id:
            raise WeightwireError(
                Reason.GROUP_NOT_JOINED,
                f"the bucket names transfer group {clip(h.group_id, 80)!r}, but this worker is in group {spec.group_id}; form the group again",
                group_id=clip(h.group_id, 80),
            )
        if not 0 <= h.source_rank < spec.world_size or spec.members[h.source_rank].role != pb.TRANSFER_ROLE_TRAINER:
            raise WeightwireError(
                Reason.INVALID_GROUP_SPEC, f"source rank {h.source_rank} is not a trainer member of group {spec.group_id}"
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
            raise WeightwireError(Reason.INVALID_GROUP_SPEC, f"transfer mode {h.mode} is unspecified or unknown")
        if h.sequence <= 0:
            raise WeightwireError(Reason.INVALID_GROUP_SPEC, f"transfer sequence {h.sequence} must be positive")
        if payload.size_bytes > self.max_bytes:
            raise WeightwireError(
                Reason.INVALID_SIZE,
                f"a transfer-group payload of {payload.size_bytes} bytes exceeds what this worker stages "
                f"({self.max_bytes} bytes per buffer)",
            )
        ranges = check_ranges(h.ranges, payload.size_bytes)
        return _Receive(h.sequence, h, payload.size_bytes, ranges)

    def enqueue(self, payload: pb.Payload) -> _Receive:
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

    def claim(self, payload: pb.Payload, call_ended: threading.Event | None = None) -> _Receive:
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
            payload.transfer_group.SerializeToString(deterministic=True), payload.size_bytes
        ):
            raise WeightwireError(Reason.MALFORMED_STREAM, f"transfer sequence {seq} arrived twice with different contents")
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
                        Reason.TRANSFER_FAILED, f"bucket sequence {seq}: no verdict from the receive within the group's timeout"
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

    def release_buffer(self, recv: _Receive) -> None:
        with self.cond:
            self._finish(recv)

    def _finish(self, recv: _Receive) -> None:
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

    def _next(self) -> _Receive | None:
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
                err = WeightwireError(Reason.TRANSFER_FAILED, f"receiving bucket sequence {recv.sequence}: {e!r}")
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

    def _receive(self, recv: _Receive) -> None:
        group, h = self.group, recv.handle
        assert recv.buffer is not None
        what = (
            f"receiving bucket sequence {recv.sequence} from group rank {h.source_rank}"
            if h.mode == pb.TRANSFER_MODE_POINT_TO_POINT
            else f"receiving broadcast of bucket sequence {recv.sequence} in subgroup {h.subgroup_id}"
        )
        works = []
        for i, (offset, size) in enumerate(recv.ranges):
            view = recv.buffer[offset : offset + size]
            if h.mode == pb.TRANSFER_MODE_POINT_TO_POINT:
                works.append(group.recv(view, h.source_rank, message_tag(recv.sequence, i)))
            else:
                works.append(group.broadcast(view, h.subgroup_id))
        for work in works:
            group.wait(work, what)


class _Received:
    """An opened transfer-group payload: views into the staging buffer, only where bytes arrived."""

    copy_chunk_bytes: int | None = None

    def __init__(self, member: _Member, recv: _Receive) -> None:
        self._member = member
        self._recv: _Receive | None = recv
        self.size_bytes = recv.size_bytes
        self.bytes_received = recv.received_bytes
        self._ranges = recv.ranges
        self._whole = recv.ranges == [(0, recv.size_bytes)] or recv.size_bytes == 0

    def _buffer(self) -> torch.Tensor:
        recv = self._recv
        if recv is None or recv.buffer is None:
            raise WeightwireError(Reason.HANDLE_OPEN_FAILED, "the received transfer-group bytes were already released")
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


class _Formation:
    """One ``TransferGroup.form`` running on its own thread, for a join that waits for it with a bound."""

    def __init__(self, spec: pb.TransferGroupSpec, me: MemberIdentity, listen_host: str, device: torch.device) -> None:
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._group: TransferGroup | None = None
        self._error: BaseException | None = None
        args = (spec, me, listen_host, device)
        threading.Thread(target=self._run, args=args, name=f"ww-group-form-{spec.group_id[:16]}", daemon=True).start()

    def _run(self, spec: pb.TransferGroupSpec, me: MemberIdentity, listen_host: str, device: torch.device) -> None:
        try:
            group = TransferGroup.form(spec, me, listen_host=listen_host, device=device)
        except BaseException as e:  # handed to the join
            with self._lock:
                self._error = e
            self.done.set()
            return
        with self._lock:
            abandoned = self._abandoned
            self._group = group
        if abandoned:
            group.close()  # its join already gave up: nobody will use it
        self.done.set()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            group = self._group
        if group is not None:
            group.close()

    def result(self) -> TransferGroup:
        with self._lock:
            group, error = self._group, self._error
        if error is not None:
            raise error
        assert group is not None
        return group


class GroupImporter(PayloadImporter):
    """This worker's transfer group (at most one at a time) and the importer of its payloads."""

    TRANSPORT = transports.TRANSFER_GROUP
    # Buffers and the group outlive an update; the service releases them when an update fails.
    reusable = True

    def __init__(self) -> None:
        self.listen_host = "127.0.0.1"
        self.max_staging_bytes = DEFAULT_MAX_STAGING_BYTES
        self._join_lock = threading.Lock()
        self._lock = threading.Lock()
        self._member: _Member | None = None
        self._forming: pb.TransferGroupSpec | None = None
        self._last_teardown = ""
        self._closing: list[TransferGroup] = []

    def configure(self, *, listen_host: str | None = None, max_staging_bytes: int | None = None) -> None:
        """Where this worker's group sockets listen (an address of this machine the trainer can
        reach), and the largest bucket it stages."""
        if listen_host:
            try:
                socket.getaddrinfo(listen_host, None)
            except OSError as e:
                raise ValueError(f"transfer-group host {listen_host!r} does not resolve here: {e}") from None
            self.listen_host = listen_host
        if max_staging_bytes is not None:
            if max_staging_bytes <= 0:
                raise ValueError("max_staging_bytes must be positive")
            self.max_staging_bytes = int(max_staging_bytes)

    # --- joining and leaving -------------------------------------------------------------------

    def join(self, spec: pb.TransferGroupSpec, me: MemberIdentity, device: torch.device) -> pb.JoinTransferGroupResponse:
        """Form ``spec`` as ``me`` (leaving the current group first); returns once formed and checked."""
        check_spec(spec)
        own_rank(spec, me)
        check_backend(spec.backend, device)
        if spec.max_bucket_bytes > self.max_staging_bytes:
            raise WeightwireError(
                Reason.INVALID_SIZE,
                f"the trainer will send buckets of up to {spec.max_bucket_bytes} bytes; this worker stages at most "
                f"{self.max_staging_bytes} per buffer (use a smaller bucket size, or raise the worker's limit)",
            )
        with self._join_lock:
            self._teardown(f"replaced by group {spec.group_id}")
            with self._lock:
                self._forming = spec
            try:
                group = self._form_within_timeout(spec, me, device)
            except WeightwireError as err:
                with self._lock:
                    self._forming = None
                    self._last_teardown = f"forming {spec.group_id} failed: {err.reason}: {clip(err.message, 200)}"
                raise
            member = _Member(group, device, min(spec.max_bucket_bytes, self.max_staging_bytes))
            with self._lock:
                self._forming = None
                self._member = member
        log.info(
            "joined transfer group %s (%s) as rank %d of %d", spec.group_id, backend_name(spec.backend), group.rank, spec.world_size
        )
        return pb.JoinTransferGroupResponse(group_rank=group.rank, group=self.status())

    def _form_within_timeout(self, spec: pb.TransferGroupSpec, me: MemberIdentity, device: torch.device) -> TransferGroup:
        """``TransferGroup.form`` on a thread of its own, given the group's timeout (and a grace).

        Every step of forming has a deadline of its own, but a step that does not return (a store
        that stops answering in the middle of the rendezvous) must not hold this join, nor the next
        one (joins run one after another): past the bound the join is refused with GROUP_TIMEOUT,
        the formation's connections to the store are shut down (which ends its wait), and a group it
        still forms afterwards is closed at once.
        """
        before = store_sockets(spec.store_address)
        formation = _Formation(spec, me, self.listen_host, device)
        if formation.done.wait(spec.timeout_ms / 1000 + _FORM_GRACE_S):
            return formation.result()
        shut_down_sockets(store_sockets(spec.store_address) - before)
        formation.abandon()
        raise WeightwireError(
            Reason.GROUP_TIMEOUT,
            f"group {spec.group_id}: forming did not end within its timeout of {spec.timeout_ms / 1000:g} s "
            f"(a step did not return; the store at {clip(spec.store_address, 80)} may have stopped answering); "
            "this worker gave up on it and can join again",
            group_id=spec.group_id,
        )

    def leave(self, group_id: str) -> bool:
        with self._lock:
            member = self._member
        if member is None or member.group.group_id != group_id:
            return False
        self._teardown("left on request")
        return True

    def _teardown(self, why: str, wait_s: float = 0.0) -> None:
        with self._lock:
            member, self._member = self._member, None
            if member is not None:
                self._last_teardown = f"{member.group.group_id}: {why}"
                # Groups whose destructors may still run (see ``shutdown``); finished ones are dropped.
                self._closing = [g for g in self._closing if not g.destroyed] + [member.group]
        if member is not None:
            member.close(wait_s)
            log.info("left transfer group %s: %s", member.group.group_id, why)

    # --- PayloadImporter -----------------------------------------------------------------------

    def _current(self) -> _Member:
        with self._lock:
            member, forming = self._member, self._forming
        if member is None:
            state = f"group {forming.group_id} is still forming" if forming is not None else "this worker is in no transfer group"
            raise WeightwireError(
                Reason.GROUP_NOT_JOINED,
                f"a bucket arrived over a transfer group, but {state}"
                f"{f' (the last one ended: {self._last_teardown})' if self._last_teardown else ''}; form the group first",
            )
        return member

    def check(self, payload: pb.Payload) -> None:
        self._current().check_handle(payload)

    def ahead(self, payload: pb.Payload) -> None:
        """The payload of a bucket the service will open next (``read_ahead``): start its receive
        now. Anything wrong with it is left for ``open`` to report, in order."""
        try:
            self._current().enqueue(payload)
        except WeightwireError:
            pass

    def open(self, payload: pb.Payload, ctx: ImportContext) -> tuple[ImportedPayload, bool]:
        member = self._current()
        if ctx.owned and payload.transfer_group.ranges:
            check_owned_in_ranges(ctx.owned, check_ranges(payload.transfer_group.ranges, payload.size_bytes))
        try:
            recv = member.claim(payload, ctx.call_ended)
        except WeightwireError as err:
            if err.kind is Reason.TRANSFER_FAILED:
                self._teardown(f"{err.reason}: {clip(err.message, 200)}")
            raise
        # No handle is opened: the bytes land in this worker's own reused staging buffers.
        return _Received(member, recv), False

    def held_mappings(self) -> int:
        return 0

    def release(self) -> None:
        """An update failed: the group's streams may be out of step, so leave it."""
        self._teardown("an update failed")

    def shutdown(self, wait_s: float = 10.0) -> None:
        """The worker stops: leave the group, and give every process group torn down so far up to
        ``wait_s`` to be destroyed (a process that exits during a destructor aborts)."""
        self._teardown("the worker stopped")
        deadline = time.monotonic() + wait_s
        with self._lock:
            closing, self._closing = self._closing, []
        for group in closing:
            group.close(max(0.0, deadline - time.monotonic()))

    # --- status --------------------------------------------------------------------------------

    def status(self) -> pb.TransferGroupStatus:
        with self._lock:
            member, forming, last = self._member, self._forming, self._last_teardown
        out = pb.TransferGroupStatus(
            state=pb.TRANSFER_GROUP_STATE_NONE, max_staging_buffers=MAX_STAGING_BUFFERS, last_teardown=last
        )
        if member is not None:
            spec = member.group.spec
            with member.cond:
                buffers, nbytes, received = member.staging.buffers, member.staging.nbytes, member.bytes_received
            out.group_id = spec.group_id
            out.state = pb.TRANSFER_GROUP_STATE_READY
            out.backend = spec.backend
            out.group_rank = member.group.rank
            out.world_size = spec.world_size
            out.staging_buffers = buffers
            out.staging_bytes = nbytes
            out.bytes_received = received
        elif forming is not None:
            out.group_id = forming.group_id
            out.state = pb.TRANSFER_GROUP_STATE_FORMING
            out.backend = forming.backend
            out.world_size = forming.world_size
        return out


def default_group_host(listen: str | None) -> str:
    """Where a worker's transfer-group sockets listen unless told: the host of its TCP listener,
    or loopback for a unix socket or a wildcard address (a trainer on another machine then needs
    ``group_host``, ``weightwire serve --group-host``)."""
    if not listen or listen.startswith("unix:"):
        return "127.0.0.1"
    host = listen.rpartition(":")[0].strip("[]")
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
