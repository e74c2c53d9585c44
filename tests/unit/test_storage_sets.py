"""Payloads of several CUDA IPC storages (a trainer's parameters exported where they live): the
checks on the wire, and the worker's kept mappings (bounds, reuse, what a complete payload drops).

The opener, counter release and event opener are stand-ins for CUDA (named so): what is tested is
which storages are opened, kept and dropped, which needs no GPU.
"""

from __future__ import annotations

import pytest
import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports.cuda_ipc import CudaIpcFields
from weightwire.core.transports.cuda_ipc_storages import (
    MAX_STORAGES_PER_PAYLOAD,
    CudaIpcStorageSet,
    StorageSetCache,
    has_storages,
)
from weightwire.v1 import weight_transfer_pb2 as pb


def storage(slot: int, size: int, at: int, handle: bytes = b"\x01" * 65) -> pb.CudaIpcStorage:
    return pb.CudaIpcStorage(
        memory_handle=handle,
        storage_offset_bytes=0,
        storage_size_bytes=size,
        ref_counter_handle=b"/torch_1_abc_0",
        ref_counter_offset=slot,
        payload_offset_bytes=at,
    )


def handle(*storages: pb.CudaIpcStorage, complete: bool = False, event: bytes = b"") -> pb.CudaIpcHandle:
    return pb.CudaIpcHandle(
        storages=list(storages),
        storages_complete=complete,
        event_handle=event,
        event_sync_required=bool(event),
    )


class FakeCuda:
    """Stand-in for CUDA: 'opening' a storage makes a CPU tensor filled with its counter slot."""

    def __init__(self) -> None:
        self.opened: list[int] = []
        self.collects = 0
        self.events: list[bytes] = []

    def open(self, fields: CudaIpcFields, device_index: int) -> torch.Tensor:
        self.opened.append(fields.ref_counter_offset)
        return torch.full((fields.storage_size_bytes,), fields.ref_counter_offset % 256, dtype=torch.uint8)

    def collect(self) -> None:
        self.collects += 1

    def event(self, fields: CudaIpcFields, device_index: int) -> object:
        self.events.append(fields.event_handle)
        return object()

    def cache(self, capacity: int = 2 * MAX_STORAGES_PER_PAYLOAD) -> StorageSetCache:
        return StorageSetCache(capacity, opener=self.open, collect=self.collect, event_opener=self.event)  # type: ignore[arg-type]


def test_a_storage_set_parses_places_and_finds_each_storage() -> None:
    msg = handle(storage(1, 100, 0), storage(2, 50, 256))
    assert has_storages(msg) and not has_storages(pb.CudaIpcHandle(memory_handle=b"x"))
    parsed = CudaIpcStorageSet.from_proto(msg)
    assert parsed.size_bytes == 306
    assert parsed.storage_at(260, 40) == (1, 4)
    assert parsed.storage_at(0, 100) == (0, 0)
    for off, n in ((90, 20), (120, 8), (300, 10)):  # across storages, in a gap, past the end
        with pytest.raises(WeightwireError) as e:
            parsed.storage_at(off, n)
        assert e.value.reason == Reason.TENSOR_OUT_OF_BOUNDS.name


@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        (handle(storage(1, 100, 64), storage(2, 50, 100)), Reason.INVALID_OFFSET),  # overlap
        (handle(storage(1, 0, 0)), Reason.INVALID_SIZE),
        (handle(storage(1, 10, 0, handle=b"")), Reason.HANDLE_MISSING),
        (pb.CudaIpcHandle(memory_handle=b"x" * 65, storages=[storage(1, 10, 0)]), Reason.HANDLE_MISSING),
        (pb.CudaIpcHandle(storages=[storage(1, 10, 0)], event_sync_required=True), Reason.HANDLE_MISSING),
    ],
)
def test_a_bad_storage_set_is_refused_with_its_reason(msg: pb.CudaIpcHandle, reason: Reason) -> None:
    with pytest.raises(WeightwireError) as e:
        CudaIpcStorageSet.from_proto(msg)
    assert e.value.reason == reason.name


def test_a_counter_file_that_is_not_torchs_is_refused() -> None:
    bad = storage(1, 10, 0)
    bad.ref_counter_handle = b"/etc/passwd"
    with pytest.raises(WeightwireError) as e:
        CudaIpcStorageSet.from_proto(handle(bad))
    assert e.value.reason == Reason.INVALID_SHM_NAME.name


def test_too_many_storages_are_refused() -> None:
    msg = handle(*[storage(i, 1, i * 256) for i in range(MAX_STORAGES_PER_PAYLOAD + 1)])
    with pytest.raises(WeightwireError) as e:
        CudaIpcStorageSet.from_proto(msg)
    assert e.value.reason == Reason.INVALID_SIZE.name


def test_storages_open_once_when_first_needed_and_the_same_payload_reuses_them() -> None:
    fake = FakeCuda()
    cache = fake.cache()
    msg = handle(storage(1, 16, 0), storage(2, 16, 256), storage(3, 16, 512), event=b"e" * 64)
    entry, new = cache.open(msg, 0)
    assert new and fake.opened == [] and fake.events == [b"e" * 64]
    assert cache.storage(entry, 1)[0].item() == 2
    again, new_again = cache.open(pb.CudaIpcHandle.FromString(msg.SerializeToString()), 0)
    assert again is entry and not new_again
    assert cache.storage(again, 1)[0].item() == 2
    assert fake.opened == [2] and fake.events == [b"e" * 64] and cache.open_storages == 1


