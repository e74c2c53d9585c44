"""One worker's PushWeights stream within an update.

A ``WorkerStream`` queues the requests (header, buckets, commit) that gRPC sends from its request
iterator, reads the responses (acks, the result) on one of the pusher's kept reader threads or on
the pushing thread, and tells its owner (``weightwire.client.update.session.UpdateSession``, through the
``StreamOwner`` protocol) about each ack and about its end. An update whose every message is
queued before it needs an answer goes out instead as one PushUpdate call (``use_whole_update``),
read the same way. It writes only its own state; the session reads it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Protocol

import grpc
from weightwire.client.rpc.calls import Worker, error_from_rpc, is_unimplemented
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.kept_threads import KeptThreads
from weightwire.v1 import weight_transfer_pb2 as pb


@dataclasses.dataclass(frozen=True)
class Connections:
    """What every stream of one update shares: the workers, the call metadata, the deadline of one
    stream and the pusher's kept reader threads."""

    workers: Mapping[str, Worker]
    metadata: tuple[tuple[str, str], ...]
    timeout_s: float
    readers: KeptThreads


class StreamOwner(Protocol):
    """The update a stream belongs to: called from the thread that reads the stream."""

    def on_ack(self, stream: WorkerStream, ack: pb.BucketAck) -> None: ...

    def on_stream_end(self, stream: WorkerStream) -> None: ...


