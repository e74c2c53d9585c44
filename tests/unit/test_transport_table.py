"""The transport table agrees with the contract and with the classes it names, and both halves of
the project find every transport through it."""

from __future__ import annotations

import torch
from weightwire.client.transports import exporter as exp
from weightwire.core.devices import DeviceRef
from weightwire.core.transports import table as transports
from weightwire.server.transports.importer import PayloadImporter, make_importers
from weightwire.v1 import weight_transfer_pb2 as pb


def test_every_row_is_a_handle_field_and_a_wire_kind_of_the_contract() -> None:
    handle_fields = {f.name for f in pb.Payload.DESCRIPTOR.oneofs_by_name["handle"].fields}
    wire_kinds = {
        v.number for v in pb.TransportKind.DESCRIPTOR.values if v.number != pb.TRANSPORT_KIND_UNSPECIFIED
    }
    rows = transports.TRANSPORTS
    # Every way the contract can carry bytes has its row, and no row names something it cannot carry.
    assert {t.handle_field for t in rows} == handle_fields
    assert {t.kind for t in rows} == wire_kinds
    assert (
        len({t.name for t in rows})
        == len({t.kind for t in rows})
        == len({t.handle_field for t in rows})
        == len(rows)
    )


def test_each_row_names_its_own_exporter_and_importer() -> None:
    for row in transports.TRANSPORTS:
        exporter = row.load_exporter()
        importer = row.load_importer()
        assert isinstance(exporter, type) and issubclass(exporter, exp.Exporter)
        assert isinstance(importer, type) and issubclass(importer, PayloadImporter)
        assert exporter.TRANSPORT is row and importer.TRANSPORT is row
    made = make_importers()
    assert sorted(made) == sorted(t.handle_field for t in transports.TRANSPORTS)
    assert {imp.transport for imp in made.values()} == {t.kind for t in transports.TRANSPORTS}


def test_lookups_and_names() -> None:
    assert transports.by_name("host_shm") is transports.HOST_SHM
    assert transports.by_field("inline_data") is transports.INLINE
    assert transports.by_kind(pb.TRANSPORT_KIND_CUDA_IPC) is transports.CUDA_IPC
    assert transports.by_name("nope") is None
    assert [transports.kind_name(t.kind) for t in transports.TRANSPORTS] == transports.names()
    assert transports.kind_name(99) == "transport 99"
    assert transports.field_description("host_shm") == "host shared memory"
    assert transports.field_description("weird") == "weird"


def test_what_workers_can_import_and_what_exports_local_buffers() -> None:
    gpu = DeviceRef.cuda("1a698f5b-557f-4b7e-9c3d-2f1e0a9b8c7d")
    on_host, on_gpu = transports.for_worker(DeviceRef.host()), transports.for_worker(gpu)
    assert pb.TRANSPORT_KIND_CUDA_IPC in on_gpu and pb.TRANSPORT_KIND_CUDA_IPC not in on_host
    for kind in (pb.TRANSPORT_KIND_HOST_SHM, pb.TRANSPORT_KIND_INLINE):
        assert kind in on_host and kind in on_gpu
    table_order = [t.kind for t in transports.TRANSPORTS]
    assert list(on_gpu) == sorted(on_gpu, key=table_order.index)
    assert transports.HOST_WORKER_TRANSPORTS == transports.for_worker(DeviceRef.host())
    assert transports.for_local_buffer("cpu") is transports.HOST_SHM
    assert transports.for_local_buffer("cuda") is transports.CUDA_IPC
    assert exp.available_transports() == transports.names()


def test_auto_asks_the_exporters_in_table_order() -> None:
    here, cpu, gpu_src = DeviceRef.host(), torch.device("cpu"), torch.device("cuda", 0)
    gpu = DeviceRef.cuda("1a698f5b-557f-4b7e-9c3d-2f1e0a9b8c7d")
    assert exp.choose_transport([here], cpu) == "host_shm"
    assert exp.choose_transport([gpu], gpu_src) == "cuda_ipc"
    assert exp.choose_transport([gpu, here], gpu_src) == "inline"  # mixed workers: only the last row fits all
    assert exp.choose_transport([], cpu) == "inline"
