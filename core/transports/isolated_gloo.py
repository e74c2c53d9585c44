"""A worker's gloo process groups in a process of their own, so that no member of a group can end
the worker.

gloo ends the whole process (``std::terminate`` in its socket thread, nothing Python can catch) when
a peer sends a message longer than the receive posted for it, and any member of a transfer group can
send one. So a worker does not hold its gloo groups itself: a receiving process
(``isolated_gloo_child``) holds them, and the worker posts operations to it over a control channel
(``isolated_gloo_channel``). The bytes land in shared-memory segments both processes map
(``memfd``: nothing named in /dev/shm, nothing left behind); a receive into a tensor of the
worker's own (a kept tensor, a staging buffer) lands in a segment and is copied into it when the
receive ends. When the receiving process dies, every operation still open fails with a reason:
``MESSAGE_TOO_LONG`` naming the sizes gloo reported, else ``TRANSFER_FAILED`` with its exit; the
worker refuses the update, leaves the group, and the next join starts a new receiving process.

``IsolatedProcessGroup`` has the part of ``ProcessGroupGloo``'s interface the transfer groups use
(``send``, ``recv``, ``broadcast``, ``allgather``, ``barrier``, each returning a work with ``wait``
and ``is_completed``), so the data planes post to it as they post to gloo. Memory: the segments
hold what is posted at once (one update's receives on the every-rank-a-source plane, a bucket on
the single-source one), kept for the next update; the receiving process costs an interpreter with
torch (~270 MB resident, most of it torch's shared libraries); one is started in advance
(``isolated_gloo_spare``), at the idle scheduling priority until it is taken for a group or
``_IDLE_START_S`` after its start (``idle_priority``). NCCL members stay in the worker's process (a
GPU communicator cannot be moved).
"""

from __future__ import annotations

import collections
import datetime
import logging
import mmap
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports.idle_priority import foreground
from weightwire.core.transports.isolated_gloo_channel import Channel, ChannelClosed

__all__ = ["IsolatedProcessGroup", "ReceivingProcess", "isolation_enabled"]

log = logging.getLogger(__name__)

# How long a new receiving process stays at the idle priority at most (``foreground``): long enough
# for the updates that follow a group's formation, short enough that one on a host whose cores are
# never idle still starts well before it is needed.
_IDLE_START_S = 5.0
# Posts are sent in batches of at most this many (each flushed at the latest when waited on).
_BATCH = 256
# Below this a posted receive's whole landing zone is copied into its segment first, so that a
# message that arrives short leaves the bytes the caller primed (the plan comparison's buffers);
# above it only the last byte is (what ``whole_messages`` primes and checks).
_COPY_IN_WHOLE_BYTES = 64 << 10
_SEGMENT_BYTES = 64 << 20
_STDERR_LINES = 20
_GLOO_TOO_LONG = re.compile(r"(\d+) vs (\d+)\. Received data size doesn't match")


def isolation_enabled() -> bool:
    """Whether a worker's gloo groups run in a receiving process (``WEIGHTWIRE_ISOLATED_GLOO=0``
    keeps them in the worker, as before: a hostile member can then end the worker)."""
    return os.environ.get("WEIGHTWIRE_ISOLATED_GLOO", "1") != "0"


