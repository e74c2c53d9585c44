"""CUDA IPC primitives between real processes: a producer (tests/gpu/ipc_producer.py) exports a
GPU buffer through ``weightwire.core.transports.cuda_ipc``; this test process imports it by GPU UUID."""

from __future__ import annotations

import pytest
import torch
from gpu_procs import gpu_uuid, needs_gpus, producer
from weightwire.core.devices import DeviceRef, local_cuda_index
from weightwire.core.errors import WeightwireError
from weightwire.core.transports.cuda_ipc import CudaIpcCache, CudaIpcFields, ipc_collect, open_cuda_storage
from weightwire.v1 import weight_transfer_pb2 as pb

SIZE = 3 * 1024 * 1024 + 17


def expected_pattern(n: int, seed: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 31 + seed) % 251).to(torch.uint8)


def parse_share(answer: str) -> tuple[pb.Payload, int]:
    kind, hexdata, base = answer.split()
    assert kind == "payload"
    return pb.Payload.FromString(bytes.fromhex(hexdata)), int(base)


@pytest.mark.gpu
@needs_gpus(1)
def test_export_import_by_uuid_reuses_one_mapping() -> None:
    cache = CudaIpcCache()
    with producer("0", SIZE, lead=4096) as prod:
        assert prod.ask("pattern 5") == "ok"
        payload, base = parse_share(prod.ask("share"))
        # Labelled by the GPU's UUID, and the payload covers the view from its storage offset.
        assert payload.device.kind == pb.DEVICE_KIND_CUDA
        assert payload.device.uuid == gpu_uuid(0)
        assert base == 4096 and payload.size_bytes == 4096 + SIZE
        fields = CudaIpcFields.from_proto(payload.cuda_ipc)  # torch's counter name passes our check
        index = local_cuda_index(DeviceRef.from_proto(payload.device))
        assert index == 0

        first = cache.open(fields, index)
        assert first.opened and first.size_bytes >= payload.size_bytes
        got = first.flat[base : base + SIZE].cpu()
        assert torch.equal(got, expected_pattern(SIZE, 5))

        # The mapping is live memory: new contents are visible with no reopen.
        assert prod.ask("fill 7") == "ok"
        again = cache.open(CudaIpcFields.from_proto(payload.cuda_ipc), index)
        assert not again.opened
        assert int(again.flat[base : base + SIZE].min()) == 7 == int(again.flat[base : base + SIZE].max())

        # A second share of the same buffer is recognised: no reopen, its counter is given back.
        payload2, _ = parse_share(prod.ask("share"))
        assert payload2.cuda_ipc.memory_handle == payload.cuda_ipc.memory_handle
        assert not cache.open(CudaIpcFields.from_proto(payload2.cuda_ipc), index).opened
        assert cache.opens == 1 and cache.open_mappings == 1

        del first, again
        assert cache.release_all() == 1
        torch.cuda.synchronize()
        ipc_collect()
        # Every consumer reference was returned, so the producer can really free the buffer.
        baseline = int(prod.ask("free").split()[1])
        assert baseline == 0


@pytest.mark.gpu
@needs_gpus(1)
def test_kept_mapping_waits_for_the_producer_event() -> None:
    """The producer sends an event handle right after queueing slow writes, without waiting for
    them; a consumer reading through its kept mapping waits for that event and sees every byte."""
    from weightwire.server.transports.cuda_ipc import CudaIpcMapping

    cache = CudaIpcCache()
    with producer("0", SIZE) as prod:
        assert prod.ask("pattern 1") == "ok"
        payload, _ = parse_share(prod.ask("share"))
        fields = CudaIpcFields.from_proto(payload.cuda_ipc)
        assert cache.open(fields, 0).opened
        # torch's share carries an event of its own (recorded when it shared); it was opened too.
        events_before = cache.event_opens
        for value in (9, 200):
            kind, handle = prod.ask(f"slowfill {value}").split()
            assert kind == "event"
            use = cache.open(fields.with_event(bytes.fromhex(handle)), 0)
            assert not use.opened and use.ready_event is not None
            mapping = CudaIpcMapping(use, DeviceRef.from_proto(payload.device), False)
            got = mapping.view(0, torch.uint8, (SIZE,))
            assert int(got.min()) == value == int(got.max())
        # The producer's event is opened once for this share and kept with the mapping.
        assert cache.event_opens == events_before + 1 and cache.opens == 1
        cache.release_all()


@pytest.mark.gpu
@needs_gpus(1)
def test_producer_keeps_block_while_consumer_maps_it() -> None:
    """torch's reference counting across processes works with our hand-made transfer: a block a
    consumer still maps is not given back to the producer's allocator until the consumer lets go."""
    cache = CudaIpcCache()
    with producer("0", SIZE) as prod:
        payload, _ = parse_share(prod.ask("share"))
        opened = cache.open(CudaIpcFields.from_proto(payload.cuda_ipc), 0)
        held = int(prod.ask("free").split()[1])
        assert held >= SIZE  # in torch's limbo: the consumer holds a reference
        del opened
        cache.release_all()
        torch.cuda.synchronize()
        assert int(prod.ask("mem").split()[1]) == 0


@pytest.mark.gpu
@needs_gpus(1)
def test_corrupted_handle_fails_with_handle_open_failed() -> None:
    with producer("0", SIZE) as prod:
        payload, _ = parse_share(prod.ask("share"))
        raw = bytearray(payload.cuda_ipc.memory_handle)
        for i in range(8, min(len(raw), 40)):
            raw[i] ^= 0x5A
        payload.cuda_ipc.memory_handle = bytes(raw)
        with pytest.raises(WeightwireError) as info:
            open_cuda_storage(CudaIpcFields.from_proto(payload.cuda_ipc), 0)
        assert info.value.reason == "HANDLE_OPEN_FAILED"
        assert info.value.code == "FAILED_PRECONDITION"


@pytest.mark.gpu2
@needs_gpus(2)
def test_peer_gpu_import_copies_over_nvlink() -> None:
    """The producer sees only GPU 1 (its index 0); this process maps the UUID to its index 1."""
    cache = CudaIpcCache()
    with producer("1", SIZE) as prod:
        assert prod.ask("pattern 9") == "ok"
        payload, _ = parse_share(prod.ask("share"))
        label = DeviceRef.from_proto(payload.device)
        assert label.uuid == gpu_uuid(1) != gpu_uuid(0)
        index = local_cuda_index(label)
        assert index == 1
        opened = cache.open(CudaIpcFields.from_proto(payload.cuda_ipc), index)
        assert opened.flat.device == torch.device("cuda", 1)
        dst = torch.empty(SIZE, dtype=torch.uint8, device="cuda:0")
        dst.copy_(opened.flat[:SIZE])
        torch.cuda.synchronize(0)
        assert torch.equal(dst.cpu(), expected_pattern(SIZE, 9))
        del opened
        cache.release_all()
