"""Prometheus metrics of a worker: weights version, state, updates by outcome and reason, update
and per-bucket durations, bytes and tensors loaded, handles opened, open mappings.

``WorkerMetrics`` observes one ``WorkerService`` (``weightwire.server.observe.update_events``) and records
onto a ``prometheus_client.CollectorRegistry``. Where the numbers are served:

- a standalone worker: ``weightwire serve --metrics-port PORT`` serves its own registry at
  ``http://127.0.0.1:PORT/metrics`` (``serve_metrics``); off by default;
- inside an engine: ``engine_metrics(service, engine=...)``, called by the SGLang plugin and
  meant for the vLLM adapter. SGLang (``--enable-metrics``) and vLLM (several API servers, or
  ``PROMETHEUS_MULTIPROC_DIR`` set by the user) run prometheus_client in multiprocess mode: every
  process writes its values to files under ``PROMETHEUS_MULTIPROC_DIR`` and the engine's own
  ``/metrics`` merges them, so the worker only records (no second HTTP server). Gauges use
  ``multiprocess_mode="mostrecent"``, as the engines' own gauges do; every series carries a
  ``worker`` label, so processes never merge into one series. Outside multiprocess mode an
  engine's worker processes have no ``/metrics`` of their own: then metrics are off unless
  ``WEIGHTWIRE_METRICS_PORT`` asks for a port per worker.

Metric names, labels and a sample scrape: docs/server.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from weightwire.core.errors import reason_label
from weightwire.core.transports import table as transports
from weightwire.server.observe.update_events import UpdateObserver, UpdateOutcome, state_name
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    from weightwire.core.manifest import ShardManifest


class ObservedWorker(Protocol):
    """What the metrics read of a worker (``WorkerService``, which sits above this folder)."""

    @property
    def manifest(self) -> ShardManifest: ...

    @property
    def weights_version(self) -> int: ...

    @property
    def state(self) -> pb.WorkerState: ...

    def open_mappings(self) -> int: ...

    def add_observer(self, observer: UpdateObserver) -> None: ...


log = logging.getLogger(__name__)

ENV_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
ENV_METRICS = "WEIGHTWIRE_METRICS"
ENV_METRICS_PORT = "WEIGHTWIRE_METRICS_PORT"
ENV_METRICS_HOST = "WEIGHTWIRE_METRICS_HOST"

STATES = ("CONSISTENT", "UPDATING", "INCONSISTENT")
# 1, 2.5 and 5 seconds times each power of ten, from a millisecond to ten seconds.
_MS_TO_10S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Whole updates: a few milliseconds (a small partial update) to minutes (a large model over a slow path).
UPDATE_SECONDS_BUCKETS = (*_MS_TO_10S, 30.0, 60.0, 120.0, 300.0)
# One bucket's open or load: from a cached handle (microseconds) to a large copy (seconds).
BUCKET_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, *_MS_TO_10S)


def transport_label(kind: pb.TransportKind.ValueType) -> str:
    """The ``transport`` label of a bucket: its row's name in the one transport table
    (``weightwire.core.transports.table``), so every transport there has its own series; a kind the
    table does not know (none the worker's own importers report) is ``unspecified``."""
    row = transports.by_kind(kind)
    return row.name if row is not None else "unspecified"


class WorkerMetrics:
    """The metrics of one worker, recorded as its updates happen.

    ``registry``: where the metrics are registered; None registers them nowhere (multiprocess mode,
    where the values go to files the engine's ``/metrics`` reads). ``worker_id`` becomes the
    ``worker`` label of every series. Call ``attach(service)`` to start observing.
    """

    def __init__(self, worker_id: str, *, registry: CollectorRegistry | None) -> None:
        self.worker_id = worker_id
        self.registry = registry
        w = ("worker",)

        def gauge(name: str, doc: str) -> Gauge:
            # A worker's own value: in multiprocess mode the one its process wrote last.
            return Gauge(name, doc, w, multiprocess_mode="mostrecent", registry=registry).labels(worker_id)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, (*w, *labels), registry=registry)

        def histogram(name: str, doc: str, label: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, (*w, label), buckets=buckets, registry=registry)

        self._version = gauge(
            "weightwire_weights_version", "Weights version the worker's model holds (0: as loaded at start)."
        )
        state = Gauge(
            "weightwire_worker_state",
            "1 for the worker's current state (CONSISTENT, UPDATING, INCONSISTENT), 0 for the others.",
            (*w, "state"),
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self._state = {name: state.labels(worker_id, name) for name in STATES}
        self._open_mappings = gauge(
            "weightwire_open_mappings",
            "Payload mappings the worker holds open (shm segments of an update in progress, cached CUDA IPC handles).",
        )
        self._last_commit = gauge(
            "weightwire_last_commit_timestamp_seconds", "Unix time of the worker's last committed update."
        )
        self._updates = counter(
            "weightwire_updates",
            'Updates that ended, by outcome (committed, refused, failed, cancelled) and reason ("" when committed).',
            "outcome",
            "reason",
        )
        self._update_seconds = histogram(
            "weightwire_update_duration_seconds",
            "Duration of updates that began (header accepted), header to commit or failure, by outcome.",
            "outcome",
            UPDATE_SECONDS_BUCKETS,
        )
        self._open_seconds = histogram(
            "weightwire_bucket_open_duration_seconds",
            "Time to open (or find cached) the payload of each loaded bucket, by transport.",
            "transport",
            BUCKET_SECONDS_BUCKETS,
        )
        self._load_seconds = histogram(
            "weightwire_bucket_load_duration_seconds",
            "Time to copy each loaded bucket into the model (device synchronised), by transport.",
            "transport",
            BUCKET_SECONDS_BUCKETS,
        )
        self._buckets = counter(
            "weightwire_buckets",
            'Buckets acked, by transport ("none": nothing in it was this worker\'s).',
            "transport",
        )
        self._bytes = counter(
            "weightwire_loaded_bytes",
            "Bytes copied into the model (every acked bucket, also of updates that failed later).",
        ).labels(worker_id)
        self._tensors = counter("weightwire_loaded_tensors", "Tensors copied into the model.").labels(
            worker_id
        )
        self._handles = counter(
            "weightwire_handles_opened",
            "Payload handles opened (not found in a cache), by transport.",
            "transport",
        )
        self._peer = counter(
            "weightwire_peer_device_imports",
            "Buckets imported from another GPU of the host (allow_peer_device_import).",
        ).labels(worker_id)
        # Series a dashboard expects from the first scrape on, at zero.
        self._updates.labels(worker_id, "committed", "")
        self._update_seconds.labels(worker_id, "committed")
        self._open_mappings_of: Callable[[], int] = lambda: 0
        # The per-transport series of each bucket, looked up once (labels() costs a few microseconds).
        self._by_transport: dict[str, tuple[Counter, Histogram, Histogram, Counter]] = {}
        self._by_outcome: dict[tuple[str, str], tuple[Counter, Histogram]] = {}

    def attach(self, service: ObservedWorker) -> WorkerMetrics:
        """Observe ``service`` from now on; records its current version and state."""
        self._open_mappings_of = service.open_mappings
        self._version.set(service.weights_version)
        self._set_state(state_name(service.state))
        self._open_mappings.set(self._open_mappings_of())
        service.add_observer(self)
        return self

    def _set_state(self, current: str) -> None:
        for name, child in self._state.items():
            child.set(1 if name == current else 0)

    # --- UpdateObserver --------------------------------------------------------------------------

    def update_started(self, version: int) -> None:
        self._set_state("UPDATING")

    def bucket_acked(self, ack: pb.BucketAck) -> None:
        if not ack.HasField("source_device"):
            self._buckets.labels(self.worker_id, "none").inc()
            return
        transport = transport_label(ack.transport)
        series = self._by_transport.get(transport)
        if series is None:
            series = self._by_transport[transport] = (
                self._buckets.labels(self.worker_id, transport),
                self._open_seconds.labels(self.worker_id, transport),
                self._load_seconds.labels(self.worker_id, transport),
                self._handles.labels(self.worker_id, transport),
            )
        buckets, open_seconds, load_seconds, handles = series
        buckets.inc()
        open_seconds.observe(ack.open_duration_ns / 1e9)
        load_seconds.observe(ack.load_duration_ns / 1e9)
        self._bytes.inc(ack.bytes_loaded)
        self._tensors.inc(ack.tensors_loaded)
        if ack.handle_opened:
            handles.inc()
        if ack.peer_device_import:
            self._peer.inc()
        self._open_mappings.set(self._open_mappings_of())

    def update_finished(self, outcome: UpdateOutcome) -> None:
        key = (outcome.outcome, reason_label(outcome.reason))
        series = self._by_outcome.get(key)
        if series is None:  # a bounded set: outcomes x reasons
            series = self._by_outcome[key] = (
                self._updates.labels(self.worker_id, *key),
                self._update_seconds.labels(self.worker_id, outcome.outcome),
            )
        series[0].inc()
        if outcome.duration_s is not None:
            series[1].observe(outcome.duration_s)
        if outcome.outcome == "committed":
            self._last_commit.set_to_current_time()
        self._version.set(outcome.weights_version)
        self._set_state(outcome.state)
        self._open_mappings.set(self._open_mappings_of())


# --------------------------------------------------------------------------------------------------
# Where the metrics are served
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint (``prometheus_client``'s HTTP server on its own thread)."""

    host: str
    port: int
    _httpd: WSGIServer

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` at ``http://HOST:PORT/metrics`` (port 0 picks one; ``.port`` has it)."""
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host, int(httpd.server_port), httpd)


@dataclasses.dataclass
class EngineMetrics:
    """What ``engine_metrics`` set up for one worker inside an engine."""

    metrics: WorkerMetrics
    where: str  # "multiprocess" (the engine's /metrics), or the URL of a port asked for
    server: MetricsServer | None = None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def engine_metrics(
    service: ObservedWorker,
    *,
    engine: str,
    port_offset: int = 0,
    env: Mapping[str, str] | None = None,
) -> EngineMetrics | None:
    """Record a worker's metrics inside an engine process (called once per worker at start-up).

    - ``WEIGHTWIRE_METRICS=0``: off.
    - ``PROMETHEUS_MULTIPROC_DIR`` set (SGLang with ``--enable-metrics``; vLLM with several API
      servers or the variable set by the user): record into it; the engine's ``/metrics`` serves
      the values next to its own.
    - ``WEIGHTWIRE_METRICS_PORT=P`` (explicitly asked for): also serve this worker's metrics at
      ``http://WEIGHTWIRE_METRICS_HOST:(P + port_offset)/metrics`` (host default ``127.0.0.1``;
      ``port_offset`` is the worker's index among the engine's workers; ``0``: a free port each, logged).
    - neither: off, with a log line saying how to turn them on.

    ``service`` is the ``WorkerService`` (``RunningServer.service``). Returns None when off.
    """
    env = os.environ if env is None else env
    if env.get(ENV_METRICS, "1").strip() == "0":
        return None
    multiproc = bool(env.get(ENV_MULTIPROC_DIR))
    raw_port = env.get(ENV_METRICS_PORT, "").strip()
    worker_id = service.manifest.worker_id
    if not multiproc and not raw_port:
        log.info(
            "weightwire: %s has no %s (its /metrics is not in multiprocess mode), so worker %s records no "
            "metrics; start the engine with metrics on (SGLang: --enable-metrics) or set %s=PORT",
            engine,
            ENV_MULTIPROC_DIR,
            worker_id,
            ENV_METRICS_PORT,
        )
        return None
    port: int | None = None
    if raw_port:
        try:
            base = int(raw_port)
        except ValueError as e:
            raise ValueError(f"{ENV_METRICS_PORT}={raw_port!r} is not a port number") from e
        # 0: every worker picks a free port (logged below).
        port = base + port_offset if base else 0
        if not 0 <= port < 65536 or base < 0:
            raise ValueError(
                f"{ENV_METRICS_PORT}={raw_port!r} + worker index {port_offset} is not a port number"
            )
    # In multiprocess mode the values live in files whatever the registry; a registry is only
    # needed for a port of our own.
    registry = CollectorRegistry() if port is not None else None
    metrics = WorkerMetrics(worker_id, registry=registry).attach(service)
    server = None
    where = "multiprocess"
    if port is not None and registry is not None:
        server = serve_metrics(registry, port, env.get(ENV_METRICS_HOST, "127.0.0.1"))
        where = server.url
    log.info(
        "weightwire: worker %s metrics: %s",
        worker_id,
        f"{engine}'s /metrics" if where == "multiprocess" else where,
    )
    return EngineMetrics(metrics, where, server)