class WorkerStream:
    """One worker's PushWeights stream: requests from a queue, responses read on a pool thread
    (or, for an update of one worker and one bucket, by the pushing thread itself: ``read_here``).

    The call may be opened (``start``) before the update is planned, so that gRPC's call set-up
    overlaps the planning; nothing goes out until ``send_header``. A stream cancelled before its
    header leaves no trace on the worker (no update began). Its responses are read only once an
    owner (the update's session) has ``adopt``-ed it.
    """

    def __init__(
        self, owner: StreamOwner | None, connections: Connections, address: str, header: pb.UpdateHeader
    ) -> None:
        self._owner = owner
        self._connections = connections
        self.worker = connections.workers[address]
        self.address = address
        self._header = header
        self._queue: list[pb.PushWeightsRequest | None] = []
        self._cv = threading.Condition()
        self.sent_jobs: list[int] = []
        self.acks: list[pb.BucketAck] = []
        self.result: pb.UpdateResult | None = None
        self.error: WeightwireError | None = None
        self.cancelled_by_us = False
        # The worker's GetStatus once a stream this client cancelled has ended there (``settle``).
        self.settled_status: pb.GetStatusResponse | None = None
        # Wall-clock time the header was queued: a worker's record (ErrorDetail.time) from before
        # it belongs to an earlier update.
        self.header_sent_wall = 0.0
        self.done = threading.Event()
        self.started = time.monotonic()
        self.finished = 0.0
        # When the last ack arrived and the commit went out (0.0: not yet), for trainer metrics.
        self.last_ack_at = 0.0
        self.commit_sent_at = 0.0
        self.call: grpc.Call | None = None
        self._reading = False
        # The whole update, built in place and sent as one PushUpdate call (``use_whole_update``).
        self._whole: pb.PushUpdateRequest | None = None

    @property
    def opened(self) -> bool:
        return self.call is not None

    @property
    def adopted(self) -> bool:
        return self._owner is not None

    def adopt(self, owner: StreamOwner) -> None:
        """Report acks and the end of the stream to ``owner`` (before any response is read)."""
        self._owner = owner

    def use_whole_update(self) -> None:
        """Build this update's messages (header, buckets, commit) into one PushUpdate request,
        sent by ``read_here``, instead of opening a stream: for an update whose every message is
        ready before any answer is needed (one worker, its bucket ready, the commit right behind
        it). A worker older than that call gets the same messages on a stream."""
        assert self.call is None, "the stream is open already"
        self._whole = pb.PushUpdateRequest()

    def send_header(self) -> None:
        # The update begins here for the trainer's metrics, however early the call was opened.
        self.started = time.monotonic()
        self.header_sent_wall = time.time()
        if self._whole is not None:
            self._whole.messages.add().header.CopyFrom(self._header)
            return
        self._put(pb.PushWeightsRequest(header=self._header))

    def start(self) -> None:
        """Open the call; nothing is sent until ``send_header``, nothing read until ``ensure_reader``
        or ``read_here``."""
        if self._whole is not None:
            return  # opened with everything in it, by read_here
        with self._cv:
            if self.cancelled_by_us:  # another worker failed before this stream was opened
                self.error = WeightwireError(Reason.CANCELLED, "not started", worker=self.address)
                self.done.set()
                return
            self.call = self.worker.stub.PushWeights(
                self._requests(), timeout=self._connections.timeout_s, metadata=self._connections.metadata
            )

    def ensure_reader(self) -> None:
        """Read the responses on one of the pusher's kept threads (unless something reads them already).

        Kept threads: starting a thread per stream per update costs more than the rest of the
        client's work for a small update.
        """
        if self._reading or self.call is None or self._owner is None:
            return
        self._reading = True
        try:
            self._connections.readers.submit(self._read)
        except (
            RuntimeError
        ):  # the pusher was closed meanwhile (its pool shut down): read on a thread of our own
            threading.Thread(target=self._read, name=f"ww-push-{self.address}", daemon=True).start()

    def read_here(self) -> None:
        """Read the responses on the calling thread until the stream ends (one hand-off fewer per
        response than a reader thread). Only when nothing else has to run meanwhile: every bucket
        and the commit are already sent (an update of one worker and at most one bucket)."""
        if self._reading or self._owner is None or (self.call is None and self._whole is None):
            return
        self._reading = True
        self._read(here=True)

    def _requests(self) -> Iterable[pb.PushWeightsRequest]:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                msg = self._queue.pop(0)
            if msg is None:
                return
            yield msg

    def _put(self, msg: pb.PushWeightsRequest | None) -> None:
        with self._cv:
            self._queue.append(msg)
            self._cv.notify()

    def new_request(self) -> pb.PushWeightsRequest:
        """An empty request for ``send_bucket`` (inside the whole update already, when there is
        one: a bucket of 399 specs is then not copied once more)."""
        return self._whole.messages.add() if self._whole is not None else pb.PushWeightsRequest()

    def send_bucket(self, job_id: int, request: pb.PushWeightsRequest) -> None:
        """Queue ``request`` (a bucket from ``new_request``) as this stream's next bucket (its
        index is set here)."""
        request.bucket.index = len(self.sent_jobs)
        self.sent_jobs.append(job_id)
        if self._whole is None:
            self._put(request)

    def commit(self) -> None:
        self.commit_sent_at = time.monotonic()
        if self._whole is not None:
            self._whole.messages.add().commit.bucket_count = len(self.sent_jobs)
            return
        self._put(pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=len(self.sent_jobs))))
        self._put(None)

    def cancel(self) -> None:
        with self._cv:
            if self.done.is_set():
                return
            self.cancelled_by_us = True
            call = self.call
            if self._whole is not None and call is None and not self._reading:
                # A whole update not sent yet: the worker never heard of it.
                self.error = WeightwireError(Reason.CANCELLED, "not sent", worker=self.address)
                self.done.set()
                return
        # Cancel before ending the request stream: a worker that saw a clean end of stream first
        # would record a malformed update instead of a cancellation.
        if call is not None:
            call.cancel()
        self._put(None)

    def settle(self, status: pb.GetStatusResponse) -> None:
        """Take the worker's GetStatus after this client cancelled the stream and the worker ended
        the update. The cancel can overtake the worker's own refusal (two stale workers: the first
        refusal cancels the second, whose STALE_VERSION is on its way, and gRPC then reports
        CANCELLED); when the worker recorded its own refusal of this update, that becomes this
        stream's error, so blame and the trainer's metrics carry the worker's reason."""
        self.settled_status = status
        if self.error is None or self.error.code != "CANCELLED" or not status.HasField("last_error"):
            return
        e = status.last_error
        recorded = e.time.seconds + e.time.nanos / 1e9
        # Its record of this update: this version, made after the header went out (an older one of
        # the same version is a previous attempt's), and not the cancellation itself.
        if (
            e.version == self._header.version
            and recorded >= self.header_sent_wall
            and e.reason not in ("CANCELLED", "DEADLINE_EXCEEDED")
        ):
            self.error = WeightwireError(e.reason, e.message, code=e.code or None, worker=self.address)

    def _responses(self) -> Iterable[pb.PushWeightsResponse]:
        whole = self._whole
        if whole is None:
            if self.call is None:
                raise RuntimeError(f"stream to {self.address} read before it was started")
            return self.call
        if self.worker.accepts_push_update:
            try:
                response = self.worker.stub.PushUpdate(
                    whole, timeout=self._connections.timeout_s, metadata=self._connections.metadata
                )
                return response.messages
            except grpc.RpcError as e:
                if not is_unimplemented(e):
                    raise
                # A worker older than PushUpdate refused it before it looked at the update.
                self.worker.accepts_push_update = False
        self.call = self.worker.stub.PushWeights(
            iter(whole.messages), timeout=self._connections.timeout_s, metadata=self._connections.metadata
        )
        return self.call

    def _read(self, here: bool = False) -> None:
        owner = self._owner
        assert owner is not None  # ensure_reader and read_here start reading only once adopted
        try:
            for resp in self._responses():
                kind = resp.WhichOneof("message")
                if kind == "ack":
                    self.acks.append(resp.ack)
                    self.last_ack_at = time.monotonic()
                    owner.on_ack(self, resp.ack)
                elif kind == "result":
                    # The worker committed before it sent this, and the result is its stream's last
                    # message: the update is over here. The call's OK status follows on its own.
                    self.result = resp.result
                    break
            if self.result is None:
                self.error = WeightwireError(
                    Reason.RPC_FAILED,
                    "the worker ended the stream without an UpdateResult",
                    worker=self.address,
                )
        except grpc.RpcError as e:
            self.error = error_from_rpc(e, worker=self.address)
        except BaseException as e:  # a bug in a progress callback must not hang the update
            self.error = WeightwireError(Reason.INTERNAL, f"{type(e).__name__}: {e}", worker=self.address)
            if here and not isinstance(e, Exception):
                raise  # KeyboardInterrupt and the like in the pushing thread: let it stop the push
        finally:
            self.finished = time.monotonic()
            self._put(None)
            self.done.set()
            owner.on_stream_end(self)


