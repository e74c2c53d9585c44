"""One update on its way across every worker: the acks, the commit after every ack, cancellation at
the first failure, and the deadline.

``UpdateSession.run`` drives it for ``weightwire.client.push.pusher``: it opens one ``WorkerStream`` per
worker, stages each job and hands its bucket to the streams of its recipients, lets a staging buffer
go only once all of them acked it, commits every stream once every bucket is acked, and cancels
everything still open when one worker fails or the deadline passes. ``weightwire.client.update.blame`` then
turns the streams into results or one ``PushError``. The session is the only writer of its state;
the streams call back into it from their reader threads (``on_ack``, ``on_stream_end``).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from weightwire.client.inputs.plan import TensorSpec
from weightwire.client.inputs.types import PushProgress, PushResult
from weightwire.client.rpc.stream import Connections, WorkerStream, settle_cancelled
from weightwire.client.transports.route import Job, Route
from weightwire.client.update.blame import collect_results
from weightwire.client.update.options import PushOptions
from weightwire.client.update.payload_refs import StorageSetRefs, WorkerKey
from weightwire.client.update.staging import StagingPool, Stopped
from weightwire.core.errors import PushError, Reason
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

# Local waits get this much longer than the RPC deadline, so gRPC's own DEADLINE_EXCEEDED (which
# names the worker) normally fires first.
_GRACE_S = 2.0
# How often a failed push asks a cancelled worker whether it has ended the update.


# Asked on the pushing thread once every bucket was sent and acked (argument None), or with what went
# wrong here (a worker failed, the jobs stopped early, acks missing at the deadline): None lets the
# session commit, a message aborts it with that reason. A multi-rank push
# (``weightwire.client.ranks.collective_push``) agrees with the other trainer ranks here.
class GateProblem(enum.Enum):
    """What keeps a session from committing, as its commit gate is told."""

    WORKER_FAILED = "worker_failed"
    STOPPED_EARLY = "stopped_early"  # the jobs ended before the last bucket (another rank stopped them)
    ACKS_MISSING = "acks_missing"  # buckets not acked before the deadline


@dataclasses.dataclass(frozen=True)
class SessionProblem:
    kind: GateProblem
    message: str


CommitGate = Callable[[SessionProblem | None], str | None]


class SpecTemplates:
    """The ``tensors`` part of a Bucket message per (job specs, base offset), built once, and the
    workers that kept it under its ``layout_id``.

    A trainer pushing the same ``FlatBucket`` every update hands over the same ``TensorSpec``
    objects each time (frozen dataclasses: immutable). Entries hold those objects, so while an entry
    lives no other object can have their ids; equal ids in a key therefore mean the same specs.

    With ``layout_ids`` (a pusher's templates, kept across updates) each entry has a random
    ``layout_id``, sent with its specs. A worker that accepted them says so in its ack
    (``layout_kept``, ``kept``); from then on its buckets of the same specs name the id instead of
    carrying them (399 specs for an 8B model), which neither side then builds, serializes or
    parses. Only what a worker acked is referred to, under its address, fingerprint and instance,
    and all of a worker's ids go at any failure of it (``forget``): a worker that let them go
    refuses with LAYOUT_UNKNOWN, and the pusher sends the same update again with its specs
    (``layouts_let_go``). ``storage_sets`` does the same for the CUDA IPC payloads of a trainer's
    storages (``payload_refs``), under the same rules.
    """

    _MAX_ENTRIES = 256

    def __init__(self, *, layout_ids: bool = False) -> None:
        # Whether buckets carry layout ids: only for templates kept across updates (a pusher's),
        # else each update would only fill the workers' bounded room for kept specs.
        self._layout_ids = layout_ids
        self._entries: dict[tuple[int, ...], tuple[list[TensorSpec], pb.Bucket, bytes]] = {}
        self._kept: dict[WorkerKey, set[bytes]] = {}
        self.storage_sets = StorageSetRefs(enabled=layout_ids)

    def request(
        self,
        specs: list[TensorSpec],
        base_offset_bytes: int,
        into: pb.PushWeightsRequest,
        worker: WorkerKey | None = None,
    ) -> pb.PushWeightsRequest:
        """``into`` (an empty request), its bucket's ``tensors`` now ``specs`` shifted by
        ``base_offset_bytes`` (built in place: wrapping a finished Bucket in a request would copy
        every spec again), or only their ``layout_id`` where ``worker`` kept them. ``worker`` None:
        no layout id at all (a delta update, whose specs change every update)."""
        key = (base_offset_bytes, *map(id, specs))
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self._MAX_ENTRIES:
                self._entries.clear()
                self._kept.clear()  # their ids are gone with them
            bucket = pb.Bucket(tensors=[s.to_proto(base_offset_bytes) for s in specs])
            entry = (list(specs), bucket, os.urandom(16) if specs and self._layout_ids else b"")
            self._entries[key] = entry
        layout_id = entry[2]
        if worker is None or not layout_id:
            into.bucket.CopyFrom(entry[1])
        elif layout_id in self._kept.get(worker, ()):
            into.bucket.layout_id = layout_id
        else:
            into.bucket.CopyFrom(entry[1])
            into.bucket.layout_id = layout_id
        return into

    def kept(self, worker: WorkerKey, layout_id: bytes) -> None:
        """``worker`` acked that it keeps the specs of ``layout_id``."""
        if layout_id:
            self._kept.setdefault(worker, set()).add(layout_id)

    def forget(self, address: str) -> None:
        """Refer to nothing the worker at ``address`` kept (it failed an update: it may have
        restarted, or let the specs go)."""
        for worker in [w for w in self._kept if w[0] == address]:
            del self._kept[worker]
        self.storage_sets.forget(address)


# What a worker answers when it no longer keeps what a bucket named (tensor specs by layout id, a
# CUDA IPC storage set by its id).
_LET_GO = frozenset({Reason.LAYOUT_UNKNOWN, Reason.STORAGE_SET_UNKNOWN})


def layouts_let_go(error: PushError) -> bool:
    """Whether ``error`` is only workers refusing tensor specs or storage sets named by id
    (LAYOUT_UNKNOWN, STORAGE_SET_UNKNOWN), the others cancelled because of them, and none
    committed: the update may go again at once, whole (the session forgot the refusing workers'
    ids)."""
    kinds = {e.kind for e in error.failures.values()}
    return not error.results and bool(kinds & _LET_GO) and kinds <= _LET_GO | {Reason.CANCELLED}


def open_streams(
    manifests: Mapping[str, ShardManifest],
    options: PushOptions,
    connections: Connections,
    fingerprints: Mapping[str, str],
) -> dict[str, WorkerStream]:
    """Open one stream per worker now, sending nothing yet, for an ``UpdateSession`` to take over
    once the update is planned: gRPC's call set-up (a thread per call on this side, the call's
    handler on the worker's) then overlaps the planning and staging instead of following them. If
    the update is refused before its session runs, ``cancel`` each: a worker that got no header
    records nothing."""
    streams = {
        a: WorkerStream(None, connections, a, options.header(fingerprints.get(a, ""))) for a in manifests
    }
    try:
        for s in streams.values():
            s.start()
    except BaseException:
        for s in streams.values():
            s.cancel()
        raise
    return streams


class UpdateSession:
    """One update: its jobs, one stream per worker in ``manifests``, and the state they share."""

    def __init__(
        self,
        jobs: Sequence[Job],
        manifests: Mapping[str, ShardManifest],
        options: PushOptions,
        connections: Connections,
        fingerprints: Mapping[str, str],
        templates: SpecTemplates,
        pools: Sequence[StagingPool],
        commit_gate: CommitGate | None = None,
        updating_before: Collection[str] = (),
        opened: Mapping[str, WorkerStream] | None = None,
        whole_update: bool = True,
    ) -> None:
        self._jobs = list(jobs)
        # Workers already running another update when this one was planned: a cancelled stream to
        # one of them is not waited for (that update is someone else's).
        self._updating_before = frozenset(updating_before)
        self._commit_gate = commit_gate
        self._manifests = manifests
        self._options = options
        self._timeout_s = connections.timeout_s
        self._metadata = connections.metadata
        self._templates = templates
        self._pools = list(pools)
        self._cond = threading.Condition()
        # Everything below is written under ``_cond`` by this session only (streams call its methods).
        self.failed = False
        self.first_failure: str | None = None
        self.committed = False
        self.deadline_hit = False
        self.aborted_because: str | None = None
        self._pending: dict[int, set[str]] = {}
        self._routes: dict[int, Route] = {}
        # Set once every job was handed to its streams: from then on the last ack sends the commit
        # itself, without waking the pushing thread first.
        self._all_sent = False
        # One worker and no commit gate: nothing to keep atomic across workers (see _commit_behind_the_buckets).
        self._solo = len(manifests) == 1 and commit_gate is None
        # May an update of one worker and one bucket go out as one PushUpdate call (not when the
        # bucket's bytes follow its message on another channel: a transfer group)?
        self._whole_update = whole_update
        self._buckets_total = len(self._jobs)
        self._bytes_total = sum(j.size_bytes for j in self._jobs)
        self._buckets_done = 0
        self._bytes_done = 0
        # Who may keep this update's specs under a layout id (not in a delta update: its specs
        # change every update), and each job's id (the same for every recipient).
        self._worker_keys: dict[str, WorkerKey] = (
            {a: (a, fingerprints.get(a, ""), m.instance_id) for a, m in manifests.items()}
            if options.delta_base is None
            else {}
        )
        self._layout_ids: dict[int, bytes] = {}
        # Who may be sent storage sets by name (``StorageSetRefs``).
        self._set_keys: dict[str, WorkerKey] = {
            a: (a, fingerprints.get(a, ""), m.instance_id) for a, m in manifests.items()
        }
        # Streams opened while the update was planned (``open_streams``) are taken over as they are.
        self.streams: dict[str, WorkerStream] = {}
        for a in manifests:
            stream = (opened or {}).get(a)
            if stream is None:
                stream = WorkerStream(self, connections, a, options.header(fingerprints.get(a, "")))
            stream.adopt(self)
            self.streams[a] = stream

    # ---------------------------------------------------------------- the pushing thread

    def run(self) -> dict[str, PushResult]:
        """Stream every job, commit after the last ack, and return one result per worker (or raise
        one ``PushError``). Everything this session staged is released before it returns."""
        deadline = time.monotonic() + self._timeout_s + _GRACE_S
        # One worker, at most one bucket: nothing needs the pushing thread while the responses
        # come in, so it reads them itself (the commit goes out from the last ack).
        # With a commit gate the commit waits for the gate, so no ack may send it.
        gated = self._commit_gate is not None
        here = len(self.streams) == 1 and len(self._jobs) <= 1 and not gated
        # Not opened while planning: then every message is queued before the call goes out, the
        # commit behind the bucket, so the whole update can be one call (``WorkerStream.use_whole_update``).
        whole = here and self._whole_update and not any(s.opened for s in self.streams.values())
        completed = False
        try:
            for s in self.streams.values():
                if whole:
                    s.use_whole_update()
                if not s.opened:
                    s.start()
                s.send_header()
                if not here:
                    s.ensure_reader()
            sent_all = self._send_jobs(deadline)
            with self._cond:
                if not self.failed and not gated:
                    self._all_sent = True
                    if self._solo and sent_all:
                        self._commit_behind_the_buckets()
                    else:
                        self._commit_if_complete()
            if here:
                for s in self.streams.values():
                    if whole and not self.committed:
                        s.cancel()  # it stopped before its commit: nothing goes out
                    else:
                        s.read_here()
            self._wait_for_acks(deadline)
            if gated:
                self._pass_gate(sent_all)
            for s in self.streams.values():
                s.done.wait(max(0.0, deadline - time.monotonic()))
            completed = True
        finally:
            if not completed or self.failed or any(not s.done.is_set() for s in self.streams.values()):
                self._cancel_all()
                if completed:  # not while an exception (say Ctrl-C) is on its way out
                    self._await_cancelled_updates(deadline)
            self._discard_unacked()
            self._forget_failed_layouts()
        try:
            return collect_results(
                self.streams,
                self._manifests,
                timeout_s=self._timeout_s,
                committed=self.committed,
                deadline_hit=self.deadline_hit,
                first_failure=self.first_failure,
                cancelled_because=self.aborted_because,
            )
        finally:
            if self._options.metrics is not None:
                self._options.metrics.record_session(
                    self.streams,
                    self._manifests,
                    version=self._options.version,
                    started_at=self._options.started_at,
                )
            self._forget_jobs()

    def _forget_failed_layouts(self) -> None:
        """A worker that failed this update may have restarted or let its kept specs go: the next
        push sends it every bucket's specs again."""
        for s in self.streams.values():
            if s.error is not None:
                self._templates.forget(s.address)

    def _forget_jobs(self) -> None:
        """Let go of the jobs, and with them the caller's tensors, once the update is over. The
        streams and this session refer to each other, so without this the tensors of every push
        would live until the garbage collector's next cycle pass: on a GPU, a model's worth of
        memory per push for a trainer that pushes fresh tensors (a cast, a gather)."""
        with self._cond:
            self._jobs = []
            self._pending.clear()  # an ack arriving after the end has nothing to find

    def _send_jobs(self, deadline: float) -> bool:
        """Stage and send every job in order; False when it stopped before the last one."""
        for job_id, job in enumerate(self._jobs):
            if self.failed:
                return False
            try:
                route = job.prepare(self.stopped, deadline)
            except Stopped:
                return False
            with self._cond:
                self._pending[job_id] = set(job.recipients)
                self._routes[job_id] = route
            shares = route.payloads({a: self._manifests[a].device for a in job.recipients})
            for a in job.recipients:
                request = self._templates.request(
                    job.specs,
                    route.base_offset_bytes,
                    self.streams[a].new_request(),
                    self._worker_keys.get(a),
                )
                if request.bucket.layout_id:
                    self._layout_ids[job_id] = request.bucket.layout_id
                request.bucket.payloads.extend(
                    self._templates.storage_sets.payloads(self._set_keys.get(a), shares[a])
                )
                if route.checksum is not None:
                    request.bucket.checksum.CopyFrom(route.checksum)
                self.streams[a].send_bucket(job_id, request)
            route.queued()
        return True

    def _pass_gate(self, sent_all: bool) -> None:
        """Ask the commit gate; commit every stream if it agrees, otherwise fail the update with its reason."""
        with self._cond:
            problem = self._problem(sent_all)
        assert self._commit_gate is not None
        reason = self._commit_gate(problem)
        with self._cond:
            if reason is None and problem is None and not self.failed:
                self.committed = True
                for s in self.streams.values():
                    s.commit()
                return
            if not self.failed:
                self.failed = True
                self.aborted_because = reason or "the commit gate refused"
        for s in self.streams.values():
            s.cancel()  # nothing is committed: end every stream now instead of at its deadline

    def _problem(self, sent_all: bool) -> SessionProblem | None:
        """What keeps this session from committing, for the commit gate (the caller holds ``_cond``)."""
        if self.failed:
            stream = self.streams.get(self.first_failure or "")
            if stream is not None and stream.error is not None:
                who = self._manifests[stream.address].worker_id or stream.address
                text = f"worker {who} failed: {stream.error.reason}: {stream.error.message}"[:1000]
                return SessionProblem(GateProblem.WORKER_FAILED, text)
            return SessionProblem(GateProblem.WORKER_FAILED, "the update failed")
        if not sent_all:
            return SessionProblem(GateProblem.STOPPED_EARLY, "it stopped before its last bucket")
        if self._pending:
            return SessionProblem(
                GateProblem.ACKS_MISSING, f"{len(self._pending)} bucket(s) were not acked before the deadline"
            )
        return None

    def _wait_for_acks(self, deadline: float) -> None:
        with self._cond:
            while self._pending and not self.failed:
                if (
                    not self._cond.wait(max(0.0, min(deadline - time.monotonic(), 1.0)))
                    and time.monotonic() >= deadline
                ):
                    break
            if not self.failed and not self._pending:
                self._commit_if_complete()
            elif self._pending and not self.failed:
                self.deadline_hit = True

    def _cancel_all(self) -> None:
        for s in self.streams.values():
            s.cancel()
            s.ensure_reader()  # a stream meant to be read here that never was: its end sets ``done``
        for s in self.streams.values():
            # A cancelled call ends at once; bounded anyway so a broken channel cannot hang us.
            s.done.wait(_GRACE_S)

    def _await_cancelled_updates(self, deadline: float) -> None:
        """``settle_cancelled`` for this session's streams; a worker that was busy with another
        update before this one started is not waited for."""
        settle_cancelled(self.streams.values(), self._metadata, deadline, skip=self._updating_before)

    def _discard_unacked(self) -> None:
        with self._cond:
            leftover = list(self._routes.values())
            self._routes.clear()
        for route in leftover:
            # A cancelled worker may still be reading these: never reuse them.
            route.release(False)

    # ---------------------------------------------------------------- called by the streams

    def stopped(self) -> bool:
        return self.failed

    def on_ack(self, stream: WorkerStream, ack: pb.BucketAck) -> None:
        if not 0 <= ack.index < len(stream.sent_jobs):
            return  # the worker validates its own stream; an unknown index is its bug, not ours to crash on
        job_id = stream.sent_jobs[ack.index]
        report: PushProgress | None = None
        with self._cond:
            if ack.layout_kept and stream.address in self._worker_keys:
                self._templates.kept(self._worker_keys[stream.address], self._layout_ids.get(job_id, b""))
            if ack.storage_set_kept and stream.address in self._set_keys:
                self._templates.storage_sets.kept(self._set_keys[stream.address], ack.storage_set_kept)
            waiting = self._pending.get(job_id)
            if waiting is None:
                return
            waiting.discard(stream.address)
            if not waiting:
                del self._pending[job_id]
                route = self._routes.pop(job_id, None)
                if route is not None:
                    route.release(True)
                self._buckets_done += 1
                self._bytes_done += self._jobs[job_id].size_bytes
                report = PushProgress(
                    self._buckets_done, self._buckets_total, self._bytes_done, self._bytes_total
                )
                self._commit_if_complete()
                self._cond.notify_all()
        if report is not None and self._options.progress is not None:
            self._options.progress(report)

    def _commit_behind_the_buckets(self) -> None:
        """One worker, no commit gate: the commit follows its last bucket at once (the caller holds
        ``_cond``). The worker handles its stream in order, so it commits only after it copied and
        acked every bucket, and not at all when one fails; waiting for the acks here first would
        add a round trip and change nothing. With several workers the commit waits for every ack
        (``_commit_if_complete``), so that no worker commits while another can still fail."""
        if not self.failed and not self.committed:
            self.committed = True
            for s in self.streams.values():
                s.commit()

    def _commit_if_complete(self) -> None:
        """Commit every stream once every job is sent and acked by all its recipients and nothing
        failed (the caller holds ``_cond``); sent by whichever thread saw the last ack."""
        if self._all_sent and not self._pending and not self.failed and not self.committed:
            self.committed = True
            for s in self.streams.values():
                s.commit()

    def on_stream_end(self, stream: WorkerStream) -> None:
        if stream.error is None:
            with self._cond:
                self._cond.notify_all()
            return
        with self._cond:
            first = not self.failed
            self.failed = True
            if first:
                self.first_failure = stream.address
            self._cond.notify_all()
        for pool in self._pools:
            pool.wake()
        if first:
            for other in self.streams.values():
                if other is not stream:
                    other.cancel()
