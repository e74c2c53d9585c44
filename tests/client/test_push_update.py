"""An update of one bucket to one worker goes out as one PushUpdate call, and lands exactly as a
stream's would; several buckets, or a worker older than PushUpdate, get a PushWeights stream.

Real gRPC servers in the test process, so that the test can count which of the worker service's
two entry points (``push`` for a stream, ``push_update`` for the call) each update came through.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import torch
from weightwire.adapters.torch.demo import expected_shard, full_checkpoint
from weightwire.client import FlatBucket, PushError, WeightPusher, layout_flat, pack_into
from weightwire.core.errors import Reason
from weightwire.server.rpc.servicer import WeightTransferServicer
from weightwire.server.worker.service import WorkerService
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

_versions = itertools.count(1)


class EntryCounts:
    """Counts the calls of a WorkerService's ``push`` (streams) and ``push_update`` (whole updates)."""

    def __init__(self, service: WorkerService) -> None:
        self.stream = 0
        self.whole = 0
        push, push_update = service.push, service.push_update

        def counted_push(*args: Any, **kw: Any) -> Any:
            self.stream += 1
            return push(*args, **kw)

        def counted_push_update(*args: Any, **kw: Any) -> Any:
            self.whole += 1
            return push_update(*args, **kw)

        service.push = counted_push  # type: ignore[method-assign]
        service.push_update = counted_push_update  # type: ignore[method-assign]


def flat_buckets(
    pusher: WeightPusher, full: dict[str, torch.Tensor], owned: list[str], parts: int
) -> list[FlatBucket]:
    """The owned tensors in ``parts`` flat buckets in the pusher's shared memory."""
    names = sorted(owned)
    step = -(-len(names) // parts)
    out = []
    for i in range(0, len(names), step):
        named = [(n, full[n]) for n in names[i : i + step]]
        specs, size = layout_flat(named)
        buf = pusher.host_buffer(size)
        pack_into(buf, specs, [t for _, t in named])
        out.append(FlatBucket(buf, specs))
    return out


def assert_holds(worker: Any, full: dict[str, torch.Tensor]) -> None:
    want = expected_shard(full, worker.rank, worker.config)
    state = worker.state()
    assert sorted(state) == sorted(want)
    for name, t in want.items():
        assert torch.equal(state[name], t), name


def test_one_bucket_to_one_worker_is_one_push_update_call(inproc_worker: Callable[..., Any]) -> None:
    worker = inproc_worker(seed=0)
    counts = EntryCounts(worker.service)
    with WeightPusher([worker.address], timeout_s=60) as pusher:
        owned = list(pusher.manifests()[worker.address].tensors)
        for _ in range(2):
            v = next(_versions)
            full = full_checkpoint(worker.config, v)
            result = pusher.push_flat(flat_buckets(pusher, full, owned, 1), version=v)[worker.address]
            assert (result.version, result.buckets, result.tensors_loaded) == (v, 1, len(owned))
            assert_holds(worker, full)
        assert (counts.whole, counts.stream) == (2, 0)
        # push() of a model that fits one bucket takes the same call.
        v = next(_versions)
        full = full_checkpoint(worker.config, v)
        pusher.push({n: full[n] for n in owned}, version=v)
        assert_holds(worker, full)
        assert (counts.whole, counts.stream) == (3, 0)
        assert pusher.status()[worker.address].weights_version == v


def test_several_buckets_go_on_a_stream(inproc_worker: Callable[..., Any]) -> None:
    worker = inproc_worker(seed=0)
    counts = EntryCounts(worker.service)
    with WeightPusher([worker.address], timeout_s=60) as pusher:
        owned = list(pusher.manifests()[worker.address].tensors)
        v = next(_versions)
        full = full_checkpoint(worker.config, v)
        result = pusher.push_flat(flat_buckets(pusher, full, owned, 3), version=v)[worker.address]
        assert (result.version, result.buckets) == (v, 3)
        assert_holds(worker, full)
    assert (counts.whole, counts.stream) == (0, 1)


def test_a_refused_push_update_is_a_push_error_with_the_reason(inproc_worker: Callable[..., Any]) -> None:
    worker = inproc_worker(seed=0)
    counts = EntryCounts(worker.service)
    with WeightPusher([worker.address], timeout_s=60) as pusher:
        owned = list(pusher.manifests()[worker.address].tensors)
        v = next(_versions) + 100
        full = full_checkpoint(worker.config, v)
        pusher.push_flat(flat_buckets(pusher, full, owned, 1), version=v)
        stale = full_checkpoint(worker.config, v + 1)
        with pytest.raises(PushError) as info:
            pusher.push_flat(flat_buckets(pusher, stale, owned, 1), version=v)
        assert info.value.failures[worker.address].kind is Reason.STALE_VERSION
        status = pusher.status()[worker.address]
        assert status.weights_version == v and status.last_error.reason == "STALE_VERSION"
        assert_holds(worker, full)  # the refused bytes were not loaded
    assert (counts.whole, counts.stream) == (2, 0)


class _WithoutPushUpdate(WeightTransferServicer):
    """A worker as it was before PushUpdate existed: the generated base answers UNIMPLEMENTED."""

    PushUpdate = pb_grpc.WeightTransferServiceServicer.PushUpdate  # type: ignore[assignment]


@pytest.fixture
def older_worker(inproc_worker: Callable[..., Any], tmp_path: Any) -> Iterator[tuple[Any, str]]:
    """The demo worker's service behind a server that has no PushUpdate; (worker, address)."""
    worker = inproc_worker(seed=0)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_WeightTransferServiceServicer_to_server(_WithoutPushUpdate(worker.service), server)
    address = f"unix:{tmp_path / 'older.sock'}"
    server.add_insecure_port(address)
    server.start()
    try:
        yield worker, address
    finally:
        server.stop(grace=0)


def test_a_worker_without_push_update_gets_the_same_update_on_a_stream(older_worker: tuple[Any, str]) -> None:
    worker, address = older_worker
    counts = EntryCounts(worker.service)
    with WeightPusher([address], timeout_s=60) as pusher:
        owned = list(pusher.manifests()[address].tensors)
        for _ in range(2):
            v = next(_versions)
            full = full_checkpoint(worker.config, v)
            result = pusher.push_flat(flat_buckets(pusher, full, owned, 1), version=v)[address]
            assert result.version == v
            assert_holds(worker, full)
        # Asked once, then remembered: both updates went on a stream.
        assert not pusher._workers[address].accepts_push_update
        assert pusher.status()[address].weights_version == v
        assert pusher.status()[address].updates_failed == 0
    assert (counts.whole, counts.stream) == (0, 2)