def test_a_complete_payload_drops_every_storage_it_does_not_list() -> None:
    fake = FakeCuda()
    cache = fake.cache()
    old = handle(storage(1, 16, 0), storage(2, 16, 256), complete=True)
    entry, _ = cache.open(old, 0)
    cache.storage(entry, 0)
    cache.storage(entry, 1)
    # The trainer replaced parameter 2 (a new share, slot 5): the storage of slot 1 is kept, slot 2 goes.
    new = handle(storage(1, 16, 0), storage(5, 16, 256), complete=True)
    entry2, _ = cache.open(new, 0)
    assert cache.kept_sets == 1 and cache.open_storages == 1 and cache.dropped_storages == 1
    assert cache.storage(entry2, 0)[0].item() == 1 and cache.storage(entry2, 1)[0].item() == 5
    assert fake.opened == [1, 2, 5]  # slot 1 was not opened again
    with pytest.raises(WeightwireError) as e:
        cache.storage(entry, 1)  # the old set is gone: nothing reads its storages again
    assert e.value.reason == Reason.HANDLE_OPEN_FAILED.name


def test_a_partial_payload_keeps_the_others_and_the_sets_stay_bounded() -> None:
    fake = FakeCuda()
    cache = fake.cache()
    sets = [handle(storage(10 + i, 8, 0)) for i in range(StorageSetCache.MAX_KEPT_SETS + 2)]
    for msg in sets:
        entry, _ = cache.open(msg, 0)
        cache.storage(entry, 0)
    assert cache.kept_sets == StorageSetCache.MAX_KEPT_SETS
    assert cache.open_storages == StorageSetCache.MAX_KEPT_SETS
    assert cache.dropped_storages == 2 and fake.collects >= 2


def test_open_storages_stay_under_the_capacity() -> None:
    fake = FakeCuda()
    cache = fake.cache(capacity=MAX_STORAGES_PER_PAYLOAD)
    first = handle(*[storage(i, 1, i * 256) for i in range(MAX_STORAGES_PER_PAYLOAD)])
    entry, _ = cache.open(first, 0)
    for i in range(3):
        cache.storage(entry, i)
    second = handle(*[storage(i, 1, i * 256, handle=b"\x02" * 65) for i in range(MAX_STORAGES_PER_PAYLOAD)])
    entry2, _ = cache.open(second, 0)
    for i in range(MAX_STORAGES_PER_PAYLOAD - 1):
        cache.storage(entry2, i)
    assert cache.open_storages <= MAX_STORAGES_PER_PAYLOAD
    cache.storage(entry2, MAX_STORAGES_PER_PAYLOAD - 1)  # evicts the first set, not this one
    assert cache.open_storages == MAX_STORAGES_PER_PAYLOAD and cache.kept_sets == 1


def test_release_all_drops_everything() -> None:
    fake = FakeCuda()
    cache = fake.cache()
    entry, _ = cache.open(handle(storage(1, 8, 0)), 0)
    cache.storage(entry, 0)
    assert cache.release_all() == 1 and cache.open_storages == 0 and cache.kept_sets == 0


def test_the_mapping_views_each_tensor_in_its_own_storage_and_keeps_the_views() -> None:
    from weightwire.core.devices import DeviceRef
    from weightwire.server.rules.views import ReadBatch, ViewItem, batch_views
    from weightwire.server.transports.cuda_ipc import CudaIpcStorageMapping

    # Stand-in storages whose bytes are known: storage k is filled with byte k (FakeCuda).
    fake = FakeCuda()
    cache = fake.cache()
    msg = handle(storage(3, 64, 0), storage(7, 32, 256))
    entry, _ = cache.open(msg, 0)
    mapping = CudaIpcStorageMapping(cache, entry, DeviceRef.host(), False, True, device=torch.device("cpu"))
    items = (ViewItem.of(8, torch.int16, (4,)), ViewItem.of(256 + 16, torch.uint8, (2, 8)))
    batch = ReadBatch(("a", "b"), items, (8, 256 + 16), (), 0)
    views = batch_views(mapping, batch)
    assert views[0].tolist() == [0x0303] * 4
    assert views[1].shape == (2, 8) and bool((views[1] == 7).all())
    assert batch_views(mapping, batch) is views  # kept with the set
    assert mapping.size_bytes == 288 and fake.opened == [3, 7]
    # CRC over the payload's bytes, the gap between the storages read as zeros.
    import zlib

    expect = zlib.crc32(bytes([3]) * 64 + bytes(256 - 64) + bytes([7]) * 32)
    assert mapping.crc32(288) == expect
    bad = ReadBatch(("c",), (ViewItem.of(60, torch.int32, (2,)),), (60,), (), 0)
    with pytest.raises(WeightwireError) as e:
        batch_views(mapping, bad)  # runs past its storage's end
    assert e.value.reason == Reason.TENSOR_OUT_OF_BOUNDS.name
    odd = ReadBatch(("d",), (ViewItem.of(257, torch.int16, (2,)),), (257,), (), 0)
    with pytest.raises(WeightwireError) as e:
        batch_views(mapping, odd)
    assert e.value.reason == Reason.INVALID_OFFSET.name
