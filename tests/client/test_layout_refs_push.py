"""A pusher names the tensor specs a worker acked as kept (``Bucket.layout_id``) instead of sending
them again, on every path that reuses its specs (``push_flat`` of the same buckets, ``push`` of the
same names and shapes); a worker that let them go refuses (LAYOUT_UNKNOWN) and the same update goes
again with its specs, transparently.

A real gRPC server in the test process, so that the test can see what each bucket carried.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch
from weightwire.adapters.torch.demo import expected_shard, full_checkpoint
from weightwire.client import FlatBucket, WeightPusher, layout_flat, pack_into
from weightwire.server.rules import layout as layout_rules
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = pytest.mark.timeout(120)

_versions = itertools.count(1)


class Wire:
    """Each update's buckets as the worker service received them: (tensor specs, layout_id)."""

    def __init__(self, service: Any) -> None:
        self.updates: list[list[tuple[int, bytes]]] = []
        push, push_update = service.push, service.push_update

        def tap(requests: Iterable[pb.PushWeightsRequest]) -> Iterator[pb.PushWeightsRequest]:
            seen: list[tuple[int, bytes]] = []
            self.updates.append(seen)
            for r in requests:
                if r.HasField("bucket"):
                    seen.append((len(r.bucket.tensors), r.bucket.layout_id))
                yield r

        service.push = lambda requests, **kw: push(tap(requests), **kw)
        service.push_update = lambda requests, **kw: push_update(list(tap(requests)), **kw)


def assert_holds(worker: Any, full: dict[str, torch.Tensor]) -> None:
    want = expected_shard(full, worker.rank, worker.config)
    state = worker.state()
    assert sorted(state) == sorted(want)
    for name, t in want.items():
        assert torch.equal(state[name], t), name


def kept_buckets(
    pusher: WeightPusher, full: dict[str, torch.Tensor], names: list[str], parts: int
) -> list[FlatBucket]:
    """``names`` in ``parts`` flat buckets of the pusher's shared memory, refilled by ``refill``."""
    step = -(-len(names) // parts)
    out = []
    for i in range(0, len(names), step):
        specs, size = layout_flat([(n, full[n]) for n in names[i : i + step]])
        out.append(FlatBucket(pusher.host_buffer(size), specs))
    return out


def refill(buckets: list[FlatBucket], full: dict[str, torch.Tensor]) -> None:
    for b in buckets:
        pack_into(b.buffer, b.specs, [full[s.name] for s in b.specs])


def test_specs_go_once_then_by_reference(inproc_worker: Callable[..., Any]) -> None:
    worker = inproc_worker(seed=0)
    wire = Wire(worker.service)
    with WeightPusher([worker.address], timeout_s=60) as pusher:
        owned = sorted(pusher.manifests()[worker.address].tensors)
        first = full_checkpoint(worker.config, 1)
        buckets = kept_buckets(pusher, first, owned, 3)
        for _ in range(3):
            v = next(_versions)
            full = full_checkpoint(worker.config, v)
            refill(buckets, full)
            result = pusher.push_flat(buckets, version=v)[worker.address]
            assert (result.version, result.tensors_loaded) == (v, len(owned))
            assert_holds(worker, full)
        sent, *again = wire.updates
        ids = [i for _, i in sent]
        assert all(n > 0 for n, _ in sent) and len(set(ids)) == 3 and all(ids)
        assert again == [[(0, i) for i in ids]] * 2  # no specs, the same ids
        # push() of the same names and shapes: packed, planned once, referred to from the second on.
        wire.updates.clear()
        for _ in range(2):
            v = next(_versions)
            full = full_checkpoint(worker.config, v)
            pusher.push({n: full[n] for n in owned}, version=v)
            assert_holds(worker, full)
        assert [[n > 0 for n, _ in u] for u in wire.updates] == [[True], [False]]


def test_a_worker_that_let_the_specs_go_gets_them_again(
    inproc_worker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker keeps two layouts: the third bucket's pushes out the first's.
    monkeypatch.setattr(layout_rules, "MAX_LAYOUT_REFS", 2)
    worker = inproc_worker(seed=0)
    wire = Wire(worker.service)
    with WeightPusher([worker.address], timeout_s=60) as pusher:
        owned = sorted(pusher.manifests()[worker.address].tensors)
        buckets = kept_buckets(pusher, full_checkpoint(worker.config, 1), owned, 3)
        for _ in range(2):
            v = next(_versions)
            full = full_checkpoint(worker.config, v)
            refill(buckets, full)
            assert pusher.push_flat(buckets, version=v)[worker.address].version == v
            assert_holds(worker, full)
        with_specs, referred, again = wire.updates
        assert all(n > 0 for n, _ in with_specs) and all(n > 0 for n, _ in again)
        # The second push named the first bucket's specs, which the worker had let go: refused
        # before anything was loaded, then the same update went again with every bucket's specs.
        # (The worker may have read a bucket more off the stream before it ended the update.)
        assert referred[0] == (0, with_specs[0][1]) and all(n == 0 for n, _ in referred)
        status = pusher.status()[worker.address]
        assert status.weights_version == v and status.state == pb.WORKER_STATE_CONSISTENT
