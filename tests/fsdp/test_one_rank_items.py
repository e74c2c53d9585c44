"""``OneRankItems``: a one-rank FSDP2 trainer's DTensors as plain local tensors, each DTensor checked
once, its local tensor read at every push. The same tensors (storages, values) as
``single_rank_items``; a local tensor replaced since the push before is the one sent; anything that
is not whole locally still goes through ``single_rank_items``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from weightwire.adapters.torch.demo import DemoConfig, build_demo_model
from weightwire.client.inputs.dtensor_gather import is_dtensor, single_rank_items
from weightwire.client.update.one_rank import OneRankItems
from weightwire.core.manifest import ParallelRank

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    store = dist.FileStore(os.path.join(str(tmp_path_factory.mktemp("pg")), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _sharded_model(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = build_demo_model(DemoConfig(), ParallelRank(), "cpu", seed=seed)
    for layer in model.model.layers.children():
        fully_shard(layer)
    fully_shard(model)
    return model


def test_the_same_local_tensors_as_single_rank_items(one_rank_group: object) -> None:
    model = _sharded_model(seed=3)
    items = list(model.state_dict().items())
    memo = OneRankItems()
    for _ in range(2):  # checked once, then from the kept verdicts
        got = memo.items(items, None)
        want = single_rank_items(items, None)
        assert got is not None and want is not None
        assert [n for n, _ in got] == [n for n, _ in want]
        for (_, a), (_, b) in zip(got, want, strict=True):
            assert not is_dtensor(a) and not a.requires_grad
            assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_a_replaced_local_tensor_is_read_anew(one_rank_group: object) -> None:
    model = _sharded_model(seed=4)
    items = list(model.state_dict().items())
    memo = OneRankItems()
    memo.items(items, None)
    _, dt = items[0]
    new = torch.full_like(dt._local_tensor, 7.0)  # type: ignore[attr-defined]
    dt._local_tensor = new  # type: ignore[attr-defined]
    got = memo.items(items, None)
    assert got is not None and got[0][1].untyped_storage().data_ptr() == new.untyped_storage().data_ptr()
    assert torch.equal(got[0][1], new)


def test_plain_tensors_pass_through_and_a_group_goes_the_general_way(one_rank_group: object) -> None:
    model = _sharded_model(seed=5)
    items = [*model.state_dict().items(), ("extra", torch.ones(3))]
    memo = OneRankItems()
    got = memo.items(items, None)
    assert got is not None and got[-1][1] is items[-1][1]
    via_group = memo.items(items, one_rank_group)
    assert via_group is not None and len(via_group) == len(items)
