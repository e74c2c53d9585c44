"""``WeightPusher``: the trainer-side streaming client.

A trainer calls, in a few lines::

    with WeightPusher(["unix:/run/ww/tp0.sock", "unix:/run/ww/tp1.sock"]) as pusher:
        results = pusher.push(model.named_parameters(), version=step)

One update runs as: fetch (cached) manifests of every worker concurrently -> check names, dtypes,
shapes and FULL coverage against them (``weightwire.client.plan``) -> re-check each worker's
manifest fingerprint and instance id -> open one PushWeights stream per worker -> pack buckets into
bounded staging buffers (double-buffered: bucket k+1 is packed while workers copy bucket k) and send
each only to the workers that own something in it -> reuse a buffer only after every worker that
got it acked -> once all buckets are acked, commit on every worker -> one ``PushResult`` per worker,
or one ``PushError`` naming each failed worker (the others' streams are cancelled at the first
failure).

Lower-level entry points: ``push_flat`` (already-flat buffers plus their specs, exported in place
when the transport can, e.g. a buffer from ``host_buffer``) and ``push_gathered`` (buckets carrying
several labelled payloads, e.g. one per trainer GPU after a gather; each worker picks its own).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import grpc
import torch
from weightwire.client import exporters as exp
from weightwire.client import plan as planning
from weightwire.client.plan import PlanError, TensorSpec
from weightwire.client.rpc import Worker, call_metadata, error_from_rpc
from weightwire.core.devices import DeviceRef, is_own_device
from weightwire.core.errors import PushError, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

log = logging.getLogger(__name__)

Scope = Literal["full", "partial"]
_SCOPES = {"full": pb.UPDATE_SCOPE_FULL, "partial": pb.UPDATE_SCOPE_PARTIAL}
# Local waits get this much longer than the RPC deadline, so gRPC's own DEADLINE_EXCEEDED (which
# names the worker) normally fires first.
_GRACE_S = 2.0


@dataclasses.dataclass(frozen=True)
class PushResult:
    """What one worker reported for a committed update, plus the client's view of it."""

    worker: str
    worker_id: str
    version: int
    previous_version: int
    tensors_loaded: int
    bytes_loaded: int
    buckets: int
    handles_opened: int
    duration_s: float
    server_duration_s: float
    transport: str
    state: str
    # Buckets this worker took from another GPU of its host (only with allow_peer_device_import),
    # and every device it imported payloads from (normalised labels, e.g. "cuda:1a2b...").
    peer_device_imports: int = 0
    source_devices: tuple[str, ...] = ()

    @property
    def gbps(self) -> float:
        """Bytes loaded per second of the whole update as the client saw it, in GB/s."""
        return self.bytes_loaded / self.duration_s / 1e9 if self.duration_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class PushProgress:
    buckets_done: int
    buckets_total: int
    bytes_done: int
    bytes_total: int


@dataclasses.dataclass
class FlatBucket:
    """An already-flat buffer (e.g. an all-gather output) and the tensors inside it.

    ``buffer`` is a contiguous tensor of any dtype; ``specs`` offsets are relative to its first
    byte. It is exported in place when the transport can (a CPU buffer from
    ``WeightPusher.host_buffer`` over host shared memory; a CUDA buffer over CUDA IPC), otherwise
    copied once into a staging buffer.
    """

    buffer: torch.Tensor
    specs: Sequence[TensorSpec]


@dataclasses.dataclass
class GatheredBucket:
    """One bucket layout with several labelled copies of its bytes.

    Each entry of ``payloads`` is either a ``weightwire.v1.Payload`` exported elsewhere (another
    trainer rank's CUDA IPC handle or shm segment, already labelled with its device) or a local
    flat tensor, exported here and labelled with this process's device for it. Every worker picks
    the payload labelled with its own device. ``size_bytes`` defaults to the end of the last spec.
    """

    specs: Sequence[TensorSpec]
    payloads: Sequence[pb.Payload | torch.Tensor]
    size_bytes: int | None = None


ProgressFn = Callable[[PushProgress], None]


# --------------------------------------------------------------------------------------------
# Staging pool
# --------------------------------------------------------------------------------------------


class _Stopped(Exception):
    """The update failed elsewhere while this thread waited for a staging buffer."""


class _StagingPool:
    """At most ``depth`` reusable staging buffers of one exporter (depth 2 = double buffering).

    A buffer big enough is reused; when none is free and the pool is full, the caller waits for a
    release; a free buffer that is too small is replaced by a bigger one (a tensor larger than a
    bucket), so memory stays bounded by ``depth`` x the largest bucket.
    """

    def __init__(self, exporter: exp.Exporter, bucket_bytes: int, depth: int = 2) -> None:
        self.exporter = exporter
        self.bucket_bytes = bucket_bytes
        self.depth = depth
        self._free: list[exp.StagingBuffer] = []
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, nbytes: int, stopped: Callable[[], bool], deadline: float) -> exp.StagingBuffer:
        with self._cond:
            while True:
                if stopped():
                    raise _Stopped
                if self._closed:
                    raise RuntimeError("the pusher is closed")
                fits = [b for b in self._free if b.capacity_bytes >= nbytes]
                if fits:
                    buf = min(fits, key=lambda b: b.capacity_bytes)
                    self._free.remove(buf)
                    return buf
                if self._count < self.depth:
                    self._count += 1
                    break
                if self._free:
                    self._free.pop().close()
                    self._count -= 1
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("no staging buffer came free before the deadline (workers did not ack)")
                self._cond.wait(min(remaining, 1.0))
        try:
            return self.exporter.allocate(max(nbytes, self.bucket_bytes))
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify_all()
            raise

    def release(self, buf: exp.StagingBuffer) -> None:
        with self._cond:
            if self._closed:
                buf.close()
            else:
                self._free.append(buf)
            self._cond.notify_all()

    def discard(self, buf: exp.StagingBuffer) -> None:
        """Drop a buffer a cancelled worker might still read: never hand it out again."""
        buf.close()
        with self._cond:
            self._count -= 1
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            free, self._free = self._free, []
            self._cond.notify_all()
        for buf in free:
            buf.close()


