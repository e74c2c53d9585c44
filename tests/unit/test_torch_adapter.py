"""TorchAdapter and the demo model: manifests (full shapes, PP stages), TP slicing on load."""

from __future__ import annotations

import pytest
import torch
from weightwire.adapters.torch import (
    TorchAdapter,
    TPRule,
    _spread,
    default_worker_id,
    shard_tensor,
    tp_split_dim,
)
from weightwire.adapters.torch.demo import (
    DEMO_TP_RULES,
    DemoConfig,
    build_demo_model,
    checkpoint_shapes,
    expected_shard,
    full_checkpoint,
)
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ParallelRank
from weightwire.v1 import weight_transfer_pb2 as pb

CONFIG = DemoConfig()
HOST = DeviceRef.host("b0070000-0000-0000-0000-000000000000")


def adapter_for(rank: ParallelRank, seed: int = 0) -> TorchAdapter:
    model = build_demo_model(CONFIG, rank, "cpu", seed)
    return TorchAdapter(
        model,
        rank=rank,
        device=torch.device("cpu"),
        own_device=HOST,
        tp_rules=DEMO_TP_RULES,
        num_layers=CONFIG.num_layers,
    )


@pytest.mark.parametrize(
    ("name", "dim"),
    [
        ("model.layers.0.self_attn.q_proj.weight", 0),
        ("model.layers.12.self_attn.v_proj.weight", 0),
        ("model.layers.3.self_attn.o_proj.weight", 1),
        ("model.layers.3.mlp.gate_proj.weight", 0),
        ("model.layers.3.mlp.up_proj.weight", 0),
        ("model.layers.3.mlp.down_proj.weight", 1),
        ("model.embed_tokens.weight", 0),
        ("lm_head.weight", 0),
        ("model.layers.3.input_layernorm.weight", None),
        ("model.norm.weight", None),
    ],
)
def test_demo_tp_rules(name: str, dim: int | None) -> None:
    assert tp_split_dim(name, DEMO_TP_RULES) == dim


@pytest.mark.parametrize(
    ("rank", "worker_id"),
    [
        (ParallelRank(), "tp0-pp0"),
        (ParallelRank(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2), "tp1-pp1"),
        (ParallelRank(dp_rank=1, dp_size=2), "tp0-pp0-dp1"),
        (ParallelRank(sp_rank=1, sp_size=2), "tp0-pp0-sp1"),
        (ParallelRank(dp_rank=0, dp_size=2, sp_rank=1, sp_size=2), "tp0-pp0-dp0-sp1"),
    ],
)
def test_default_worker_id(rank: ParallelRank, worker_id: str) -> None:
    assert default_worker_id(rank) == worker_id


@pytest.mark.parametrize(
    ("pp_rank", "pp_size", "layers", "first", "last"),
    [
        (0, 1, [0, 1, 2, 3], True, True),
        (0, 2, [0, 1], True, False),
        (1, 2, [2, 3], False, True),
        (0, 3, [0], True, False),  # 4 layers over 3 stages: the last stage gets the extra layer
        (1, 3, [1], False, False),
        (2, 3, [2, 3], False, True),
    ],
)
def test_manifest_pp_stage(pp_rank: int, pp_size: int, layers: list[int], first: bool, last: bool) -> None:
    from weightwire.core.topology import pp_layer_span

    span = pp_layer_span(4, pp_rank, pp_size)
    assert list(range(span.start, span.end)) == layers
    manifest = adapter_for(ParallelRank(pp_rank=pp_rank, pp_size=pp_size)).manifest()
    names = set(manifest.tensors)
    assert ("model.embed_tokens.weight" in names) is first
    assert ("lm_head.weight" in names) is last and ("model.norm.weight" in names) is last
    held = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
    assert sorted(held) == layers
    assert (manifest.layer_start, manifest.layer_end, manifest.num_layers) == (layers[0], layers[-1] + 1, 4)


@pytest.mark.parametrize("tp", [(0, 2), (1, 2), (3, 4)])
def test_manifest_lists_full_checkpoint_shapes(tp: tuple[int, int]) -> None:
    rank = ParallelRank(tp_rank=tp[0], tp_size=tp[1])
    manifest = adapter_for(rank).manifest()
    shapes = checkpoint_shapes(CONFIG)
    assert set(manifest.tensors) == set(shapes)
    for name, owned in manifest.tensors.items():
        assert owned.shape == shapes[name]
        assert owned.dtype == pb.DTYPE_FLOAT32
    assert manifest.device == HOST
    assert manifest.worker_id == f"tp{tp[0]}-pp0"


def test_fingerprint_differs_per_rank_and_per_instance() -> None:
    a, b = adapter_for(ParallelRank(tp_rank=0, tp_size=2)), adapter_for(ParallelRank(tp_rank=1, tp_size=2))
    again = adapter_for(ParallelRank(tp_rank=0, tp_size=2))
    assert len({a.manifest().fingerprint, b.manifest().fingerprint, again.manifest().fingerprint}) == 3


def test_full_checkpoint_deterministic_per_seed() -> None:
    one, same, other = full_checkpoint(CONFIG, 1), full_checkpoint(CONFIG, 1), full_checkpoint(CONFIG, 2)
    assert list(one) == list(checkpoint_shapes(CONFIG))
    assert all(torch.equal(one[k], same[k]) for k in one)
    assert not any(torch.equal(one[k], other[k]) for k in one)


