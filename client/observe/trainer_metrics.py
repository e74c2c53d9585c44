"""Optional Prometheus metrics of a trainer's pushes: durations split into plan, transfer and
commit, per worker, with bytes, failures by reason and the last committed version.

For trainers that already export Prometheus (``prometheus_client.start_http_server`` or their
framework's exporter): hand a ``TrainerMetrics`` to the pusher and every push is recorded::

    from prometheus_client import start_http_server
    from weightwire.client import WeightPusher
    from weightwire.client.observe.trainer_metrics import TrainerMetrics

    start_http_server(9400)                        # the trainer's own /metrics (default registry)
    pusher = WeightPusher(addresses, metrics=TrainerMetrics())

Phases of one push, as the trainer sees them:

- ``plan``: from the call until the update streams open (manifest re-check, ownership, dtype/shape
  and coverage checks, bucket planning);
- ``transfer``: streams open until the last bucket is acked by every worker that got it
  (staging, export, the workers' copies);
- ``commit``: the commit sent until the last worker's result arrived;
- ``total``: the whole call.

Per worker, ``transfer`` ends at that worker's last ack and ``commit`` at its own result. Metric
names and labels: docs/client.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from weightwire.core.errors import reason_label

if TYPE_CHECKING:
    from weightwire.client.rpc.stream import WorkerStream
    from weightwire.core.manifest import ShardManifest

# A push of a small model over shm is a few milliseconds, a large one over a slow path minutes.
PUSH_SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
PHASES = ("plan", "transfer", "commit", "total")


@dataclasses.dataclass(frozen=True)
class WorkerTiming:
    """One worker's part of one push (seconds; None where the push never got that far)."""

    worker: str  # the worker's id from its manifest (e.g. tp0-pp1), else its address
    transfer_s: float | None
    commit_s: float | None
    bytes_loaded: int
    reason: str  # "" when this worker committed


@dataclasses.dataclass(frozen=True)
class PushTiming:
    """One push: its phases and every worker's part."""

    version: int
    committed: bool
    plan_s: float
    transfer_s: float | None
    commit_s: float | None
    total_s: float
    workers: tuple[WorkerTiming, ...]


class TrainerMetrics:
    """Records pushes onto ``registry`` (default: prometheus_client's default registry, the one
    ``start_http_server`` serves). One per registry: a second one on the same registry raises
    ``ValueError`` (duplicated timeseries); pass ``registry=CollectorRegistry()`` for another."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.registry = registry
        self._pushes = Counter(
            "weightwire_trainer_pushes",
            "Pushes that returned, by outcome (committed, failed).",
            ("outcome",),
            registry=registry,
        )
        self._push_seconds = Histogram(
            "weightwire_trainer_push_duration_seconds",
            "Duration of each phase of a push (plan, transfer, commit, total).",
            ("phase",),
            buckets=PUSH_SECONDS_BUCKETS,
            registry=registry,
        )
        self._worker_seconds = Histogram(
            "weightwire_trainer_worker_push_duration_seconds",
            "Per worker: transfer (streams open to its last ack) and commit (commit sent to its result).",
            ("worker", "phase"),
            buckets=PUSH_SECONDS_BUCKETS,
            registry=registry,
        )
        self._failures = Counter(
            "weightwire_trainer_worker_failures",
            "Workers that did not commit a push, by reason.",
            ("worker", "reason"),
            registry=registry,
        )
        self._bytes = Counter(
            "weightwire_trainer_pushed_bytes",
            "Bytes each worker loaded from committed pushes.",
            ("worker",),
            registry=registry,
        )
        self._version = Gauge(
            "weightwire_trainer_weights_version",
            "The last weights version every worker committed.",
            registry=registry,
        )
        for outcome in ("committed", "failed"):
            self._pushes.labels(outcome)
        for phase in PHASES:
            self._push_seconds.labels(phase)

    def record_session(
        self,
        streams: Mapping[str, WorkerStream],
        manifests: Mapping[str, ShardManifest],
        *,
        version: int,
        started_at: float,
    ) -> None:
        """Record the push whose update streams these were (called by the pusher when it ends)."""
        self.record(push_timing(streams, manifests, version=version, started_at=started_at))

    def record(self, push: PushTiming) -> None:
        self._pushes.labels("committed" if push.committed else "failed").inc()
        for phase, value in (
            ("plan", push.plan_s),
            ("transfer", push.transfer_s),
            ("commit", push.commit_s),
            ("total", push.total_s),
        ):
            if value is not None:
                self._push_seconds.labels(phase).observe(value)
        for w in push.workers:
            if w.transfer_s is not None:
                self._worker_seconds.labels(w.worker, "transfer").observe(w.transfer_s)
            if w.commit_s is not None:
                self._worker_seconds.labels(w.worker, "commit").observe(w.commit_s)
            if w.reason:
                self._failures.labels(w.worker, reason_label(w.reason)).inc()
            else:
                self._bytes.labels(w.worker).inc(w.bytes_loaded)
        if push.committed:
            self._version.set(push.version)


def push_timing(
    streams: Mapping[str, WorkerStream],
    manifests: Mapping[str, ShardManifest],
    *,
    version: int,
    started_at: float,
) -> PushTiming:
    """The phases of one push from its streams' clocks (``time.monotonic``): the header sent at
    ``started``, the last ack at ``last_ack_at``, the commit sent at ``commit_sent_at`` and the end at
    ``finished`` (0.0: never happened). A one-worker push sends its commit behind its last bucket,
    before the ack; its transfer then ends at the last ack, and its commit phase runs from there."""
    all_streams = list(streams.values())
    opened = min((s.started for s in all_streams), default=started_at)
    ended = max((s.finished for s in all_streams), default=opened)
    commits = [s.commit_sent_at for s in all_streams if s.commit_sent_at]
    acks = [s.last_ack_at for s in all_streams if s.last_ack_at]
    committed = bool(all_streams) and all(s.result is not None and s.error is None for s in all_streams)
    transfer_end = max(min(commits) if commits else 0.0, max(acks) if acks else 0.0) or None
    workers = []
    for address, s in streams.items():
        manifest = manifests.get(address)
        ok = s.result is not None and s.error is None
        workers.append(
            WorkerTiming(
                worker=(manifest.worker_id if manifest is not None else "") or address,
                transfer_s=s.last_ack_at - s.started if s.last_ack_at else None,
                commit_s=s.finished - max(s.commit_sent_at, s.last_ack_at)
                if ok and s.commit_sent_at
                else None,
                bytes_loaded=s.result.bytes_loaded if ok and s.result is not None else 0,
                reason="" if ok else (s.error.reason if s.error is not None else "RPC_FAILED"),
            )
        )
    return PushTiming(
        version=version,
        committed=committed,
        plan_s=max(0.0, opened - started_at),
        transfer_s=transfer_end - opened if transfer_end is not None else None,
        commit_s=ended - transfer_end if committed and commits and transfer_end is not None else None,
        total_s=max(0.0, ended - started_at),
        workers=tuple(workers),
    )