# How often a cancelled worker is asked whether it has ended its update.
_SETTLE_POLL_S = 0.02


def settle_cancelled(
    streams: Iterable[WorkerStream],
    metadata: tuple[tuple[str, str], ...],
    deadline: float,
    *,
    skip: Collection[str] = (),
) -> None:
    """Return only once every worker whose stream this client cancelled has ended that update
    (GetStatus no longer UPDATING), or at the deadline. A cancelled worker may still be inside a
    load; a trainer retrying at once must not be refused (UPDATE_IN_PROGRESS) by its own failed
    update. A worker that does not answer GetStatus, or one in ``skip`` (busy with another update
    before this one started), is not waited for. Each stream takes the last answer
    (``WorkerStream.settle``): a worker that had refused the update on its own is blamed for that
    (MANIFEST_CHANGED, GROUP_NOT_JOINED, ...), not reported CANCELLED."""
    waiting = [s for s in streams if s.cancelled_by_us and s.call is not None and s.address not in skip]
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        calls = [
            (s, s.worker.stub.GetStatus.future(pb.GetStatusRequest(), timeout=remaining, metadata=metadata))
            for s in waiting
        ]
        still: list[WorkerStream] = []
        for s, call in calls:
            try:
                status = call.result()
            except grpc.RpcError:
                continue
            if status.state == pb.WORKER_STATE_UPDATING:
                still.append(s)
            else:
                s.settle(status)  # what the worker recorded: its own refusal, if it made one
        waiting = still
        if waiting:
            time.sleep(min(_SETTLE_POLL_S, max(0.0, deadline - time.monotonic())))
