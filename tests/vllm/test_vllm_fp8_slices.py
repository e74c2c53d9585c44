"""Every trainer rank a source into block-FP8 layers of vLLM's real loaders, TP2 on CPU.

The two FP8 rank processes of tests/vllm/test_vllm_fp8.py (vLLM 0.32's Qwen2 with every linear
layer block FP8, loaded by vLLM's own ``get_model`` under its real gloo TP2 parallel state, served
by the ``SlicesVLLMAdapter`` vLLM's backend builds) take a push from three trainer ranks of one
gloo world over a transfer group (``helpers.slice_trainer_main``; each rank a ``Shard(0)`` third
of every tensor, this file run as a script). Thirds of 256 rows (86/86/84) cut through the 128 x
128 blocks and the scales' rows (1/1/0): the trainer side needs no block alignment, because each
worker stages its kept region (its TP half, on whole blocks, of each weight and, as an owned tensor
of its own, of each ``weight_scale_inv``) from all the ranks' slices and loads it only once the
bucket is whole, through vLLM's reload (FP8 layers are never copied directly).

Checked: each worker received exactly its manifest's kept bytes (less than the model) over the
transfer group, and afterwards every parameter of both ranks equals, byte for byte, a fresh model
vLLM's loader built from the pushed checkpoint; a push from every rank missing one scale
(INCOMPLETE_UPDATE) and one of bf16 weights into the FP8 layers (DTYPE_MISMATCH) are refused with
both ranks' parameters unchanged.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import TrainerRanks, slice_trainer_main
from rank_fleet import assert_same_bytes
from test_vllm_fp8 import LINEARS, SPEC, Ranks, bf16_checkpoint, fp8_checkpoint, serving, write
from weightwire.client import WeightPusher

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MISSING = "model.layers.1.mlp.down_proj.weight_scale_inv"
# Seeds the trainer ranks map to hostile checkpoints (slice_trainer_main pushes checkpoint(seed)).
WITHOUT_SCALE, BF16 = 1000, 2000


def trainer_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    if seed >= BF16:
        return bf16_checkpoint(seed - BF16)
    if seed >= WITHOUT_SCALE:
        return {n: t for n, t in fp8_checkpoint(seed - WITHOUT_SCALE).items() if n != MISSING}
    return fp8_checkpoint(seed)


@pytest.fixture(scope="module")
def running(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Ranks, WeightPusher, Path, TrainerRanks]]:
    for ranks, pusher, root in serving(
        tmp_path_factory.mktemp("fp8-slices"), lambda d: write(fp8_checkpoint(seed=1), d)
    ):
        trainers = TrainerRanks(__file__, list(pusher.endpoints), world=3)
        try:
            yield ranks, pusher, root, trainers
        finally:
            trainers.close()


def test_slices_from_three_ranks_land_where_vllms_loader_puts_the_checkpoint(
    running: tuple[Ranks, WeightPusher, Path, TrainerRanks],
) -> None:
    ranks, pusher, root, trainers = running
    manifests = pusher.manifests()
    assert all(m.receives_slices for m in manifests.values()), manifests
    answers = trainers.push(version=1, seed=2)
    assert all(a["ok"] for a in answers), answers
    results = answers[0]["results"]
    assert set(results) == set(manifests)
    for address, r in results.items():
        m = manifests[address]
        assert (r["version"], r["state"], r["transport"]) == (1, "CONSISTENT", "transfer_group"), r
        assert r["bytes_received"] == m.kept_bytes < m.total_bytes, (address, r)
    pushed = ranks.dumps(root, "dump", "v1")
    want = ranks.dumps(root, f"reference {write(fp8_checkpoint(seed=2), root / 'ckpt2')}", "ref2")
    for r in range(2):
        assert_same_bytes(pushed[r], want[r], f"slices push, rank {r}")
    # The FP8 layers went through vLLM's reload (its post-load processing reran), never a copy.
    for answer in ranks.ask("direct"):
        direct = json.loads(answer)
        for layer in range(SPEC.layers):
            for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                name = f"model.layers.{layer}.{module}"
                assert name not in direct["proven"] and "quantized" in direct["refused"][name], direct


def test_slices_missing_a_scale_or_bf16_into_fp8_are_refused(
    running: tuple[Ranks, WeightPusher, Path, TrainerRanks],
) -> None:
    ranks, pusher, root, trainers = running
    before = ranks.dumps(root, "dump", "before-refusals")
    version = min(st.weights_version for st in pusher.status().values())
    for seed, reason, named in (
        (WITHOUT_SCALE + 3, "INCOMPLETE_UPDATE", MISSING),
        (BF16 + 3, "DTYPE_MISMATCH", "float8_e4m3fn"),
    ):
        answers = trainers.push(version=version + 1, seed=seed)
        assert not any(a["ok"] for a in answers), answers
        assert {a["reason"] for a in answers} == {reason}, answers
        assert named in answers[0]["message"], answers[0]["message"]
    assert {st.weights_version for st in pusher.status().values()} == {version}
    after = ranks.dumps(root, "dump", "after-refusals")
    for r in range(2):
        assert_same_bytes(after[r], before[r], f"refused slices pushes, rank {r}")
    assert any(f".{m}." in MISSING for m in LINEARS)


def _local_shards() -> None:
    """Every trainer rank builds the same full checkpoint, so each takes its own ``Shard(0)`` part
    without a scatter (``src_data_rank=None``): gloo has no float8 collectives, and an FSDP trainer
    holds its FP8 shards already."""
    import torch.distributed.tensor as dt

    scatter = dt.distribute_tensor
    dt.distribute_tensor = lambda t, mesh, placements: scatter(t, mesh, placements, src_data_rank=None)  # type: ignore[assignment]


if __name__ == "__main__":
    _local_shards()
    sys.exit(slice_trainer_main(sys.argv[1:], trainer_checkpoint))