class _Segment:
    def __init__(self, index: int, size: int) -> None:
        self.index = index
        self.size = size
        self.fd = os.memfd_create(f"weightwire-recv-{index}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.used = 0


class _Work:
    """One posted operation: ``wait`` (the group's wait: raises on failure) and ``is_completed``.
    A receive lands in the caller's tensor when its wait succeeds, or, posted with ``recv_staged``,
    only at ``land`` (``staged`` is where its bytes are until then)."""

    def __init__(
        self,
        owner: ReceivingProcess,
        op_id: int,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        auto_land: bool,
    ) -> None:
        self._owner = owner
        self.op_id = op_id
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._copies = copies  # (the caller's tensor, its segment view), copied in after a receive
        self._auto_land = auto_land
        self._waited = False
        self._landed = False

    @property
    def staged(self) -> torch.Tensor:
        """A received tensor's bytes in the segment, shaped as the tensor (before ``land``)."""
        to, segment = self._copies[0]
        return segment.view(to.dtype).view(to.shape)

    @property
    def completed(self) -> threading.Event:
        """Set when the receiving process reported the operation's end (a watched wait, ``until``,
        wakes on it rather than at its next look)."""
        return self.done

    def is_completed(self) -> bool:
        self._owner.flush()
        return self.done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._owner.flush()
        limit = timeout.total_seconds() if timeout is not None else None
        # A little past the receiving process's own deadline, so that its verdict is the one seen.
        if not self.done.wait(None if limit is None else limit + 1.0):
            raise RuntimeError(
                f"operation timed out after {limit:g} s (the receiving process did not report)"
            )
        if not self._waited:
            self._waited = True
            if self.error is not None:
                self._owner.finished()
            elif self._auto_land:
                self.land()
        if self.error is not None:
            raise self.error
        return True

    def land(self) -> None:
        """Copy what was received into the caller's tensors (once; after a successful ``wait``)."""
        if self._landed or self.error is not None or not self.done.is_set():
            return
        self._landed = True
        for to, segment in self._copies:
            to.copy_(segment.view(to.dtype).view(to.shape))
        self._owner.finished()


class ReceivingProcess:
    """One receiving process and its channel; the process groups of one transfer group."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "weightwire.core.transports.isolated_gloo_child", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            close_fds=True,
        )
        theirs.close()
        self.pid = self._proc.pid
        self._channel = Channel(ours)
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._ready = threading.Event()
        self._formed: dict[int, threading.Event] = {}
        self._form_errors: dict[int, str] = {}
        self._works: dict[int, _Work] = {}
        self._batch: list[dict[str, Any]] = []
        self._next_op = 0
        self._next_group = 0
        self._segments: list[_Segment] = []
        self._open = 0  # operations posted and not yet finished, holding segment space
        self._stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self.ended: WeightwireError | None = None
        self.group_id = ""
        threading.Thread(target=self._read_replies, name="ww-isolated-replies", daemon=True).start()
        threading.Thread(target=self._read_stderr, name="ww-isolated-stderr", daemon=True).start()
        raise_later = threading.Timer(_IDLE_START_S, self._foreground)
        raise_later.daemon = True
        raise_later.start()

    # --- lifetime ------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s):
            self.kill()
            raise WeightwireError(
                Reason.GROUP_TIMEOUT,
                f"the worker's gloo receiving process did not start within {timeout_s:g} s",
            )
        if self.ended is not None:
            raise self.ended

    def kill(self) -> None:
        """End the receiving process: its sockets close, so peers' operations on its groups fail at
        once, and every operation still open here fails."""
        try:
            self._proc.kill()
        except OSError:
            pass
        self._channel.close()

    def _foreground(self) -> None:
        if self.alive:
            foreground(self.pid)

    @property
    def alive(self) -> bool:
        return self.ended is None and self._proc.poll() is None

    # --- process groups ------------------------------------------------------------------------

    def process_group(
        self,
        store_address: str,
        prefixes: Sequence[str],
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        listen_host: str,
    ) -> IsolatedProcessGroup:
        """A gloo process group of ``size`` in the receiving process, formed on the store at
        ``store_address`` under ``prefixes`` (what ``PrefixStore``s over it would make)."""
        with self._lock:
            handle = self._next_group
            self._next_group += 1
            formed = self._formed[handle] = threading.Event()
        timeout_s = timeout.total_seconds()
        self._send(
            {
                "do": "form",
                "group": handle,
                "store_address": store_address,
                "prefixes": list(prefixes),
                "rank": rank,
                "size": size,
                "timeout_s": timeout_s,
                "listen_host": listen_host,
            }
        )
        if not formed.wait(timeout_s + 5.0):
            raise RuntimeError(f"connecting the process group did not end within {timeout_s:g} s")
        if self.ended is not None:
            raise self.ended
        error = self._form_errors.pop(handle, None)
        if error is not None:
            raise RuntimeError(error)
        return IsolatedProcessGroup(self, handle, timeout_s)

    def post(
        self,
        group: int,
        op: str,
        tensors: Sequence[torch.Tensor],
        timeout_s: float,
        auto_land: bool = True,
        primed_last: int | None = None,
        **args: int,
    ) -> _Work:
        """Post ``op`` on ``group``: ``tensors[0]`` is what is sent or received (an all-gather's
        input, then its outputs). ``primed_last``: a receive's segment ends with this byte instead
        of what its tensor holds (``whole_messages``), and nothing of the tensor is read."""
        bufs, copies = [], []
        with self._lock:
            if self.ended is not None:
                raise self.ended
            for i, t in enumerate(tensors):
                if not t.is_contiguous():
                    raise ValueError("a transfer-group operation takes contiguous tensors")
                nbytes = t.numel() * t.element_size()
                segment, offset = self._take(nbytes)
                view = segment.tensor[offset : offset + nbytes]
                flat = t.reshape(-1).view(torch.uint8) if nbytes else view
                received = op in ("recv", "broadcast") or (op == "allgather" and i > 0)
                if received and primed_last is not None:
                    if nbytes:
                        view[-1:].fill_(primed_last)
                elif not received or nbytes <= _COPY_IN_WHOLE_BYTES:
                    view.copy_(flat)
                elif nbytes:
                    view[-1:].copy_(flat[-1:])
                if received:
                    copies.append((t, view))
                bufs.append([segment.index, offset, nbytes, _dtype_name(t.dtype)])
            op_id = self._next_op
            self._next_op += 1
            work = self._works[op_id] = _Work(self, op_id, copies, auto_land)
            self._open += 1
            self._batch.append(
                {"id": op_id, "group": group, "op": op, "bufs": bufs, "timeout_s": timeout_s, **args}
            )
            full = len(self._batch) >= _BATCH
        if full:
            self.flush()
        return work

    def flush(self) -> None:
        # Batches go out in the order they were taken: gloo pairs receives from one peer with one
        # tag in the order they are posted.
        with self._flush_lock:
            with self._lock:
                batch, self._batch = self._batch, []
            if batch:
                self._send({"do": "posts", "posts": batch})

    def finished(self) -> None:
        """An operation ended (failed, or landed): its segment space may be reused once nothing
        else is open."""
        with self._lock:
            self._open -= 1
            if self._open == 0:
                for segment in self._segments:
                    segment.used = 0

    def _take(self, nbytes: int) -> tuple[_Segment, int]:
        need = max(nbytes, 1)
        for segment in self._segments:
            offset = _aligned(segment.used)
            if offset + need <= segment.size:
                segment.used = offset + need
                return segment, offset
        segment = _Segment(len(self._segments), max(_SEGMENT_BYTES, _aligned(need)))
        self._segments.append(segment)
        try:
            self._channel.send(
                {"do": "segment", "segment": segment.index, "size": segment.size}, [segment.fd]
            )
        except ChannelClosed:
            pass  # the reply reader reports the end
        os.close(segment.fd)
        segment.used = need
        return segment, 0

    def held_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._segments)

    # --- the channel ---------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._channel.send(message)
        except ChannelClosed:
            pass  # the reply reader reports the end

    def _read_replies(self) -> None:
        while True:
            try:
                message, fds = self._channel.recv()
            except ChannelClosed:
                break
            for fd in fds:
                os.close(fd)
            if "done" in message:
                with self._lock:
                    work = self._works.pop(int(message["done"]), None)
                if work is not None:
                    if "error" in message:
                        work.error = RuntimeError(str(message["error"]))
                    work.done.set()
            elif "formed" in message:
                handle = int(message["formed"])
                if "error" in message:
                    self._form_errors[handle] = str(message["error"])
                event = self._formed.get(handle)
                if event is not None:
                    event.set()
            elif "ready" in message:
                self._ready.set()
        self._end()

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        for raw in self._proc.stderr:
            self._stderr.append(raw[:2000].decode(errors="replace").rstrip())

    def _end(self) -> None:
        """The channel closed: the process is gone (or going). Every open operation fails."""
        try:
            code = self._proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        time.sleep(0.05)  # let the stderr reader take the last lines
        error = self._ending(code)
        with self._lock:
            self.ended = error
            works, self._works = list(self._works.values()), {}
        for work in works:
            work.error = error
            work.done.set()
        for event in list(self._formed.values()):
            event.set()
        self._ready.set()
        for segment in self._segments:
            try:
                segment.map.close()
            except BufferError:
                pass  # a view of it is still alive; it goes with the last one

    def _ending(self, code: int) -> WeightwireError:
        lines = list(self._stderr)
        gid = {"group_id": self.group_id} if self.group_id else {}
        for line in reversed(lines):
            m = _GLOO_TOO_LONG.search(line)
            if m:
                sent, posted = m.group(1), m.group(2)
                return WeightwireError(
                    Reason.MESSAGE_TOO_LONG,
                    f"a member of the transfer group sent a message of {sent} bytes where this worker "
                    f"posted a receive of {posted} (gloo ends the receiving process on such a message); "
                    "the update is refused, nothing of it counts as received, and the worker left the group",
                    sent_bytes=sent,
                    posted_bytes=posted,
                    **gid,
                )
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        last = next((ln for ln in reversed(lines) if ln.strip()), "")
        return WeightwireError(
            Reason.TRANSFER_FAILED,
            f"the worker's gloo receiving process ended ({how})"
            + (f": {last[:300]}" if last and code != -9 else "")
            + "; the worker left the group",
            **gid,
        )


class IsolatedProcessGroup:
    """A gloo process group held by a ``ReceivingProcess``, posted to as ``ProcessGroupGloo`` is."""

    def __init__(self, owner: ReceivingProcess, handle: int, timeout_s: float) -> None:
        self._owner = owner
        self._handle = handle
        self._timeout_s = timeout_s

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> _Work:
        return self._owner.post(self._handle, "send", tensors, self._timeout_s, peer=dst, tag=tag)

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int) -> _Work:
        return self._owner.post(self._handle, "recv", tensors, self._timeout_s, peer=src, tag=tag)

    # Receives can be held back from the caller's tensors until every one of an update arrived.
    stages_receives = True

    def recv_staged(
        self, tensors: Sequence[torch.Tensor], src: int, tag: int, *, last_byte: int | None = None
    ) -> _Work:
        """A receive whose bytes reach ``tensors`` only at the work's ``land``. ``last_byte``: what
        the staged bytes end with until the message arrives (``whole_messages.Arrivals.primed``),
        written there and not into ``tensors``, which nothing touches before ``land``."""
        return self._owner.post(
            self._handle,
            "recv",
            tensors,
            self._timeout_s,
            auto_land=False,
            primed_last=last_byte,
            peer=src,
            tag=tag,
        )

    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any) -> _Work:
        return self._owner.post(self._handle, "broadcast", tensors, self._timeout_s, root=int(opts.rootRank))

    def allgather(self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor]) -> _Work:
        return self._owner.post(self._handle, "allgather", [inputs[0], *outputs[0]], self._timeout_s)

    def barrier(self, opts: Any = None) -> _Work:
        return self._owner.post(self._handle, "barrier", [], self._timeout_s)


def _aligned(n: int) -> int:
    return (n + 63) & ~63


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
