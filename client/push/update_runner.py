"""``UpdateRunner``: what every entry point of ``WeightPusher`` shares, below the entry points.

The pusher (``weightwire.client.push.pusher.WeightPusher``) is an ``UpdateRunner``; its entry
points (``push``, ``push_flat``, ``push_gathered``, and ``push(delta=True)`` through
``weightwire.client.update.delta``) and the multi-rank driver's seam
(``weightwire.client.push.ranked_driver``) all end here. It holds the workers (channels, cached
manifests and fingerprints, status, the re-check that refuses a plan made against a restarted
worker) and runs one update: shared setup (manifests, the re-check on its way, the exporter
``transport`` picks), each worker's stream opened while the update is planned, then one
``weightwire.client.update.session.UpdateSession`` under the one-push-at-a-time lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import grpc
import torch
from weightwire.client.inputs import plan as planning
from weightwire.client.inputs.types import PushResult
from weightwire.client.rpc.calls import Worker, call_metadata, close_workers, collect_unary, start_unary
from weightwire.client.rpc.stream import Connections, WorkerStream
from weightwire.client.transports import exporter as exp
from weightwire.client.update import jobs as job_builders
from weightwire.client.update.options import PushOptions
from weightwire.client.update.routing import manifest_changes, route_own_device
from weightwire.client.update.session import (
    CommitGate,
    SpecTemplates,
    UpdateSession,
    layouts_let_go,
    open_streams,
)
from weightwire.client.update.setup import PushSetup, recheck_needed, updating_workers
from weightwire.client.update.staging import Staging
from weightwire.core.errors import PushError, Reason
from weightwire.core.kept_threads import KeptThreads
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    from weightwire.client.observe.trainer_metrics import TrainerMetrics


def _close_all(staging: Staging, workers: list[Worker], readers: KeptThreads) -> None:
    # Not waiting for the readers: closing the channels below ends any call a thread is still blocked in.
    readers.shutdown()
    staging.close()
    close_workers(workers)


class UpdateRunner:
    """The workers of a ``WeightPusher`` and the run of one update on them (see the module's
    docstring); ``WeightPusher`` documents the arguments."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        token: str | None,
        tls_ca: bytes | None,
        timeout_s: float,
        bucket_size_bytes: int | None,
        transport: str,
        align_bytes: int,
        pipeline_depth: int,
        recheck_manifests: bool,
        metrics: TrainerMetrics | None,
        fresh_pool_bytes: int | None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.timeout_s = float(timeout_s)
        self.transport = transport
        self.align_bytes = int(align_bytes)
        self.recheck_manifests = recheck_manifests
        self.metrics = metrics
        self._metadata = call_metadata(token)
        self._workers = {a: Worker(a, tls_ca=tls_ca) for a in self.endpoints}
        self._manifests: dict[str, ShardManifest] | None = None
        self._fingerprints: dict[str, str] = {}
        self._staging = Staging(
            int(bucket_size_bytes) if bucket_size_bytes is not None else planning.DEFAULT_BUCKET_BYTES,
            max(1, int(pipeline_depth)),
            bucket_size_given=bucket_size_bytes is not None,
            fresh_pool_bytes=None if fresh_pool_bytes is None else max(0, int(fresh_pool_bytes)),
        )
        self._templates = SpecTemplates(layout_ids=True)
        self._push_lock = threading.Lock()
        self._closed = False
        # The threads that read the update streams are kept across updates: a thread start per
        # worker per update is a large share of a small update's cost on a busy host. Room for a
        # reader still ending after a cancelled update next to the next update's readers.
        self._readers = KeptThreads(2 * len(self.endpoints) + 2, "ww-push")
        # Segments are unlinked even if the caller forgets close() (also at interpreter exit).
        self._finalizer = weakref.finalize(
            self, _close_all, self._staging, list(self._workers.values()), self._readers
        )

    @property
    def bucket_size_bytes(self) -> int:
        return self._staging.bucket_size_bytes

    @property
    def pipeline_depth(self) -> int:
        return self._staging.pipeline_depth

    # ---------------------------------------------------------------- manifests and status

    def _start_all(self, method: str, request: object) -> dict[str, grpc.Future]:
        return start_unary(self._workers, method, request, timeout_s=self.timeout_s, metadata=self._metadata)

    def manifests(self, *, refresh: bool = False) -> dict[str, ShardManifest]:
        """Every worker's shard manifest (fetched concurrently, then cached), keyed by endpoint."""
        if self._manifests is None or refresh:
            responses = collect_unary("GetManifest", self._start_all("GetManifest", pb.GetManifestRequest()))
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
        return collect_unary("GetStatus", self._start_all("GetStatus", pb.GetStatusRequest()))  # type: ignore[return-value]

    def _recheck(
        self, manifests: Mapping[str, ShardManifest], pending: Mapping[str, grpc.Future] | None
    ) -> Mapping[str, pb.GetStatusResponse]:
        """Refuse the update (nothing sent) when a worker restarted or changed since its manifest was read."""
        statuses: Mapping[str, pb.GetStatusResponse] = (
            collect_unary("GetStatus", pending) if pending is not None else self.status()  # type: ignore[assignment]
        )
        changed = manifest_changes(statuses, manifests, self._fingerprints)
        if changed:
            self._manifests = None
            raise PushError(dict(changed))
        return statuses

    # ---------------------------------------------------------------- shared setup and the update

    def _setup(
        self, manifests: dict[str, ShardManifest] | None = None, exporter: exp.Exporter | None = None
    ) -> PushSetup:
        manifests = self.manifests() if manifests is None else manifests
        # Started now so that it overlaps planning.
        needed = self.recheck_manifests and recheck_needed(manifests, exporter)
        recheck = self._start_all("GetStatus", pb.GetStatusRequest()) if needed else None
        return PushSetup(manifests, recheck, exporter=exporter)

    def _setup_exporting(self, source: torch.device, options: PushOptions) -> tuple[PushSetup, exp.Exporter]:
        """``_setup`` plus the exporter for ``source`` (``transport``, or the one ``auto`` picks for
        these workers), keeping only the workers on its device with ``only_own_device``."""
        manifests = self.manifests()
        name = self.transport
        if name == "auto":
            name = exp.choose_transport([m.device for m in manifests.values()], source)
        exporter = self._staging.exporter(name, source)
        setup = self._setup(manifests, exporter)
        setup.manifests = route_own_device(setup.manifests, exporter, options.only_own_device)
        return setup, exporter

    @contextlib.contextmanager
    def _opened_early(
        self, setup: PushSetup, options: PushOptions, *, one_bucket: bool
    ) -> Iterator[dict[str, WorkerStream] | None]:
        """Each worker's stream opened before the update is planned (``session.open_streams``), and
        cancelled (nothing sent; the workers record nothing) if the push ends before a session took
        them over. Not for a transport that routes each update (a transfer group), whose route may
        still change the workers, and not for
        one bucket to one worker (``one_bucket``: likely one), which goes out as one PushUpdate call
        once it is ready (``UpdateSession.run``): cheaper than any stream."""
        routes = setup.exporter is not None and setup.exporter.routes_each_update
        if self._closed or routes or self._push_lock.locked() or (one_bucket and len(setup.manifests) == 1):
            yield None
            return
        connections = Connections(self._workers, self._metadata, self.timeout_s, self._readers)
        opened = open_streams(setup.manifests, options, connections, self._fingerprints)
        try:
            yield opened
        finally:
            for stream in opened.values():
                if not stream.adopted:
                    stream.cancel()

    def _plan_and_run(
        self,
        setup: PushSetup,
        options: PushOptions,
        plan: Callable[[], job_builders.Jobs],
        *,
        one_bucket: bool,
        sources: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, PushResult]:
        """The update's jobs made by ``plan`` while each worker's stream opens (``_opened_early``),
        then run (``_run``): how every entry point of one trainer rank ends."""
        with self._opened_early(setup, options, one_bucket=one_bucket) as opened:
            try:
                return self._run(setup, plan(), options, opened=opened, sources=sources)
            except PushError as e:
                if not layouts_let_go(e):
                    raise
        # A worker no longer held tensor specs this pusher named by layout id (it kept newer ones
        # in their place): the session forgot every id of that worker, so the same update goes
        # again with its specs, at once (nothing committed anywhere; the workers were just checked).
        return self._run(dataclasses.replace(setup, recheck=None), plan(), options, sources=sources)

    def _run(
        self,
        setup: PushSetup,
        jobs: job_builders.Jobs,
        options: PushOptions,
        commit_gate: CommitGate | None = None,
        opened: Mapping[str, WorkerStream] | None = None,
        sources: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, PushResult]:
        if self._closed:
            raise RuntimeError("this WeightPusher is closed")
        if not self._push_lock.acquire(blocking=False):
            raise RuntimeError("a push is already running on this WeightPusher; one update at a time")
        if self.metrics is not None:
            options = dataclasses.replace(options, metrics=self.metrics)
        try:
            statuses = None
            if setup.recheck is not None and not setup.rechecked:
                if recheck_needed(setup.manifests, setup.exporter):
                    statuses = self._recheck(setup.manifests, setup.recheck)
                else:  # routing left one worker (only_own_device): its header check is enough
                    for call in setup.recheck.values():
                        call.cancel()
            exporter = setup.exporter
            if exporter is not None:
                routed = exporter.route_update(
                    jobs.jobs, setup.manifests, statuses, sources, verify_checksums=options.verify_checksums
                )
                jobs = job_builders.Jobs(routed, jobs.pools)
            connections = Connections(self._workers, self._metadata, self.timeout_s, self._readers)
            session = UpdateSession(
                jobs.jobs,
                setup.manifests,
                options,
                connections,
                self._fingerprints,
                self._templates,
                jobs.pools,
                commit_gate,
                updating_before=updating_workers(statuses),
                opened=opened,
                whole_update=setup.exporter is None or not setup.exporter.routes_each_update,
            )
            # Staging buffers hand workers an event to wait for instead of waiting for their own
            # writes, when every recipient says it waits for it. Not in a push of several ranks
            # (commit_gate): a rank's payloads also go to the sending rank's workers.
            waits = commit_gate is None and all(m.waits_for_cuda_ipc_events for m in setup.manifests.values())
            with exp.consumers_wait_for_events(waits):
                return session.run()
        except PushError as e:
            if any(err.kind is Reason.MANIFEST_CHANGED for err in e.failures.values()):
                self._manifests = None
            if setup.exporter is not None and setup.exporter.update_failed(e.failures):
                self._manifests = None
            raise
        finally:
            self._push_lock.release()
