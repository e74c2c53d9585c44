"""CUDA IPC storage sets by name (``CudaIpcHandle.storage_set_id``): the worker keeps a set sent
with a name under it while it keeps the set, a payload naming it alone is that set, anything else
is refused before a bucket loads; the trainer names only what a worker acked and still keeps.

The opener and event opener are the stand-ins of tests/unit/test_storage_sets.py (no GPU needed:
what is tested is which set a name finds, and when it is refused)."""

from __future__ import annotations

import pytest
import torch
from test_storage_sets import FakeCuda, handle, storage
from weightwire.client.update.payload_refs import StorageSetRefs
from weightwire.client.update.session import layouts_let_go
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import PushError, Reason, WeightwireError
from weightwire.core.transports.cuda_ipc_storages import (
    MAX_KEPT_STORAGE_SETS,
    MAX_NAMES_PER_SET,
    names_storage_set,
)
from weightwire.server.transports.cuda_ipc import CudaIpcStorageMapping
from weightwire.v1 import weight_transfer_pb2 as pb


def named(
    set_id: bytes, *storages: pb.CudaIpcStorage, complete: bool = False, event: bytes = b"e" * 64
) -> pb.CudaIpcHandle:
    msg = handle(*storages, complete=complete, event=event)
    msg.storage_set_id = set_id
    return msg


def ref(set_id: bytes) -> pb.CudaIpcHandle:
    return pb.CudaIpcHandle(storage_set_id=set_id)


def refused(cache: object, msg: pb.CudaIpcHandle) -> str:
    with pytest.raises(WeightwireError) as e:
        cache.open(msg, 0)  # type: ignore[attr-defined]
    return e.value.reason


def test_a_named_set_is_found_by_its_name_alone_with_its_event_and_mappings() -> None:
    fake = FakeCuda()
    cache = fake.cache()
    whole = named(b"A" * 16, storage(1, 16, 0), storage(2, 16, 256))
    entry, new = cache.open(whole, 0)
    cache.storage(entry, 1)
    assert new and entry.names == [b"A" * 16] and names_storage_set(ref(b"A" * 16))
    again, new_again = cache.open(ref(b"A" * 16), 0)
    assert again is entry and not new_again
    assert cache.storage(again, 1)[0].item() == 2 and fake.opened == [2] and fake.events == [b"e" * 64]
    # The same storages sent whole under a new name (a trainer that built the same payload again):
    # the same kept set, views and all, answering to both names, at most MAX_NAMES_PER_SET of them.
    again_whole = named(b"A2", storage(1, 16, 0), storage(2, 16, 256))
    same, new_whole = cache.open(again_whole, 0)
    assert same is entry and not new_whole and fake.opened == [2]
    assert cache.open(ref(b"A" * 16), 0)[0] is entry and cache.open(ref(b"A2"), 0)[0] is entry
    for i in range(MAX_NAMES_PER_SET):
        cache.open(named(bytes([i]), storage(1, 16, 0), storage(2, 16, 256)), 0)
    assert len(entry.names) == MAX_NAMES_PER_SET
    assert refused(cache, ref(b"A" * 16)) == Reason.STORAGE_SET_UNKNOWN.name  # the oldest name went
    # The ack of a bucket loaded from either names the set (here one without an event to wait for).
    plain, _ = cache.open(named(b"C", storage(4, 16, 0), event=b""), 0)
    mapping = CudaIpcStorageMapping(
        cache, plain, DeviceRef.host(), False, False, device=torch.device("cpu"), kept_as=b"C"
    )
    assert mapping.kept_as == b"C"


def test_a_name_the_worker_does_not_keep_is_refused_before_anything_opens() -> None:
    fake = FakeCuda()
    cache = fake.cache()
    assert refused(cache, ref(b"never")) == Reason.STORAGE_SET_UNKNOWN.name  # e.g. a restarted worker
    entry, _ = cache.open(named(b"A", storage(1, 16, 0)), 0)
    cache.storage(entry, 0)
    # A complete set drops every other, and its name with it.
    cache.open(named(b"B", storage(3, 16, 0), complete=True), 0)
    assert refused(cache, ref(b"A")) == Reason.STORAGE_SET_UNKNOWN.name
    assert cache.open(ref(b"B"), 0)[0].names == [b"B"]
    # Kept on one device only: another device's payload must bring its storages.
    with pytest.raises(WeightwireError) as e:
        cache.open(ref(b"B"), 1)
    assert e.value.reason == Reason.STORAGE_SET_UNKNOWN.name
    # Sets beyond the bound go oldest first, names with them.
    for i in range(MAX_KEPT_STORAGE_SETS):
        cache.open(named(bytes([i]), storage(10 + i, 8, 0)), 0)
    assert refused(cache, ref(b"B")) == Reason.STORAGE_SET_UNKNOWN.name
    cache.release_all()
    assert refused(cache, ref(bytes([0]))) == Reason.STORAGE_SET_UNKNOWN.name
    assert fake.opened == [1]


