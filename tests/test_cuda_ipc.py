"""CPU-runnable checks of the CUDA IPC code: proto field mapping, wire checks, the handle cache and
the importer's views, with fake handle bytes and CPU tensors standing in for opened storages.

The real export/import between processes on a GPU is in tests/gpu (``make test-gpu``).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.transports.cuda_ipc import (
    REF_COUNTER_SLOTS,
    CudaIpcCache,
    CudaIpcFields,
    OpenedStorage,
    check_ref_counter,
    share_cuda_tensor,
)
from weightwire.v1 import weight_transfer_pb2 as pb

HANDLE = b"\x00" + bytes(range(64))


def make_fields(**over: object) -> CudaIpcFields:
    values: dict[str, object] = dict(
        memory_handle=HANDLE,
        storage_offset_bytes=1024,
        storage_size_bytes=4096,
        ref_counter_handle=b"/torch_1234_987654_0",
        ref_counter_offset=7,
        event_handle=bytes(64),
        event_sync_required=True,
    )
    values.update(over)
    return CudaIpcFields(**values)  # type: ignore[arg-type]


def test_fields_round_trip_through_proto_bytes() -> None:
    fields = make_fields()
    wire = pb.Payload(
        device=DeviceRef.cuda("GPU-ABC").to_proto(), size_bytes=4096, cuda_ipc=fields.to_proto()
    ).SerializeToString()
    back = pb.Payload.FromString(wire)
    assert back.WhichOneof("handle") == "cuda_ipc"
    assert back.device.uuid == "abc"
    assert CudaIpcFields.from_proto(back.cuda_ipc) == fields
    assert fields.cache_key == (HANDLE, 1024, 4096, b"/torch_1234_987654_0")
    assert fields.ref_counter == (b"/torch_1234_987654_0", 7)


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"memory_handle": b""}, "HANDLE_MISSING"),
        ({"memory_handle": b"x" * 5000}, "HANDLE_MISSING"),
        ({"storage_offset_bytes": -1}, "INVALID_OFFSET"),
        ({"storage_size_bytes": 0}, "INVALID_SIZE"),
        ({"event_handle": b""}, "HANDLE_MISSING"),
        ({"ref_counter_handle": b"/dev/shm/ww-victim"}, "INVALID_SHM_NAME"),
        ({"ref_counter_handle": b"/torch_../../etc"}, "INVALID_SHM_NAME"),
        ({"ref_counter_handle": b"torch_1_2_3"}, "INVALID_SHM_NAME"),
        ({"ref_counter_handle": b"/torch_1_2\x00_3"}, "INVALID_SHM_NAME"),
        ({"ref_counter_handle": b"/torch_\xff"}, "INVALID_SHM_NAME"),
        ({"ref_counter_offset": -1}, "INVALID_OFFSET"),
        ({"ref_counter_offset": REF_COUNTER_SLOTS}, "INVALID_OFFSET"),
    ],
)
def test_unsafe_wire_fields_are_refused(over: dict[str, object], reason: str) -> None:
    msg = make_fields(**over).to_proto()
    with pytest.raises(WeightwireError) as info:
        CudaIpcFields.from_proto(msg)
    assert info.value.reason == reason
    assert info.value.code == "INVALID_ARGUMENT"


def test_event_handle_may_be_empty_when_no_sync_is_required() -> None:
    CudaIpcFields.from_proto(make_fields(event_handle=b"", event_sync_required=False).to_proto())
    check_ref_counter(b"/torch_1_2_3", REF_COUNTER_SLOTS - 1)


def test_share_refuses_host_tensors() -> None:
    with pytest.raises(ValueError, match="CUDA tensor"):
        share_cuda_tensor(torch.zeros(4))


class FakeEvent:
    """Stands in for an opened producer event: counts host waits."""

    def __init__(self, handle: bytes) -> None:
        self.handle = handle
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


class FakeCuda:
    """Stands in for the CUDA calls of CudaIpcCache: each open returns a fresh host buffer, each
    event open a ``FakeEvent``."""

    def __init__(self, fail_events: bool = False) -> None:
        self.opened: list[tuple[bytes, int, int]] = []
        self.released: list[tuple[bytes, int]] = []
        self.events: list[FakeEvent] = []
        self.collects = 0
        self.fail_events = fail_events

    def open_event(self, fields: CudaIpcFields, index: int) -> FakeEvent:
        if self.fail_events:
            raise WeightwireError("HANDLE_OPEN_FAILED", "fake: the event handle cannot be opened")
        event = FakeEvent(fields.event_handle)
        self.events.append(event)
        return event

    def open(self, fields: CudaIpcFields, index: int) -> torch.Tensor:
        self.opened.append((fields.memory_handle, fields.storage_offset_bytes, index))
        return torch.arange(fields.storage_size_bytes, dtype=torch.int64).to(torch.uint8)

    def release(self, fields: CudaIpcFields) -> None:
        self.released.append(fields.ref_counter)

    def collect(self) -> None:
        self.collects += 1

    def cache(self, capacity: int = 4) -> CudaIpcCache:
        return CudaIpcCache(
            capacity,
            opener=self.open,
            release_counter=self.release,
            collect=self.collect,
            event_opener=self.open_event,
        )


def test_cache_opens_each_storage_once_and_counts() -> None:
    fake = FakeCuda()
    cache = fake.cache()
    a, b = make_fields(storage_offset_bytes=0), make_fields(storage_offset_bytes=8192)
    first = cache.open(a, 0)
    assert first.opened and first.size_bytes == 4096
    for _ in range(5):
        again = cache.open(a, 0)
        assert not again.opened
        assert again.flat is first.flat
    assert cache.open(b, 0).opened
    assert cache.opens == 2 and cache.open_mappings == 2
    assert fake.opened == [(HANDLE, 0, 0), (HANDLE, 8192, 0)]
    # The same share repeated across updates gives nothing back; a re-share's counter is released once.
    assert fake.released == []
    reshared = make_fields(storage_offset_bytes=0, ref_counter_offset=99)
    assert not cache.open(reshared, 0).opened
    assert not cache.open(reshared, 0).opened
    assert fake.released == [(b"/torch_1234_987654_0", 99)]


def test_cache_keys_by_device_size_and_producer_too() -> None:
    fake = FakeCuda()
    cache = fake.cache()
    cache.open(make_fields(), 0)
    assert cache.open(make_fields(), 1).opened
    assert cache.open(make_fields(storage_size_bytes=8192), 0).opened
    # Equal handle bytes from another producer process (another counter file) never hit.
    assert cache.open(make_fields(ref_counter_handle=b"/torch_999_1_0"), 0).opened
    assert cache.opens == 4


def test_cache_evicts_least_recently_used_and_releases_all() -> None:
    fake = FakeCuda()
    cache = fake.cache(capacity=2)
    f0, f1, f2 = (make_fields(storage_offset_bytes=i * 4096) for i in range(3))
    cache.open(f0, 0)
    cache.open(f1, 0)
    cache.open(f0, 0)  # f1 is now the least recently used
    cache.open(f2, 0)
    assert cache.open_mappings == 2 and cache.evictions == 1 and fake.collects == 1
    assert not cache.open(f0, 0).opened
    assert cache.open(f1, 0).opened  # was evicted, so it opens again
    assert cache.release_all() == 2
    assert cache.open_mappings == 0 and fake.collects == 3
    assert cache.open(f0, 0).opened
    assert cache.opens == 5


def test_producer_event_opened_once_per_share_and_waited_for_on_every_use() -> None:
    fake = FakeCuda()
    cache = fake.cache()
    ev_a = make_fields(event_handle=b"\x01" * 64)
    uses = [cache.open(ev_a, 0) for _ in range(3)]
    assert [u.opened for u in uses] == [True, False, False]
    assert len(fake.events) == 1 and cache.event_opens == 1
    assert all(u.ready_event is fake.events[0] for u in uses)
    for u in uses:
        u.wait_ready()
    assert fake.events[0].waits == 3
    # Another share of the same storage (another counter slot) gets its own event, even with
    # equal handle bytes: they may belong to an event destroyed since.
    cache.open(make_fields(event_handle=b"\x01" * 64, ref_counter_offset=8), 0)
    assert cache.event_opens == 2 and cache.opens == 1
    # Without event_sync_required there is nothing to wait for.
    plain = cache.open(make_fields(event_handle=b"", event_sync_required=False), 0)
    assert plain.ready_event is None and cache.event_opens == 2
    plain.wait_ready()
    # Events go with their mapping.
    cache.release_all()
    assert cache.open(ev_a, 0).opened and cache.event_opens == 3


def test_a_share_whose_event_cannot_be_opened_keeps_no_mapping() -> None:
    fake = FakeCuda(fail_events=True)
    cache = fake.cache()
    with pytest.raises(WeightwireError) as info:
        cache.open(make_fields(), 0)
    assert info.value.reason == "HANDLE_OPEN_FAILED"
    assert cache.open_mappings == 0 and fake.collects == 1


def test_with_event_names_the_event_to_wait_for() -> None:
    fields = make_fields(event_handle=b"", event_sync_required=False)
    assert fields.event_key is None
    waited = fields.with_event(b"\x07" * 64)
    assert waited.event_sync_required and waited.event_handle == b"\x07" * 64
    assert waited.event_key == (b"\x07" * 64, fields.ref_counter_handle, fields.ref_counter_offset)
    assert waited.cache_key == fields.cache_key  # the same storage, so the same mapping
    assert CudaIpcFields.from_proto(waited.to_proto()) == waited
    with pytest.raises(WeightwireError):
        fields.with_event(b"")


def test_cache_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        CudaIpcCache(0)


# --- the server's importer (views over an opened storage) -------------------------------------


def importer_module():  # type: ignore[no-untyped-def]
    return pytest.importorskip("weightwire.server.transports.cuda_ipc")


def test_mapping_views_by_offset_dtype_and_shape() -> None:
    mod = importer_module()
    flat = torch.zeros(256, dtype=torch.uint8)
    flat[16:32].view(torch.float32).copy_(torch.tensor([1.5, -2.0, 3.25, 4.0]))
    mapping = mod.CudaIpcMapping(OpenedStorage(flat, 0, True, 10), DeviceRef.cuda("abc"), False)
    assert mapping.size_bytes == 256 and mapping.handle_opened and not mapping.peer_device_import
    view = mapping.view(16, torch.float32, (2, 2))
    assert view.tolist() == [[1.5, -2.0], [3.25, 4.0]]
    assert view.data_ptr() == flat.data_ptr() + 16  # a view, not a copy
    # A misaligned element type still reads the right values (through one copy).
    flat[33:37].view(torch.uint8).copy_(torch.tensor([1.0], dtype=torch.float32).view(torch.uint8))
    assert mapping.view(33, torch.float32, (1,)).tolist() == [1.0]
    assert mapping.view(0, torch.bfloat16, (0, 3)).shape == (0, 3)
    assert mapping.crc32(64) == zlib.crc32(flat[:64].numpy().tobytes())
    with pytest.raises(WeightwireError) as info:
        mapping.view(250, torch.float32, (2,))
    assert info.value.reason == "TENSOR_OUT_OF_BOUNDS"
    mapping.close()
    with pytest.raises(WeightwireError):
        mapping.view(0, torch.uint8, (1,))


def test_importer_checks_fields_and_keys_by_storage() -> None:
    mod = importer_module()
    importer = mod.CudaIpcImporter(FakeCuda().cache())
    assert importer.reusable and importer.field_name == "cuda_ipc"
    good = pb.Payload(
        device=DeviceRef.cuda("abc").to_proto(), size_bytes=10, cuda_ipc=make_fields().to_proto()
    )
    importer.check(good)
    assert importer.cache_key(good) == ("cuda_ipc", (HANDLE, 1024, 4096, b"/torch_1234_987654_0"))
    bad = pb.Payload(cuda_ipc=make_fields(ref_counter_handle=b"/x").to_proto())
    with pytest.raises(WeightwireError) as info:
        importer.check(bad)
    assert info.value.reason == "INVALID_SHM_NAME"


def test_importer_refuses_labels_it_cannot_map(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = importer_module()
    own = DeviceRef.cuda("own")
    with pytest.raises(WeightwireError) as info:
        mod.CudaIpcImporter.local_index(DeviceRef.host("boot"), peer=False, own=own)
    assert info.value.reason == "TRANSPORT_UNAVAILABLE"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(WeightwireError) as info:
        mod.CudaIpcImporter.local_index(own, peer=False, own=own)
    assert info.value.reason == "TRANSPORT_UNAVAILABLE"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mod, "local_cuda_index", lambda device: {"own": 0, "peer": 1}.get(device.uuid))
    assert mod.CudaIpcImporter.local_index(DeviceRef.cuda("GPU-PEER"), peer=True, own=own) == 1
    with pytest.raises(WeightwireError) as info:
        mod.CudaIpcImporter.local_index(DeviceRef.cuda("elsewhere"), peer=True, own=own)
    assert info.value.reason == "PEER_DEVICE_UNAVAILABLE"


# --- the client's exporter (no GPU here) --------------------------------------------------------


def test_exporter_auto_rule_and_no_gpu() -> None:
    mod = pytest.importorskip("weightwire.client.transports.cuda_ipc")
    cuda, host = DeviceRef.cuda("abc"), DeviceRef.host("boot")
    assert mod.cuda_auto_rule([cuda, DeviceRef.cuda("def")], torch.device("cuda", 0))
    assert not mod.cuda_auto_rule([cuda, host], torch.device("cuda", 0))
    assert not mod.cuda_auto_rule([cuda], torch.device("cpu"))
    assert not mod.cuda_auto_rule([], torch.device("cuda", 0))
    if not torch.cuda.is_available():
        with pytest.raises(WeightwireError) as info:
            mod.CudaIpcExporter("cuda")
        assert info.value.reason == "TRANSPORT_UNAVAILABLE"