# --------------------------------------------------------------------------------------------
# One bucket on its way
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Prepared:
    """A bucket whose bytes are staged and exported: the payloads each worker gets."""

    fixed: list[pb.Payload]
    per_worker: Callable[[DeviceRef], pb.Payload] | None
    checksum: pb.Checksum | None
    release: Callable[[bool], None]
    # Where the layout starts inside the exported storage (a wrapped view into a larger buffer).
    base_offset_bytes: int = 0

    def payloads_for(self, device: DeviceRef, cache: dict[DeviceRef, pb.Payload]) -> list[pb.Payload]:
        if self.per_worker is None:
            return self.fixed
        if device not in cache:
            cache[device] = self.per_worker(device)
        return [*self.fixed, cache[device]]


class _SpecTemplates:
    """The ``tensors`` part of a Bucket message per (job specs, base offset), built once.

    A trainer pushing the same ``FlatBucket`` every update hands over the same ``TensorSpec``
    objects each time (frozen dataclasses: immutable). Entries hold those objects, so while an entry
    lives no other object can have their ids; equal ids in a key therefore mean the same specs.
    """

    _MAX_ENTRIES = 256

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], tuple[list[TensorSpec], pb.Bucket]] = {}

    def bucket(self, specs: list[TensorSpec], base_offset_bytes: int) -> pb.Bucket:
        """A new Bucket whose ``tensors`` are ``specs`` shifted by ``base_offset_bytes``."""
        key = (base_offset_bytes, *map(id, specs))
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self._MAX_ENTRIES:
                self._entries.clear()
            entry = (list(specs), pb.Bucket(tensors=[s.to_proto(base_offset_bytes) for s in specs]))
            self._entries[key] = entry
        out = pb.Bucket()
        out.CopyFrom(entry[1])
        return out


class _CheckedLayouts:
    """``push_flat`` layouts that already passed the client's planning checks, by object identity.

    A trainer pushing the same ``FlatBucket`` specs every update hands over the same immutable
    ``TensorSpec`` objects against the same (frozen) manifest objects each time; the name, dtype,
    shape, FULL-coverage and bounds checks of those exact objects, with the same scope, flags and
    buffer sizes, give the same answer again. Entries hold the objects, so while an entry lives no
    other object can have their ids. Only successes are kept; new manifests (a re-read after a
    restart) are new objects and so a miss.
    """

    _MAX_ENTRIES = 64

    def __init__(self) -> None:
        self._entries: dict[tuple[object, ...], tuple[list[object], list[tuple[str, ...]]]] = {}

    @staticmethod
    def key(
        buckets: Sequence[FlatBucket], sizes: Sequence[int], manifests: Mapping[str, ShardManifest], scope: int, allow_unowned: bool
    ) -> tuple[object, ...]:
        return (
            scope,
            allow_unowned,
            tuple(sizes),
            tuple((a, id(m)) for a, m in manifests.items()),
            tuple(tuple(map(id, b.specs)) for b in buckets),
        )

    def get(self, key: tuple[object, ...]) -> list[tuple[str, ...]] | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def put(
        self,
        key: tuple[object, ...],
        buckets: Sequence[FlatBucket],
        manifests: Mapping[str, ShardManifest],
        recipients: list[tuple[str, ...]],
    ) -> None:
        if len(self._entries) >= self._MAX_ENTRIES:
            self._entries.clear()
        held: list[object] = [list(manifests.values()), *(list(b.specs) for b in buckets)]
        self._entries[key] = (held, recipients)


@dataclasses.dataclass
class _Job:
    specs: list[TensorSpec]
    recipients: tuple[str, ...]
    size_bytes: int
    prepare: Callable[[Callable[[], bool], float], _Prepared]


class _Stream:
    """One worker's PushWeights stream: requests from a queue, responses read on a pool thread
    (or, for an update of one worker and one bucket, by the pushing thread itself: ``read_here``)."""

    def __init__(self, update: _Update, worker: Worker, header: pb.UpdateHeader) -> None:
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


class _Update:
    """The shared state of one update across all worker streams."""

    def __init__(
        self,
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...],
        progress: ProgressFn | None,
        readers: _ReaderThreads,
    ) -> None:
        self.timeout_s = timeout_s
        self.readers = readers
        self.metadata = metadata
        self.progress = progress
        self.cond = threading.Condition()
        self.failed = False
        self.first_failure: str | None = None
        self.pending: dict[int, set[str]] = {}
        self.prepared: dict[int, _Prepared] = {}
        self.job_bytes: dict[int, int] = {}
        self.streams: dict[str, _Stream] = {}
        self.buckets_total = 0
        self.bytes_total = 0
        self.buckets_done = 0
        self.bytes_done = 0
        self.pools: list[_StagingPool] = []
        self.committed = False
        self.deadline_hit = False
        # Set (under ``cond``) once every job was handed to its streams: from then on the last ack
        # sends the commit itself, without waking the pushing thread first.
        self.all_sent = False

    def stopped(self) -> bool:
        return self.failed

    def on_ack(self, stream: _Stream, ack: pb.BucketAck) -> None:
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

    def on_stream_end(self, stream: _Stream) -> None:
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