@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        (pb.CudaIpcHandle(storage_set_id=b"A", event_handle=b"e" * 64), Reason.HANDLE_MISSING),
        (pb.CudaIpcHandle(storage_set_id=b"A", storages_complete=True), Reason.HANDLE_MISSING),
        (pb.CudaIpcHandle(storage_set_id=b"A", memory_handle=b"x" * 65), Reason.HANDLE_MISSING),
        (pb.CudaIpcHandle(storage_set_id=b"x" * 65), Reason.MALFORMED_STREAM),
        (named(b"x" * 65, storage(1, 16, 0)), Reason.MALFORMED_STREAM),
    ],
)
def test_a_malformed_name_is_refused_with_its_reason(msg: pb.CudaIpcHandle, reason: Reason) -> None:
    cache = FakeCuda().cache()
    cache.open(named(b"A", storage(1, 16, 0)), 0)
    with pytest.raises(WeightwireError) as e:
        cache.parse(msg)
    assert e.value.reason == reason.name


def payload(set_id: bytes, *, complete: bool = False) -> pb.Payload:
    return pb.Payload(size_bytes=16, cuda_ipc=named(set_id, storage(1, 16, 0), complete=complete))


W = ("w:1", "fp", "instance-1")


def test_the_trainer_names_only_what_a_worker_acked_and_still_keeps() -> None:
    refs = StorageSetRefs()
    a, b = payload(b"A"), payload(b"B", complete=True)
    assert refs.payloads(W, [a]) == [a]  # not acked yet: sent whole
    refs.kept(W, b"A")
    sent = refs.payloads(W, [a])
    assert sent[0].cuda_ipc.storage_set_id == b"A" and not sent[0].cuda_ipc.storages
    assert sent[0].size_bytes == 16
    assert refs.payloads(("w:1", "fp", "instance-2"), [a]) == [a]  # a restarted worker keeps nothing
    # A complete set acked: the worker dropped the others.
    assert refs.payloads(W, [b]) == [b]
    refs.kept(W, b"B")
    assert refs.payloads(W, [a]) == [a]
    assert not refs.payloads(W, [b])[0].cuda_ipc.storages
    # At most as many as a worker keeps, the oldest named first out.
    many = [payload(bytes([i])) for i in range(MAX_KEPT_STORAGE_SETS + 1)]
    refs.payloads(W, many)
    for p in many:
        refs.kept(W, p.cuda_ipc.storage_set_id)
    out = refs.payloads(W, many)
    assert [bool(p.cuda_ipc.storages) for p in out] == [True] + [False] * MAX_KEPT_STORAGE_SETS
    refs.forget("w:1")  # it failed an update
    assert refs.payloads(W, many) == many
    off = StorageSetRefs(enabled=False)
    off.payloads(W, [a])
    off.kept(W, b"A")
    assert off.payloads(W, [a]) == [a]


def test_a_refused_name_lets_the_update_go_again_whole() -> None:
    def error(*reasons: Reason) -> PushError:
        return PushError(
            {f"w{i}": WeightwireError(r, "x") for i, r in enumerate(reasons)}  # type: ignore[arg-type]
        )

    assert layouts_let_go(error(Reason.STORAGE_SET_UNKNOWN, Reason.CANCELLED))
    assert layouts_let_go(error(Reason.STORAGE_SET_UNKNOWN, Reason.LAYOUT_UNKNOWN))
    assert not layouts_let_go(error(Reason.STORAGE_SET_UNKNOWN, Reason.SHAPE_MISMATCH))
    assert not layouts_let_go(error(Reason.CANCELLED))
