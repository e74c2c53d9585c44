"""Views a kept mapping remembers (``views.batch_views``) and the CUDA IPC mapping's wait for its
producer event, on CPU: a remembered view still shows the bytes of each new bucket, a copied
(misaligned) tensor is never remembered, and every bucket fetches (waits) again."""

from __future__ import annotations

import torch
from weightwire.core.cuda_ipc import OpenedStorage
from weightwire.core.devices import DeviceRef
from weightwire.server.cuda_import import CudaIpcMapping
from weightwire.server.views import ViewItem, batch_views, in_place_plan


class KeptBytes:
    """A mapping whose bytes stay in place (as a CUDA IPC storage does): counts its fetches."""

    def __init__(self, flat: torch.Tensor, memo: bool) -> None:
        self.flat = flat
        self.fetches = 0
        self.view_memo: dict[int, tuple[object, list[torch.Tensor]]] | None = {} if memo else None

    def fetch(self, batch: object) -> torch.Tensor:
        self.fetches += 1
        return self.flat


class CountingEvent:
    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_remembered_views_show_each_new_bucket() -> None:
    flat = torch.zeros(64, dtype=torch.uint8)
    (batch,) = in_place_plan(["a", "b"], [ViewItem.of(0, torch.float32, (2, 2)), ViewItem.of(32, torch.int64, (3,))])
    mapping = KeptBytes(flat, memo=True)
    first = batch_views(mapping, batch)
    for value in (1, 2, 3):
        flat[:16].view(torch.float32).fill_(float(value))
        flat[32:56].view(torch.int64).fill_(value * 10)
        again = batch_views(mapping, batch)
        assert again is first
        assert again[0].tolist() == [[float(value)] * 2] * 2 and again[1].tolist() == [value * 10] * 3
    assert mapping.fetches == 4


def test_a_misaligned_tensor_is_copied_every_time_never_remembered() -> None:
    flat = torch.zeros(64, dtype=torch.uint8)
    (batch,) = in_place_plan(["odd"], [ViewItem.of(3, torch.float32, (2,))])
    mapping = KeptBytes(flat, memo=True)
    assert batch_views(mapping, batch)[0].tolist() == [0.0, 0.0]
    flat[3:11].view(torch.uint8).copy_(torch.tensor([5.0, 6.0]).view(torch.uint8))
    assert batch_views(mapping, batch)[0].tolist() == [5.0, 6.0]
    assert mapping.view_memo == {}


def test_a_mapping_without_memo_gets_new_views() -> None:
    (batch,) = in_place_plan(["a"], [ViewItem.of(0, torch.uint8, (4,))])
    mapping = KeptBytes(torch.arange(8, dtype=torch.uint8), memo=False)
    assert batch_views(mapping, batch) is not batch_views(mapping, batch)


def test_cuda_mapping_waits_once_before_its_first_read_and_drops_its_memo_on_close() -> None:
    flat = torch.arange(32, dtype=torch.uint8)
    event = CountingEvent()
    memo: dict[int, tuple[object, list[torch.Tensor]]] = {}
    mapping = CudaIpcMapping(OpenedStorage(flat, 0, False, 0, ready_event=event, view_memo=memo), DeviceRef.cuda("abc"), False)
    assert event.waits == 0  # nothing is read at open
    (batch,) = in_place_plan(["a"], [ViewItem.of(8, torch.uint8, (4,))])
    assert batch_views(mapping, batch)[0].tolist() == [8, 9, 10, 11]
    mapping.crc32(4)
    assert event.waits == 1 and len(memo) == 1
    mapping.close()
    assert mapping.view_memo is None
    # The next bucket's use of the same kept storage waits again, and finds the views.
    again = CudaIpcMapping(OpenedStorage(flat, 0, False, 0, ready_event=event, view_memo=memo), DeviceRef.cuda("abc"), False)
    assert batch_views(again, batch) is memo[id(batch)][1]
    assert event.waits == 2
    # No event: nothing to wait for.
    plain = CudaIpcMapping(OpenedStorage(flat, 0, False, 0), DeviceRef.cuda("abc"), False)
    assert plain.fetch(batch).numel() == 32