# --------------------------------------------------------------------------------------------
# The pusher
# --------------------------------------------------------------------------------------------


class _ReaderThreads:
    """Kept daemon threads that read update streams (starting a thread per worker per push costs
    more than the push's own Python work). Daemon, unlike a ThreadPoolExecutor's workers, so a
    trainer that exits with a push in flight is not held up until the stream's deadline."""

    def __init__(self, max_threads: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._max = max_threads
        self._name = name
        self._mu = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[[], None]) -> None:
        with self._mu:
            if self._closed:
                raise RuntimeError("the pusher is closed")
            self._tasks.put(fn)
            if self._idle > 0:
                self._idle -= 1
                return
            if self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._run, name=f"{self._name}-{self._threads}", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn = self._tasks.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # a reader reports its own errors; never let one kill the thread
                log.exception("stream reader failed")
            with self._mu:
                self._idle += 1

    def shutdown(self) -> None:
        with self._mu:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._tasks.put(None)


def _close_all(
    pools: dict[str, _StagingPool],
    exporters: dict[str, exp.Exporter],
    workers: list[Worker],
    executors: list[_ReaderThreads],
) -> None:
    for ex in executors:
        # Not waiting: closing the channels below ends any call a thread is still blocked in.
        ex.shutdown()
    for pool in pools.values():
        pool.close()
    for exporter in exporters.values():
        exporter.close()
    for w in workers:
        w.close()


