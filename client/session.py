"""One update on its way: a PushWeights stream per worker, the acks, the commit after every ack,
cancellation at the first failure, and the deadline.

``run_update`` drives it for ``weightwire.client.pusher``: it opens every stream, hands each job's
buckets to the streams of its recipients, lets each staging buffer go only once all of them acked,
commits every stream once every bucket is acked, and cancels everything still open when one worker
fails or the deadline passes. ``weightwire.client.blame`` then turns the streams into results or one
``PushError``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import grpc
from weightwire.client.blame import collect_results
from weightwire.client.readers import ReaderThreads
from weightwire.client.rpc import Worker, error_from_rpc
from weightwire.client.staging import Job, PreparedBucket, SpecTemplates, StagingPool, Stopped
from weightwire.client.types import ProgressFn, PushProgress, PushResult
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

# Local waits get this much longer than the RPC deadline, so gRPC's own DEADLINE_EXCEEDED (which
# names the worker) normally fires first.
_GRACE_S = 2.0


class WorkerStream:
    """One worker's PushWeights stream: requests from a queue, responses read on a pool thread
    (or, for an update of one worker and one bucket, by the pushing thread itself: ``read_here``)."""

    def __init__(self, update: Update, worker: Worker, header: pb.UpdateHeader) -> None:
        self.update = update
        self.worker = worker
        self.address = worker.address
        self._queue: list[pb.PushWeightsRequest | None] = [pb.PushWeightsRequest(header=header)]
        self._cv = threading.Condition()
        self.sent_jobs: list[int] = []
        self.acks: list[pb.BucketAck] = []
        self.result: pb.UpdateResult | None = None
        self.error: WeightwireError | None = None
        self.cancelled_by_us = False
        self.done = threading.Event()
        self.started = time.monotonic()
        self.finished = 0.0
        self.call: grpc.Call | None = None
        self._reading = False

    def start(self, *, reader: bool = True) -> None:
        with self._cv:
            if self.cancelled_by_us:  # another worker failed before this stream was opened
                self.error = WeightwireError("CANCELLED", "not started", code="CANCELLED", worker=self.address)
                self.done.set()
                return
            self.call = self.worker.stub.PushWeights(
                self._requests(), timeout=self.update.timeout_s, metadata=self.update.metadata
            )
        if reader:
            self.ensure_reader()

    def ensure_reader(self) -> None:
        """Read the responses on one of the pusher's kept threads (unless something reads them already).

        Kept threads: starting a thread per stream per update costs more than the rest of the
        client's work for a small update.
        """
        if self._reading or self.call is None:
            return
        self._reading = True
        try:
            self.update.readers.submit(self._read)
        except RuntimeError:  # the pusher was closed meanwhile (its pool shut down): read on a thread of our own
            threading.Thread(target=self._read, name=f"ww-push-{self.address}", daemon=True).start()

    def read_here(self) -> None:
        """Read the responses on the calling thread until the stream ends (one hand-off fewer per
        response than a reader thread). Only when nothing else has to run meanwhile: every bucket
        is sent, and the commit is sent from ``on_ack``."""
        if self._reading or self.call is None:
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

    def send_bucket(self, job_id: int, bucket: pb.Bucket) -> None:
        bucket.index = len(self.sent_jobs)
        self.sent_jobs.append(job_id)
        self._put(pb.PushWeightsRequest(bucket=bucket))

    def commit(self) -> None:
        self._put(pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=len(self.sent_jobs))))
        self._put(None)

    def cancel(self) -> None:
        with self._cv:
            if self.done.is_set():
                return
            self.cancelled_by_us = True
            call = self.call
        # Cancel before ending the request stream: a worker that saw a clean end of stream first
        # would record a malformed update instead of a cancellation.
        if call is not None:
            call.cancel()
        self._put(None)

    def _read(self, here: bool = False) -> None:
        try:
            for resp in self.call:  # type: ignore[union-attr]
                kind = resp.WhichOneof("message")
                if kind == "ack":
                    self.acks.append(resp.ack)
                    self.update.on_ack(self, resp.ack)
                elif kind == "result":
                    self.result = resp.result
            if self.result is None:
                self.error = WeightwireError(
                    "MALFORMED_STREAM", "the worker ended the stream without an UpdateResult", code="UNKNOWN", worker=self.address
                )
        except grpc.RpcError as e:
            self.error = error_from_rpc(e, worker=self.address)
        except BaseException as e:  # a bug in a progress callback must not hang the update
            self.error = WeightwireError("CLIENT_ERROR", f"{type(e).__name__}: {e}", code="INTERNAL", worker=self.address)
            if here and not isinstance(e, Exception):
                raise  # KeyboardInterrupt and the like in the pushing thread: let it stop the push
        finally:
            self.finished = time.monotonic()
            self._put(None)
            self.done.set()
            self.update.on_stream_end(self)


class Update:
    """The shared state of one update across all worker streams."""

    def __init__(
        self,
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...],
        progress: ProgressFn | None,
        readers: ReaderThreads,
    ) -> None:
        self.timeout_s = timeout_s
        self.readers = readers
        self.metadata = metadata
        self.progress = progress
        self.cond = threading.Condition()
        self.failed = False
        self.first_failure: str | None = None
        self.pending: dict[int, set[str]] = {}
        self.prepared: dict[int, PreparedBucket] = {}
        self.job_bytes: dict[int, int] = {}
        self.streams: dict[str, WorkerStream] = {}
        self.buckets_total = 0
        self.bytes_total = 0
        self.buckets_done = 0
        self.bytes_done = 0
        self.pools: list[StagingPool] = []
        self.committed = False
        self.deadline_hit = False
        # Set (under ``cond``) once every job was handed to its streams: from then on the last ack
        # sends the commit itself, without waking the pushing thread first.
        self.all_sent = False

    def stopped(self) -> bool:
        return self.failed

    def on_ack(self, stream: WorkerStream, ack: pb.BucketAck) -> None:
        if not 0 <= ack.index < len(stream.sent_jobs):
            return  # the worker validates its own stream; an unknown index is its bug, not ours to crash on
        job_id = stream.sent_jobs[ack.index]
        report: PushProgress | None = None
        with self.cond:
            waiting = self.pending.get(job_id)
            if waiting is None:
                return
            waiting.discard(stream.address)
            if not waiting:
                del self.pending[job_id]
                prepared = self.prepared.pop(job_id, None)
                if prepared is not None:
                    prepared.release(True)
                self.buckets_done += 1
                self.bytes_done += self.job_bytes.get(job_id, 0)
                report = PushProgress(self.buckets_done, self.buckets_total, self.bytes_done, self.bytes_total)
                self.commit_if_complete()
                self.cond.notify_all()
        if report is not None and self.progress is not None:
            self.progress(report)

    def commit_if_complete(self) -> None:
        """Commit every stream once every job is sent and acked by all its recipients and nothing
        failed (the caller holds ``cond``). Still only after every ack, as before; just sent by
        whichever thread saw the last one."""
        if self.all_sent and not self.pending and not self.failed and not self.committed:
            self.committed = True
            for s in self.streams.values():
                s.commit()

    def on_stream_end(self, stream: WorkerStream) -> None:
        if stream.error is None:
            with self.cond:
                self.cond.notify_all()
            return
        with self.cond:
            first = not self.failed
            self.failed = True
            if first:
                self.first_failure = stream.address
            self.cond.notify_all()
        for pool in self.pools:
            pool.wake()
        if first:
            for other in self.streams.values():
                if other is not stream:
                    other.cancel()


def run_update(
    jobs: list[Job],
    manifests: Mapping[str, ShardManifest],
    version: int,
    scope: int,
    verify_checksums: bool,
    allow_peer: bool,
    progress: ProgressFn | None,
    update_id: str,
    pools: Sequence[StagingPool],
    *,
    workers: Mapping[str, Worker],
    fingerprints: Mapping[str, str],
    templates: SpecTemplates,
    timeout_s: float,
    metadata: tuple[tuple[str, str], ...],
    readers: ReaderThreads,
) -> dict[str, PushResult]:
    update = Update(timeout_s, metadata, progress, readers)
    update.pools = list(pools)
    update.buckets_total = len(jobs)
    update.bytes_total = sum(j.size_bytes for j in jobs)
    deadline = time.monotonic() + timeout_s + _GRACE_S
    for a in manifests:
        header = pb.UpdateHeader(
            version=version,
            scope=scope,  # type: ignore[arg-type]
            manifest_fingerprint=fingerprints.get(a, ""),
            verify_checksums=verify_checksums,
            allow_peer_device_import=allow_peer,
            update_id=update_id or f"v{version}",
        )
        update.streams[a] = WorkerStream(update, workers[a], header)
    streams = update.streams
    # One worker, at most one bucket: nothing needs the pushing thread while the responses
    # come in, so it reads them itself (the commit goes out from the last ack).
    here = len(streams) == 1 and len(jobs) <= 1
    completed = False
    try:
        for s in streams.values():
            s.start(reader=not here)
        for job_id, job in enumerate(jobs):
            if update.failed:
                break
            try:
                prepared = job.prepare(update.stopped, deadline)
            except Stopped:
                break
            with update.cond:
                update.pending[job_id] = set(job.recipients)
                update.prepared[job_id] = prepared
                update.job_bytes[job_id] = job.size_bytes
            cache: dict[DeviceRef, pb.Payload] = {}
            for a in job.recipients:
                bucket = templates.bucket(job.specs, prepared.base_offset_bytes)
                bucket.payloads.extend(prepared.payloads_for(manifests[a].device, cache))
                if prepared.checksum is not None:
                    bucket.checksum.CopyFrom(prepared.checksum)
                streams[a].send_bucket(job_id, bucket)
        with update.cond:
            if not update.failed:
                update.all_sent = True
                update.commit_if_complete()
        if here:
            for s in streams.values():
                s.read_here()
        with update.cond:
            while update.pending and not update.failed:
                if not update.cond.wait(max(0.0, min(deadline - time.monotonic(), 1.0))) and time.monotonic() >= deadline:
                    break
            if not update.failed and not update.pending:
                update.commit_if_complete()
            elif update.pending and not update.failed:
                update.deadline_hit = True
        for s in streams.values():
            s.done.wait(max(0.0, deadline - time.monotonic()))
        completed = True
    finally:
        if not completed or update.failed or any(not s.done.is_set() for s in streams.values()):
            for s in streams.values():
                s.cancel()
                s.ensure_reader()  # a stream meant to be read here that never was: its end sets ``done``
            for s in streams.values():
                # A cancelled call ends at once; bounded anyway so a broken channel cannot hang us.
                s.done.wait(_GRACE_S)
        with update.cond:
            leftover = list(update.prepared.values())
            update.prepared.clear()
        for prepared in leftover:
            # A cancelled worker may still be reading these: never reuse them.
            prepared.release(False)
    return collect_results(update, manifests, timeout_s)
