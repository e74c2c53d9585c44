"""Block-FP8 experts under expert parallelism (SGLang 0.5.23, TP2 with EP2, on CPU).

The model and rank processes of test_sglang_fp8_moe.py, built with ``ep_size=2``: each rank holds
two of the four experts whole (EP rank 0 experts 0-1, rank 1 experts 2-3), their FP8 weights and
per-block scales unsliced. Each rank's manifest must list only its own experts' weights and scales,
whole; after a FULL push every parameter of both ranks equals, byte for byte, a fresh model loaded
from the pushed checkpoint by SGLang's ``load_weights``, and a FULL update without a scale of an
expert only one rank holds is refused before anything is sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fp8_moe_checks import SPEC, fp8_checkpoint
from test_sglang_fp8_moe import Ranks, push_and_compare, start
from test_sglang_fp8_moe import pytestmark as fp8_moe_marks
from weightwire.client import PlanError, WeightPusher
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = fp8_moe_marks  # the same marks, and skipped without sglang

EP = 2


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Ranks, WeightPusher, Path]]:
    yield from start(tmp_path_factory, EP)


def test_each_rank_owns_its_experts_whole_and_a_push_lands(running: tuple[Ranks, WeightPusher, Path]) -> None:
    ranks, pusher, root = running
    manifests = pusher.manifests()
    full = fp8_checkpoint(seed=1)
    per_rank = SPEC.num_experts // EP
    for m in manifests.values():
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

    push_and_compare(ranks, pusher, root, fp8_checkpoint(seed=2), version=1)

    # A FULL update without a scale of expert 3 (EP rank 1's only): refused, both ranks unchanged.
    scale = "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"
    with pytest.raises(PlanError) as missing:
        pusher.push({n: t for n, t in fp8_checkpoint(seed=3).items() if n != scale}, version=2)
    assert missing.value.reason == "INCOMPLETE_UPDATE" and scale in str(missing.value)
    assert {(s.weights_version, s.state) for s in pusher.status().values()} == {
        (1, pb.WORKER_STATE_CONSISTENT)
    }