class WeightPusher:
    """Pushes weight updates to a set of engine workers (one endpoint per worker process).

    ``timeout_s`` is the deadline of every RPC, including one whole update stream.
    ``bucket_size_bytes`` bounds a staging buffer (inline buckets are bounded under the gRPC message
    limit instead). ``transport`` is ``"auto"``, ``"host_shm"``, ``"inline"`` or a registered one
    (``"cuda_ipc"``). ``recheck_manifests`` re-reads every worker's fingerprint and instance id
    (GetStatus, concurrently) before each update, to refuse a plan made against a worker that has
    since restarted; the worker checks the header's fingerprint too.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        token: str | None = None,
        tls_ca: bytes | str | None = None,
        timeout_s: float = 60.0,
        bucket_size_bytes: int = planning.DEFAULT_BUCKET_BYTES,
        transport: str = "auto",
        align_bytes: int = planning.DEFAULT_ALIGN_BYTES,
        pipeline_depth: int = 2,
        recheck_manifests: bool = True,
    ) -> None:
        if not endpoints:
            raise ValueError("WeightPusher needs at least one worker endpoint")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"duplicate worker endpoints: {list(endpoints)}")
        if isinstance(tls_ca, str):
            with open(tls_ca, "rb") as f:
                tls_ca = f.read()
        self.endpoints = list(endpoints)
        self.timeout_s = float(timeout_s)
        self.bucket_size_bytes = int(bucket_size_bytes)
        self.transport = transport
        self.align_bytes = int(align_bytes)
        self.pipeline_depth = max(1, int(pipeline_depth))
        self.recheck_manifests = recheck_manifests
        self._metadata = call_metadata(token)
        self._workers = {a: Worker(a, tls_ca=tls_ca) for a in self.endpoints}
        self._manifests: dict[str, ShardManifest] | None = None
        self._fingerprints: dict[str, str] = {}
        self._exporters: dict[str, exp.Exporter] = {}
        self._pools: dict[str, _StagingPool] = {}
        self._templates = _SpecTemplates()
        self._checked = _CheckedLayouts()
        self._user_buffers: list[exp.StagingBuffer] = []
        self._push_lock = threading.Lock()
        self._closed = False
        # The threads that read the update streams are kept across updates: a thread start per
        # worker per update is a large share of a small update's cost on a busy host. Room for a
        # reader still ending after a cancelled update next to the next update's readers.
        self._readers = _ReaderThreads(2 * len(self.endpoints) + 2, "ww-push")
        # Segments are unlinked even if the caller forgets close() (also at interpreter exit).
        self._finalizer = weakref.finalize(
            self, _close_all, self._pools, self._exporters, list(self._workers.values()), [self._readers]
        )

    # ---------------------------------------------------------------- context, lifecycle

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unlink every staging segment and close the channels. Idempotent."""
        self._closed = True
        for buf in self._user_buffers:
            buf.close()
        self._user_buffers.clear()
        self._finalizer()

    # ---------------------------------------------------------------- manifests and status

    def _unary_all(self, method: str, request: object) -> dict[str, object]:
        """Call a unary RPC on every worker concurrently; raise one PushError for all failures."""
        return self._collect(method, self._start_all(method, request))

    def _start_all(self, method: str, request: object) -> dict[str, grpc.Future]:
        """Start a unary RPC on every worker; ``_collect`` waits for the answers."""
        return {
            a: getattr(w.stub, method).future(request, timeout=self.timeout_s, metadata=self._metadata)
            for a, w in self._workers.items()
        }

    def _collect(self, method: str, pending: Mapping[str, grpc.Future]) -> dict[str, object]:
        out: dict[str, object] = {}
        failures: dict[str, WeightwireError] = {}
        for a, fut in pending.items():
            try:
                out[a] = fut.result()
            except grpc.RpcError as e:
                failures[a] = error_from_rpc(e, worker=a, context=method)
        if failures:
            raise PushError(failures)
        return out

    def manifests(self, *, refresh: bool = False) -> dict[str, ShardManifest]:
        """Every worker's shard manifest (fetched concurrently, then cached), keyed by endpoint."""
        if self._manifests is None or refresh:
            responses = self._unary_all("GetManifest", pb.GetManifestRequest())
            manifests: dict[str, ShardManifest] = {}
            fingerprints: dict[str, str] = {}
            for a in self.endpoints:
                msg = responses[a].manifest  # type: ignore[attr-defined]
                manifests[a] = ShardManifest.from_proto(msg)
                fingerprints[a] = msg.fingerprint
            self._manifests, self._fingerprints = manifests, fingerprints
        return dict(self._manifests)

    def refresh_manifests(self) -> dict[str, ShardManifest]:
        return self.manifests(refresh=True)

    def status(self) -> dict[str, pb.GetStatusResponse]:
        """Every worker's GetStatus (weights version, state, last result/error), keyed by endpoint."""
        return self._unary_all("GetStatus", pb.GetStatusRequest())  # type: ignore[return-value]

    def _start_recheck(self) -> dict[str, grpc.Future] | None:
        """Send the re-check's GetStatus to every worker now, so it travels while the push is planned.

        Only its answers are looked at, in ``_run`` after planning, before anything is sent; a planning
        error therefore still wins, and a worker that restarted is still caught before its header.
        """
        return self._start_all("GetStatus", pb.GetStatusRequest()) if self.recheck_manifests else None

    def _recheck(self, workers: Iterable[str], pending: Mapping[str, grpc.Future] | None = None) -> None:
        statuses: Mapping[str, pb.GetStatusResponse] = (
            self._collect("GetStatus", pending) if pending is not None else self.status()  # type: ignore[assignment]
        )
        changed: dict[str, WeightwireError] = {}
        for a in workers:
            st = statuses[a]
            planned = self._manifests[a] if self._manifests else None
            if planned is None:
                continue
            if st.manifest_fingerprint != self._fingerprints[a] or (planned.instance_id and st.instance_id != planned.instance_id):
                changed[a] = PlanError(
                    "MANIFEST_CHANGED",
                    f"worker {planned.worker_id or a} changed since its manifest was read (instance "
                    f"{planned.instance_id or '?'} -> {st.instance_id or '?'}, fingerprint "
                    f"{self._fingerprints[a][:12]} -> {st.manifest_fingerprint[:12]}): it restarted or "
                    "changed layout. Nothing was sent; the next push re-reads the manifests (make it a FULL update).",
                    code="FAILED_PRECONDITION",
                    worker=a,
                )
        if changed:
            self._manifests = None
            raise PushError(changed)

    # ---------------------------------------------------------------- staging

    def _exporter(self, name: str, source: torch.device) -> exp.Exporter:
        key = name if name in ("host_shm", "inline") else f"{name}:{source}"
        if key not in self._exporters:
            self._exporters[key] = exp.make_exporter(name, source)
        return self._exporters[key]

    def _pool(self, exporter: exp.Exporter, bucket_bytes: int) -> _StagingPool:
        key = next(k for k, v in self._exporters.items() if v is exporter)
        pool = self._pools.get(key)
        if pool is None or pool.bucket_bytes != bucket_bytes:
            if pool is not None:
                pool.close()
            pool = self._pools[key] = _StagingPool(exporter, bucket_bytes, self.pipeline_depth)
        return pool

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 CPU tensor in host shared memory, for ``push_flat``/``push_gathered`` with
        no packing copy (e.g. gather into it). It lives until ``close()``."""
        seg = self._exporter("host_shm", torch.device("cpu")).allocate(nbytes)
        self._user_buffers.append(seg)
        return seg.tensor()[:nbytes]

    def export_payload(self, flat: torch.Tensor, size_bytes: int | None = None) -> pb.Payload:
        """Export a local flat buffer in place as a labelled ``Payload`` (no copy), e.g. for a trainer
        rank that hands its payload to the rank calling ``push_gathered`` (send
        ``payload.SerializeToString()``; the receiver parses it with ``Payload.FromString``).

        CPU buffers must come from ``host_buffer``; CUDA buffers go through CUDA IPC. The buffer must
        stay alive and unchanged until the push that carries the payload returned.
        """
        raw = _flat_bytes(flat, "export_payload")
        exporter = self._exporter("host_shm" if raw.device.type == "cpu" else "cuda_ipc", raw.device)
        staged = exporter.wrap(raw)
        if staged is None or exporter.label is None:
            raise PlanError(
                "HANDLE_MISSING",
                "export_payload needs a buffer from WeightPusher.host_buffer (CPU) or a CUDA tensor",
                code="INVALID_ARGUMENT",
            )
        if staged.base_offset_bytes:
            raise PlanError(
                "INVALID_OFFSET", "export_payload needs a buffer that starts at its allocation's first byte", code="INVALID_ARGUMENT"
            )
        staged.ready()
        size = raw.numel() if size_bytes is None else int(size_bytes)
        return exporter.export(staged, size, exporter.label)

    def _transport_for(self, manifests: Mapping[str, ShardManifest], source: torch.device) -> str:
        if self.transport != "auto":
            return self.transport
        return exp.choose_transport([m.device for m in manifests.values()], source)

    # ---------------------------------------------------------------- entry points

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        version: int,
        scope: Scope = "full",
        allow_unowned: bool = False,
        verify_checksums: bool = False,
        progress: ProgressFn | None = None,
        update_id: str = "",
        only_own_device: bool = False,
    ) -> dict[str, PushResult]:
        """Push checkpoint-named tensors as weights ``version``; one result per worker.

        Raises ``PlanError`` before sending anything when names, dtypes, shapes or FULL coverage do
        not fit the manifests, and ``PushError`` when any worker failed (naming each). With
        ``only_own_device`` the update goes only to workers on the device this process exports from
        (a colocated trainer rank pushing to its own GPU's workers).
        """
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in items]
        source = next((t.device for _, t in items if t.device.type != "cpu"), torch.device("cpu"))
        manifests = self.manifests()
        recheck = self._start_recheck()
        exporter = self._exporter(self._transport_for(manifests, source), source)
        manifests = self._route_own_device(manifests, exporter, only_own_device)
        scope_pb = _scope(scope)
        unknown = set(planning.check_update(specs, manifests, scope=scope_pb, allow_unowned=allow_unowned))
        self._check_labels(manifests, [exporter.label] if exporter.label else None, "every bucket")

        bucket_bytes = self.bucket_size_bytes
        if exporter.transport == pb.TRANSPORT_KIND_INLINE:
            bucket_bytes = min(bucket_bytes, exp.INLINE_BUCKET_BYTES)
        owners = planning.owners_by_name(manifests)
        plans = planning.plan_buckets(
            [s for s in specs if s.name not in unknown], owners, bucket_bytes=bucket_bytes, align_bytes=self.align_bytes
        )
        # plan_buckets indexes the filtered list; map back to the tensors.
        kept = [t for (name, t) in items if name not in unknown]
        _check_transport_limit(exporter, [p.size_bytes for p in plans])
        pool = self._pool(exporter, bucket_bytes)

        jobs = [
            _Job(
                list(p.specs),
                p.recipients,
                p.size_bytes,
                _packer(pool, exporter, p, [kept[i] for i in p.items], verify_checksums),
            )
            for p in plans
        ]
        return self._run(
            jobs, manifests, version, scope_pb, verify_checksums, False, progress, update_id, pool, recheck=recheck
        )

    def push_flat(
        self,
        buckets: Sequence[FlatBucket],
        *,
        version: int,
        scope: Scope = "full",
        allow_unowned: bool = False,
        verify_checksums: bool = False,
        progress: ProgressFn | None = None,
        update_id: str = "",
        only_own_device: bool = False,
    ) -> dict[str, PushResult]:
        """Push already-flat buffers with their tensor specs (no packing copy; exported in place
        when the transport can). Each bucket goes to the workers owning something in it."""
        all_specs = [s for b in buckets for s in b.specs]
        source = next((b.buffer.device for b in buckets if b.buffer.device.type != "cpu"), torch.device("cpu"))
        manifests = self.manifests()
        recheck = self._start_recheck()
        exporter = self._exporter(self._transport_for(manifests, source), source)
        manifests = self._route_own_device(manifests, exporter, only_own_device)
        scope_pb = _scope(scope)
        # Byte sizes as ``_flat_bytes`` will see them (it only refuses, below, in the same order as ever).
        sizes = [b.buffer.numel() * b.buffer.element_size() for b in buckets]
        checked_key = self._checked.key(buckets, sizes, manifests, scope_pb, allow_unowned)
        routed = self._checked.get(checked_key)
        if routed is None:
            planning.check_update(all_specs, manifests, scope=scope_pb, allow_unowned=allow_unowned)
        self._check_labels(manifests, [exporter.label] if exporter.label else None, "every bucket")
        flats = [_flat_bytes(b.buffer, f"flat bucket {i}") for i, b in enumerate(buckets)]
        if routed is None:
            owners = planning.owners_by_name(manifests)
            for i, (b, size) in enumerate(zip(buckets, sizes, strict=True)):
                planning.check_flat_specs(b.specs, size, f"flat bucket {i}")
            routed = [_recipients(b.specs, owners, manifests) for b in buckets]
            self._checked.put(checked_key, buckets, manifests, routed)
        _check_transport_limit(exporter, sizes)
        pool = self._pool(exporter, self.bucket_size_bytes)
        jobs: list[_Job] = []
        for b, flat, recipients in zip(buckets, flats, routed, strict=True):
            if not recipients:
                continue
            jobs.append(
                _Job(
                    list(b.specs),
                    recipients,
                    flat.numel(),
                    _flat_exporter_job(pool, exporter, flat, list(b.specs), verify_checksums),
                )
            )
        return self._run(
            jobs, manifests, version, scope_pb, verify_checksums, False, progress, update_id, pool, recheck=recheck
        )

    def push_gathered(
        self,
        buckets: Sequence[GatheredBucket],
        *,
        version: int,
        scope: Scope = "full",
        allow_unowned: bool = False,
        verify_checksums: bool = False,
        allow_peer_device_import: bool = False,
        precheck_labels: bool = True,
        progress: ProgressFn | None = None,
        update_id: str = "",
    ) -> dict[str, PushResult]:
        """Push buckets that each carry several labelled payloads (one per exporting device) to all
        workers owning something in them; every worker imports the payload labelled with its own
        device and nothing else.

        With ``precheck_labels`` (default) a worker whose device has no payload in a bucket it must
        receive is a ``PlanError`` before anything is sent; without it the worker refuses the
        bucket (NO_PAYLOAD_FOR_DEVICE) and the push fails with its status.
        """
        manifests = self.manifests()
        recheck = self._start_recheck()
        scope_pb = _scope(scope)
        planning.check_update([s for b in buckets for s in b.specs], manifests, scope=scope_pb, allow_unowned=allow_unowned)
        owners = planning.owners_by_name(manifests)
        jobs: list[_Job] = []
        pools: list[_StagingPool] = []
        for i, b in enumerate(buckets):
            where = f"gathered bucket {i}"
            size = b.size_bytes if b.size_bytes is not None else max((s.offset_bytes + s.nbytes for s in b.specs), default=0)
            planning.check_flat_specs(b.specs, size, where)
            recipients = _recipients(b.specs, owners, manifests)
            fixed: list[pb.Payload] = []
            local: list[tuple[exp.Exporter, torch.Tensor]] = []
            labels: list[DeviceRef] = []
            for p in b.payloads:
                if isinstance(p, pb.Payload):
                    if p.size_bytes < size:
                        raise PlanError("INVALID_SIZE", f"{where}: a payload labelled {_label_str(p)} holds {p.size_bytes} bytes, the layout needs {size}", code="INVALID_ARGUMENT")
                    fixed.append(p)
                    labels.append(DeviceRef(p.device.kind, p.device.uuid))
                else:
                    flat = _flat_bytes(p, where)
                    if flat.numel() < size:
                        raise PlanError("INVALID_SIZE", f"{where}: a local buffer holds {flat.numel()} bytes, the layout needs {size}", code="INVALID_ARGUMENT")
                    name = "host_shm" if flat.device.type == "cpu" else "cuda_ipc"
                    exporter = self._exporter(name, flat.device)
                    if exporter.label is None:
                        raise PlanError("PAYLOAD_LABEL_MISSING", f"{where}: transport {name} cannot label a local payload", code="INVALID_ARGUMENT")
                    local.append((exporter, flat))
                    labels.append(exporter.label)
            dupes = {str(lb) for lb in labels if labels.count(lb) > 1}
            if dupes:
                raise PlanError("DUPLICATE_PAYLOAD_LABEL", f"{where}: more than one payload labelled {', '.join(sorted(dupes))}", code="INVALID_ARGUMENT")
            if precheck_labels and recipients:
                self._check_labels({w: manifests[w] for w in recipients}, labels, where, allow_peer_device_import)
            if not recipients:
                continue
            job_pools = [self._pool(e, self.bucket_size_bytes) for e, _ in local]
            pools.extend(job_pools)
            jobs.append(
                _Job(
                    list(b.specs),
                    recipients,
                    size,
                    _gathered_job(fixed, list(zip(job_pools, local, strict=True)), size, verify_checksums),
                )
            )
        return self._run(
            jobs, manifests, version, scope_pb, verify_checksums, allow_peer_device_import, progress, update_id, *pools,
            recheck=recheck,
        )

    # ---------------------------------------------------------------- checks

    def _route_own_device(
        self, manifests: dict[str, ShardManifest], exporter: exp.Exporter, only_own_device: bool
    ) -> dict[str, ShardManifest]:
        if not only_own_device or exporter.label is None:
            return manifests
        mine = {a: m for a, m in manifests.items() if is_own_device(exporter.label, m.device)}
        if not mine:
            raise PlanError(
                "NO_PAYLOAD_FOR_DEVICE",
                f"no worker is on this process's device {exporter.label}; workers are on "
                + ", ".join(sorted({str(m.device) for m in manifests.values()})),
                code="FAILED_PRECONDITION",
            )
        return mine

    def _check_labels(
        self,
        manifests: Mapping[str, ShardManifest],
        labels: Sequence[DeviceRef] | None,
        where: str,
        allow_peer: bool = False,
    ) -> None:
        if labels is None:  # inline: each worker's payload is labelled with its own device
            return
        bad = planning.device_mismatches(manifests, labels, manifests)
        if allow_peer:
            bad = {w: m for w, m in bad.items() if not (manifests[w].device.is_cuda and any(lb.is_cuda for lb in labels))}
        if bad:
            raise PlanError(
                "NO_PAYLOAD_FOR_DEVICE",
                f"{where}: {len(bad)} worker(s) would get no payload for their own device (nothing was sent):\n  "
                + "\n  ".join(bad.values())
                + "\nGive each worker a payload from its own device (push_gathered), push from a process on "
                "that device, use transport='inline', or pass only_own_device=True to skip them.",
                code="FAILED_PRECONDITION",
            )

    # ---------------------------------------------------------------- the update

    def _run(
        self,
        jobs: list[_Job],
        manifests: Mapping[str, ShardManifest],
        version: int,
        scope: int,
        verify_checksums: bool,
        allow_peer: bool,
        progress: ProgressFn | None,
        update_id: str,
        *pools: _StagingPool,
        recheck: Mapping[str, grpc.Future] | None = None,
    ) -> dict[str, PushResult]:
        if self._closed:
            raise RuntimeError("this WeightPusher is closed")
        if not self._push_lock.acquire(blocking=False):
            raise RuntimeError("a push is already running on this WeightPusher; one update at a time")
        try:
            if self.recheck_manifests:
                self._recheck(manifests, recheck)
            return self._stream_update(jobs, manifests, version, scope, verify_checksums, allow_peer, progress, update_id, pools)
        finally:
            self._push_lock.release()

    def _stream_update(
        self,
        jobs: list[_Job],
        manifests: Mapping[str, ShardManifest],
        version: int,
        scope: int,
        verify_checksums: bool,
        allow_peer: bool,
        progress: ProgressFn | None,
        update_id: str,
        pools: Sequence[_StagingPool],
    ) -> dict[str, PushResult]:
        update = _Update(self.timeout_s, self._metadata, progress, self._readers)
        update.pools = list(pools)
        update.buckets_total = len(jobs)
        update.bytes_total = sum(j.size_bytes for j in jobs)
        deadline = time.monotonic() + self.timeout_s + _GRACE_S
        for a in manifests:
            header = pb.UpdateHeader(
                version=version,
                scope=scope,  # type: ignore[arg-type]
                manifest_fingerprint=self._fingerprints.get(a, ""),
                verify_checksums=verify_checksums,
                allow_peer_device_import=allow_peer,
                update_id=update_id or f"v{version}",
            )
            update.streams[a] = _Stream(update, self._workers[a], header)
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
                except _Stopped:
                    break
                with update.cond:
                    update.pending[job_id] = set(job.recipients)
                    update.prepared[job_id] = prepared
                    update.job_bytes[job_id] = job.size_bytes
                cache: dict[DeviceRef, pb.Payload] = {}
                for a in job.recipients:
                    bucket = self._templates.bucket(job.specs, prepared.base_offset_bytes)
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
        return self._results(update, manifests)

    def _results(self, update: _Update, manifests: Mapping[str, ShardManifest]) -> dict[str, PushResult]:
        results: dict[str, PushResult] = {}
        root: dict[str, WeightwireError] = {}
        cancelled: dict[str, WeightwireError] = {}

        def name(a: str) -> str:
            return manifests[a].worker_id or a

        # Every stream of an update has the same deadline, so when one worker hangs, the healthy
        # ones (idle, waiting for the commit that waits for the hung one) expire at the same moment
        # and may be noticed first. Blame the workers that still owed acks, not the ones that waited.
        laggards = [a for a, s in update.streams.items() if s.result is None and len(s.acks) < len(s.sent_jobs)]
        deadline_hit = update.deadline_hit or any(
            s.error is not None and s.error.code == "DEADLINE_EXCEEDED" for s in update.streams.values()
        )
        blame_laggards = deadline_hit and not update.committed and bool(laggards)

        for a, s in update.streams.items():
            wid = manifests[a].worker_id
            err = s.error
            ours = err is not None and s.cancelled_by_us and err.code == "CANCELLED"
            if s.result is not None and err is None:
                results[a] = _result(a, wid, s)
            elif blame_laggards and a in laggards and (ours or err is None or err.code == "DEADLINE_EXCEEDED"):
                owed = len(s.sent_jobs) - len(s.acks)
                root[a] = WeightwireError(
                    "DEADLINE_EXCEEDED",
                    f"worker {name(a)}: did not answer within the deadline ({self.timeout_s:g} s): "
                    f"{owed} bucket(s) not acked (hung, stopped or overloaded); not committed",
                    code="DEADLINE_EXCEEDED",
                    worker=a,
                )
            elif blame_laggards and (ours or err is None or err.code == "DEADLINE_EXCEEDED"):
                cancelled[a] = WeightwireError(
                    "CANCELLED",
                    f"worker {name(a)}: update cancelled at the deadline while waiting for "
                    f"{', '.join(name(w) for w in laggards)}; not committed here (INCONSISTENT if it had loaded tensors)",
                    code="CANCELLED",
                    worker=a,
                )
            elif ours:
                culprit = update.first_failure
                why = f"because {name(culprit)} failed" if culprit else f"at the {self.timeout_s:g} s deadline"
                cancelled[a] = WeightwireError(
                    "CANCELLED",
                    f"worker {name(a)}: update cancelled {why}; not committed here (INCONSISTENT if it had loaded tensors)",
                    code="CANCELLED",
                    worker=a,
                )
            elif err is not None:
                root[a] = _named(err, wid)
            else:
                root[a] = WeightwireError(
                    "DEADLINE_EXCEEDED",
                    f"worker {name(a)}: no result within {self.timeout_s:g} s (not committed)",
                    code="DEADLINE_EXCEEDED",
                    worker=a,
                )
        if root or cancelled:
            if any(e.reason == "MANIFEST_CHANGED" for e in root.values()):
                self._manifests = None
            raise PushError({**root, **cancelled}, results)  # type: ignore[arg-type]
        return results


# --------------------------------------------------------------------------------------------
# Job builders
# --------------------------------------------------------------------------------------------


def _named(err: WeightwireError, worker_id: str) -> WeightwireError:
    """The same error with the worker's readable id in front of its message."""
    if not worker_id:
        return err
    return WeightwireError(
        err.reason, f"worker {worker_id}: {err.message}", code=err.code, worker=err.worker, **err.metadata
    )


def _scope(scope: str) -> int:
    try:
        return _SCOPES[scope]
    except KeyError:
        raise ValueError(f"scope must be 'full' or 'partial', not {scope!r}") from None


def _label_str(p: pb.Payload) -> str:
    return str(DeviceRef(p.device.kind, p.device.uuid)) if p.device.kind else "(no label)"


def _flat_bytes(t: torch.Tensor, where: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise PlanError("INVALID_ARGUMENT", f"{where}: the flat buffer must be contiguous", code="INVALID_ARGUMENT")
    return t.reshape(-1).view(torch.uint8)


def _recipients(
    specs: Sequence[TensorSpec], owners: Mapping[str, Sequence[str]], manifests: Mapping[str, ShardManifest]
) -> tuple[str, ...]:
    wanted = {w for s in specs for w in owners.get(s.name, ())}
    return tuple(a for a in manifests if a in wanted)


def _check_transport_limit(exporter: exp.Exporter, sizes: Iterable[int]) -> None:
    limit = exporter.max_bucket_bytes
    if limit is None:
        return
    biggest = max(sizes, default=0)
    if biggest > limit:
        raise PlanError(
            "INVALID_SIZE",
            f"a bucket of {biggest} bytes does not fit transport {exporter.name} (at most {limit} bytes per "
            "message); use host shared memory or CUDA IPC for tensors this large",
            code="INVALID_ARGUMENT",
        )


def _checksum(value: int) -> pb.Checksum:
    return pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32, value=value)


def _exported(
    exporter: exp.Exporter, buf: exp.StagingBuffer, size: int, verify: bool, release: Callable[[bool], None]
) -> _Prepared:
    buf.ready()
    checksum = _checksum(buf.crc32(size)) if verify else None
    if exporter.label is not None:
        return _Prepared([exporter.export(buf, size, exporter.label)], None, checksum, release)
    return _Prepared([], lambda dev: exporter.export(buf, size, dev), checksum, release)


def _pool_release(pool: _StagingPool, buf: exp.StagingBuffer) -> Callable[[bool], None]:
    def release(ok: bool) -> None:
        if ok:
            pool.release(buf)
        else:
            pool.discard(buf)

    return release


def _packer(
    pool: _StagingPool, exporter: exp.Exporter, plan: planning.BucketPlan, tensors: list[torch.Tensor], verify: bool
) -> Callable[[Callable[[], bool], float], _Prepared]:
    def prepare(stopped: Callable[[], bool], deadline: float) -> _Prepared:
        buf = pool.acquire(plan.size_bytes, stopped, deadline)
        try:
            planning.pack_into(buf.tensor(), plan.specs, tensors)
            return _exported(exporter, buf, plan.size_bytes, verify, _pool_release(pool, buf))
        except BaseException:
            pool.discard(buf)
            raise

    return prepare


def _stage_flat(
    pool: _StagingPool, exporter: exp.Exporter, flat: torch.Tensor, stopped: Callable[[], bool], deadline: float
) -> tuple[exp.StagingBuffer, Callable[[bool], None]]:
    """``flat`` exported in place, or copied once into a pooled staging buffer."""
    wrapped = exporter.wrap(flat)
    if wrapped is not None:
        return wrapped, lambda ok: None
    buf = pool.acquire(flat.numel(), stopped, deadline)
    try:
        buf.tensor()[: flat.numel()].copy_(flat)
    except BaseException:
        pool.discard(buf)
        raise
    return buf, _pool_release(pool, buf)


def _flat_exporter_job(
    pool: _StagingPool, exporter: exp.Exporter, flat: torch.Tensor, specs: list[TensorSpec], verify: bool
) -> Callable[[Callable[[], bool], float], _Prepared]:
    def prepare(stopped: Callable[[], bool], deadline: float) -> _Prepared:
        buf, release = _stage_flat(pool, exporter, flat, stopped, deadline)
        prepared = _exported(exporter, buf, buf.base_offset_bytes + flat.numel(), verify, release)
        prepared.base_offset_bytes = buf.base_offset_bytes
        return prepared

    return prepare


def _gathered_job(
    fixed: list[pb.Payload],
    local: list[tuple[_StagingPool, tuple[exp.Exporter, torch.Tensor]]],
    size: int,
    verify: bool,
) -> Callable[[Callable[[], bool], float], _Prepared]:
    def prepare(stopped: Callable[[], bool], deadline: float) -> _Prepared:
        payloads = list(fixed)
        releases: list[Callable[[bool], None]] = []
        checksum: pb.Checksum | None = None
        try:
            for pool, (exporter, flat) in local:
                buf, release = _stage_flat(pool, exporter, flat[:size], stopped, deadline)
                releases.append(release)
                buf.ready()
                if buf.base_offset_bytes:
                    raise PlanError(
                        "INVALID_OFFSET",
                        "a gathered local buffer must start at the beginning of its shared-memory buffer "
                        "(all payloads of a bucket share one layout)",
                        code="INVALID_ARGUMENT",
                    )
                payloads.append(exporter.export(buf, size, exporter.label))  # type: ignore[arg-type]
                if verify and checksum is None:
                    checksum = _checksum(buf.crc32(size))
        except BaseException:
            for r in releases:
                r(False)
            raise
        if verify and checksum is None:
            inline = next((p.inline_data for p in fixed if p.WhichOneof("handle") == "inline_data"), None)
            if inline is not None:
                checksum = _checksum(exp.crc32_of(torch.frombuffer(bytearray(inline[:size]), dtype=torch.uint8)))

        def release_all(ok: bool) -> None:
            for r in releases:
                r(ok)

        return _Prepared(payloads, None, checksum, release_all)

    return prepare


def _result(address: str, worker_id: str, s: _Stream) -> PushResult:
    r = s.result
    if r is None:
        raise RuntimeError(f"no UpdateResult from {address}")
    transports = [a.transport for a in s.acks if a.handle_opened or a.HasField("source_device")]
    transport = pb.TransportKind.Name(transports[-1]).removeprefix("TRANSPORT_KIND_").lower() if transports else "none"
    return PushResult(
        worker=address,
        worker_id=worker_id,
        version=r.version,
        previous_version=r.previous_version,
        tensors_loaded=r.tensors_loaded,
        bytes_loaded=r.bytes_loaded,
        buckets=len(s.sent_jobs),
        handles_opened=r.handles_opened,
        duration_s=max(s.finished - s.started, 1e-9),
        server_duration_s=r.duration_ns / 1e9,
        transport=transport,
        state=pb.WorkerState.Name(r.state).removeprefix("WORKER_STATE_"),
        peer_device_imports=sum(1 for a in s.acks if a.peer_device_import),
        source_devices=tuple(
            sorted({str(DeviceRef(a.source_device.kind, a.source_device.uuid)) for a in s.acks if a.HasField("source_device")})
        ),
    )


__all__ = [
    "FlatBucket",
    "GatheredBucket",
    "PushProgress",
    "PushResult",
    "WeightPusher",
]
