"""Views a kept mapping remembers (``views.batch_views``), the adapter's prepared load kept with them
(``views.batch_load``), the host shared-memory staging that keeps them, and the CUDA IPC mapping's
wait for its producer event, on CPU: a remembered view and a kept load still copy the bytes of each
new bucket, a copied (misaligned) tensor is never remembered, and every bucket fetches (waits)
again."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from weightwire.adapters.torch import TorchAdapter
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ParallelRank
from weightwire.core.transports.cuda_ipc import OpenedStorage
from weightwire.server.rules.views import ViewItem, batch_load, batch_views, copy_plan, in_place_plan
from weightwire.server.transports.cuda_ipc import CudaIpcMapping
from weightwire.server.transports.shm import _HostShmFile, _Staging


class KeptBytes:
    """A mapping whose bytes stay in place (as a CUDA IPC storage does): counts its fetches."""

    def __init__(self, flat: torch.Tensor, memo: bool) -> None:
        self.flat = flat
        self.fetches = 0
        self.view_memo: dict[int, object] | None = {} if memo else None

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
    (batch,) = in_place_plan(
        ["a", "b"], [ViewItem.of(0, torch.float32, (2, 2)), ViewItem.of(32, torch.int64, (3,))]
    )
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
    memo: dict[int, object] = {}
    mapping = CudaIpcMapping(
        OpenedStorage(flat, 0, False, 0, ready_event=event, view_memo=memo), DeviceRef.cuda("abc"), False
    )
    assert event.waits == 0  # nothing is read at open
    (batch,) = in_place_plan(["a"], [ViewItem.of(8, torch.uint8, (4,))])
    assert batch_views(mapping, batch)[0].tolist() == [8, 9, 10, 11]
    mapping.crc32(4)
    assert event.waits == 1 and len(memo) == 1
    mapping.close()
    assert mapping.view_memo is None
    # The next bucket's use of the same kept storage waits again, and finds the views.
    again = CudaIpcMapping(
        OpenedStorage(flat, 0, False, 0, ready_event=event, view_memo=memo), DeviceRef.cuda("abc"), False
    )
    assert batch_views(again, batch) is memo[id(batch)].views  # type: ignore[attr-defined]
    assert event.waits == 2
    # No event: nothing to wait for.
    plain = CudaIpcMapping(OpenedStorage(flat, 0, False, 0), DeviceRef.cuda("abc"), False)
    assert plain.fetch(batch).numel() == 32


class CountingAdapter:
    """An adapter with ``prepare_load`` (as TorchAdapter): counts how often it prepares and loads."""

    def __init__(self, inner: TorchAdapter) -> None:
        self.inner = inner
        self.prepared = 0
        self.loads = 0

    def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.loads += 1
        self.inner.load(named)

    def prepare_load(self, named: Sequence[tuple[str, torch.Tensor]]) -> Callable[[], None]:
        self.prepared += 1
        return self.inner.prepare_load(named)


def _tiny_adapter() -> TorchAdapter:
    module = torch.nn.Module()
    module.register_parameter("w", torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False))
    module.register_parameter("n", torch.nn.Parameter(torch.zeros(3), requires_grad=False))
    return TorchAdapter(
        module,
        rank=ParallelRank(),
        device=torch.device("cpu"),
        own_device=DeviceRef.host(),
        group_copy_max_bytes=12,
    )


def test_a_prepared_load_is_kept_with_remembered_views_and_copies_each_new_bucket() -> None:
    flat = torch.zeros(64, dtype=torch.uint8)
    (batch,) = in_place_plan(
        ["w", "n"], [ViewItem.of(0, torch.float32, (2, 2)), ViewItem.of(32, torch.float32, (3,))]
    )
    mapping = KeptBytes(flat, memo=True)
    adapter = CountingAdapter(_tiny_adapter())
    for value in (1.0, 2.0, 3.0):
        flat[:16].view(torch.float32).fill_(value)
        flat[32:44].view(torch.float32).fill_(-value)
        views = batch_views(mapping, batch)
        batch_load(mapping, batch, views, adapter)()
        assert adapter.inner.state()["w"].tolist() == [[value] * 2] * 2
        assert adapter.inner.state()["n"].tolist() == [-value] * 3
    assert adapter.prepared == 1 and adapter.loads == 0
    # Views nobody remembers (a mapping without memo) go through load every time.
    plain = KeptBytes(flat, memo=False)
    batch_load(plain, batch, batch_views(plain, batch), adapter)()
    assert adapter.loads == 1 and adapter.prepared == 1


def test_an_adapter_without_prepare_load_gets_load() -> None:
    flat = torch.zeros(64, dtype=torch.uint8)
    (batch,) = in_place_plan(["n"], [ViewItem.of(32, torch.float32, (3,))])
    mapping = KeptBytes(flat, memo=True)
    inner = _tiny_adapter()

    class LoadOnly:
        calls = 0

        def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
            LoadOnly.calls += 1
            inner.load(named)

    for _ in range(2):
        batch_load(mapping, batch, batch_views(mapping, batch), LoadOnly())()
    assert LoadOnly.calls == 2


def test_prepare_load_checks_shapes_up_front() -> None:
    adapter = _tiny_adapter()
    with pytest.raises(ValueError, match="does not fit"):
        adapter.prepare_load([("w", torch.zeros(3))])


def test_host_shm_staging_keeps_views_until_it_is_replaced(tmp_path: Path) -> None:
    """Host shared memory is read into the importer's kept staging buffer, each batch to the same
    place every time: its views are remembered, show each new update's bytes, and are forgotten
    when the buffer grows or is let go."""
    staging = _Staging(64)
    items = [ViewItem.of(0, torch.float32, (4,)), ViewItem.of(16, torch.int32, (2,))]
    (batch,) = copy_plan(["a", "b"], items, 1 << 20)
    path = tmp_path / "segment"

    def write(values: tuple[float, int]) -> _HostShmFile:
        floats = torch.full((4,), values[0]).view(torch.uint8)
        ints = torch.full((2,), values[1], dtype=torch.int32).view(torch.uint8)
        data = torch.cat([floats, ints])
        path.write_bytes(bytes(data.numpy()))
        return _HostShmFile("segment", os.open(path, os.O_RDONLY), data.numel(), staging)

    first_views = None
    for value in ((1.5, 7), (2.5, 8)):  # two updates, a new file each (as a new segment would be)
        mapping = write(value)
        views = batch_views(mapping, batch)
        first_views = first_views or views
        assert views is first_views
        assert views[0].tolist() == [value[0]] * 4 and views[1].tolist() == [value[1]] * 2
        mapping.close()
    staging.get(1024)  # a larger batch replaces the buffer: what was remembered over it goes
    assert staging.view_memo == {}
    mapping = write((3.5, 9))
    views = batch_views(mapping, batch)
    assert views is not first_views and views[0].tolist() == [3.5] * 4 and views[1].tolist() == [9] * 2
    staging.release()
    assert staging.view_memo == {}
    mapping.close()
