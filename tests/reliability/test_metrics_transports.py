"""Every transport's buckets are counted under its own ``transport`` label: the labels come from the
one transport table (``weightwire.core.transports.table``), not from a list of its own that a new
transport can be missing from (transfer-group buckets were counted as "unspecified").

The acks are the ones a worker sends: their ``transport`` is the one each of the worker's real
importers reports (``make_importers``), recorded by a real ``WorkerMetrics`` into its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from weightwire.core.devices import DeviceRef
from weightwire.core.transports import table as transports
from weightwire.server.observe.metrics import WorkerMetrics
from weightwire.server.transports.importer import make_importers
from weightwire.v1 import weight_transfer_pb2 as pb

WORKER = "tp0-pp0"
SERIES = (
    "weightwire_buckets_total",
    "weightwire_bucket_open_duration_seconds_count",
    "weightwire_bucket_load_duration_seconds_count",
    "weightwire_handles_opened_total",
)


def _ack(kind: pb.TransportKind.ValueType) -> pb.BucketAck:
    return pb.BucketAck(
        index=0,
        tensors_loaded=1,
        bytes_loaded=64,
        source_device=DeviceRef.host().to_proto(),
        transport=kind,
        handle_opened=True,
        open_duration_ns=1000,
        load_duration_ns=2000,
    )


def test_every_importer_s_buckets_get_its_transport_s_own_label() -> None:
    importers = make_importers()
    # A CPU worker here has the host importers and the transfer group's (CUDA IPC needs a GPU build).
    assert transports.TRANSFER_GROUP.handle_field in importers
    registry = CollectorRegistry()
    metrics = WorkerMetrics(WORKER, registry=registry)
    for importer in importers.values():
        metrics.bucket_acked(_ack(importer.transport))
        metrics.bucket_acked(_ack(importer.transport))
    for field in importers:
        name = transports.by_field(field).name  # type: ignore[union-attr]
        for series in SERIES:
            got = registry.get_sample_value(series, {"worker": WORKER, "transport": name})
            assert got == 2, (series, name, got)
    assert (
        registry.get_sample_value("weightwire_buckets_total", {"worker": WORKER, "transport": "unspecified"})
        is None
    )
    assert (
        registry.get_sample_value(
            "weightwire_buckets_total", {"worker": WORKER, "transport": "transfer_group"}
        )
        == 2
    )


def test_every_row_of_the_table_has_its_own_label() -> None:
    # Also the rows whose importer cannot load here (CUDA IPC on a CPU build): one label each, its name.
    registry = CollectorRegistry()
    metrics = WorkerMetrics(WORKER, registry=registry)
    for row in transports.TRANSPORTS:
        metrics.bucket_acked(_ack(row.kind))
    for row in transports.TRANSPORTS:
        assert (
            registry.get_sample_value("weightwire_buckets_total", {"worker": WORKER, "transport": row.name})
            == 1
        ), row.name
