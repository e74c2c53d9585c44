"""An FSDP2 trainer of one rank pushes through the plain single-process path: nothing to agree on per
bucket and nothing to gather, so no lockstep exchanges (the multi-rank driver is never entered) and
the workers hold the checkpoint bit for bit, by named_parameters() and by state_dict()."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from fsdp_ranks import Fleet, grid
from helpers import demo_args, spawn_workers
from weightwire.adapters.torch.demo import DemoConfig, build_demo_model
from weightwire.client import WeightPusher
from weightwire.client.inputs.dtensor_gather import is_dtensor, single_rank_items
from weightwire.client.ranks import collective_push
from weightwire.core.manifest import ParallelRank

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    store = dist.FileStore(os.path.join(str(tmp_path_factory.mktemp("pg")), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    dump_dir = str(tmp_path_factory.mktemp("dumps"))
    workers = spawn_workers([demo_args(tp=(t, 2), dump_dir=dump_dir) for t in range(2)])
    f = Fleet(workers, grid(2, 1), dump_dir)
    try:
        yield f
    finally:
        f.stop()


def _sharded_model(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = build_demo_model(DemoConfig(), ParallelRank(), "cpu", seed=seed)
    for layer in model.model.layers.children():
        fully_shard(layer)
    fully_shard(model)
    return model


def test_single_rank_items_are_the_full_local_values(one_rank_group: object) -> None:
    model = _sharded_model(seed=3)
    items = list(model.state_dict().items())
    assert all(is_dtensor(t) for _, t in items)
    plain = single_rank_items(items, None)
    assert plain is not None and not any(is_dtensor(t) for _, t in plain)
    for (name, d), (name2, t) in zip(items, plain, strict=True):
        assert name == name2 and torch.equal(d.full_tensor(), t)


@pytest.mark.parametrize(("entry", "seed"), [("state_dict", 4), ("named_parameters", 5)])
def test_one_rank_fsdp2_push_takes_the_plain_path(
    one_rank_group: object, fleet: Fleet, monkeypatch: pytest.MonkeyPatch, entry: str, seed: int
) -> None:
    def no_lockstep(*args: object, **kwargs: object) -> None:
        raise AssertionError("a one-rank push entered the multi-rank driver")

    monkeypatch.setattr(collective_push, "push_from_ranks", no_lockstep)
    model = _sharded_model(seed)
    tensors = model.state_dict() if entry == "state_dict" else model.named_parameters()
    version = fleet.next_version()
    with WeightPusher(fleet.endpoints) as pusher:
        if entry == "state_dict":
            results = pusher.push(tensors, version=version)
        else:  # the demo model's buffers are not parameters; its weights all are
            results = pusher.push(tensors, version=version, scope="partial")
    assert {r.version for r in results.values()} == {version}
    fleet.assert_dumps(version, seed=seed)