@pytest.mark.parametrize(
    "rank",
    [
        ParallelRank(),
        ParallelRank(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2),
        ParallelRank(tp_rank=2, tp_size=4, pp_rank=0, pp_size=2),
    ],
    ids=str,
)
def test_load_slices_full_tensors_into_the_shard(rank: ParallelRank) -> None:
    adapter = adapter_for(rank, seed=0)
    initial = expected_shard(full_checkpoint(CONFIG, 0), rank, CONFIG)
    assert all(torch.equal(adapter.state()[k], v) for k, v in initial.items())
    full = full_checkpoint(CONFIG, 7)
    owned = adapter.manifest().tensors
    adapter.load([(k, v) for k, v in full.items() if k in owned])
    want = expected_shard(full, rank, CONFIG)
    state = adapter.state()
    assert sorted(state) == sorted(want)
    for name, t in want.items():
        assert torch.equal(state[name], t), name


def test_shard_tensor_slices() -> None:
    full = torch.arange(24.0).view(4, 6)
    rules = (TPRule(r"^col$", 0), TPRule(r"^row$", 1))
    assert torch.equal(shard_tensor("col", full, ParallelRank(tp_rank=1, tp_size=2), rules), full[2:])
    assert torch.equal(shard_tensor("row", full, ParallelRank(tp_rank=2, tp_size=3), rules), full[:, 4:])
    assert shard_tensor("other", full, ParallelRank(tp_rank=1, tp_size=2), rules) is full


def test_load_refuses_a_tensor_that_does_not_fit() -> None:
    adapter = adapter_for(ParallelRank())
    with pytest.raises(ValueError, match="does not fit"):
        adapter.load([("model.norm.weight", torch.zeros(CONFIG.hidden_size * 2))])


def test_generic_module_replicated_and_split() -> None:
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 3, bias=False)  # "a.weight", split rows over TP
            self.b = torch.nn.Parameter(torch.zeros(5))  # replicated

    rank = ParallelRank(tp_rank=1, tp_size=2)
    adapter = TorchAdapter(
        Tiny(), rank=rank, device=torch.device("cpu"), own_device=HOST, tp_rules=[TPRule(r"^a\.", 0)]
    )
    tensors = adapter.manifest().tensors
    assert tensors["a.weight"].shape == (6, 4) and tensors["b"].shape == (5,)
    full_a = torch.arange(24.0).view(6, 4)
    adapter.load([("a.weight", full_a), ("b", torch.ones(5))])
    assert torch.equal(adapter.module.a.weight, full_a[3:])
    assert torch.equal(adapter.module.b, torch.ones(5))


@pytest.mark.parametrize("group_copy_max_bytes", [0, 1024, 1 << 30], ids=["each", "mixed", "all-grouped"])
@pytest.mark.parametrize("rank", [ParallelRank(), ParallelRank(tp_rank=1, tp_size=2)], ids=str)
def test_grouped_and_single_copies_load_the_same_bytes(group_copy_max_bytes: int, rank: ParallelRank) -> None:
    # 0: every parameter copied on its own; 1 KiB: norms grouped, matrices single (on the demo
    # model both kinds occur, and TP slices are non-contiguous views); 1 GiB: everything grouped.
    model = build_demo_model(CONFIG, rank, "cpu", 0)
    adapter = TorchAdapter(
        model,
        rank=rank,
        device=torch.device("cpu"),
        own_device=HOST,
        tp_rules=DEMO_TP_RULES,
        num_layers=CONFIG.num_layers,
        group_copy_max_bytes=group_copy_max_bytes,
    )
    plans = adapter._plans.values()
    assert any(p.grouped for p in plans) == (group_copy_max_bytes > 0)
    assert all(p.grouped for p in plans) == (group_copy_max_bytes >= 1 << 30)
    full = full_checkpoint(CONFIG, 11)
    adapter.load(list(full.items()))
    for name, t in expected_shard(full, rank, CONFIG).items():
        assert torch.equal(adapter.state()[name], t), name


def test_a_misfit_tensor_writes_nothing() -> None:
    # Shapes are checked before any copy, grouped or not: a bad last tensor leaves the first as it was.
    adapter = adapter_for(ParallelRank())
    before = adapter.state()["model.norm.weight"].clone()
    with pytest.raises(ValueError, match="does not fit"):
        adapter.load(
            [
                ("model.norm.weight", torch.full_like(before, 3.0)),
                ("model.embed_tokens.weight", torch.zeros(3)),
            ]
        )
    assert torch.equal(adapter.state()["model.norm.weight"], before)


def test_negative_group_copy_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="group_copy_max_bytes"):
        TorchAdapter(
            torch.nn.Linear(2, 2),
            rank=ParallelRank(),
            device=torch.device("cpu"),
            own_device=HOST,
            group_copy_max_bytes=-1,
        )


def test_copy_streams_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="copy_streams"):
        TorchAdapter(
            torch.nn.Linear(2, 2),
            rank=ParallelRank(),
            device=torch.device("cpu"),
            own_device=HOST,
            copy_streams=0,
        )


def test_large_copies_are_dealt_to_the_lane_with_the_fewest_bytes() -> None:
    # Lane 0 (the current stream) starts with the grouped copy's bytes; each large copy, in order,
    # goes to the lane that has the fewest bytes so far.
    pairs = [
        (torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)) for n in (100, 60, 50, 30, 20)
    ]
    lanes = _spread(pairs, [70, 0])
    sizes = [[d.numel() for d, _ in lane] for lane in lanes]
    assert sizes == [[60, 30], [100, 50, 20]]
    assert _spread(pairs, [0]) == [pairs]
