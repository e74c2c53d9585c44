"""Block-FP8 experts in ``adapters.layout_rules.expert_shards``: the rule both engine adapters state
their fused FP8 expert parameters with (weights and ``_scale_inv``), checked on the cases the
engine tests cannot build (SGLang and vLLM refuse most misaligned expert sizes themselves)."""

from __future__ import annotations

import pytest
from weightwire.adapters.layout_rules import ManifestError, check_expert_param, expert_leaf, expert_shards
from weightwire.core.manifest import TensorPiece

NAMES = ("gate_proj", "up_proj", "down_proj")
BLOCK = (128, 128)


def shards(
    leaf: str, local: tuple[int, ...], *, per_rank: int, rows: tuple[int, int, int], hidden: int = 256
):
    return expert_shards(
        "model.layers.0.mlp.experts." + leaf,
        leaf,
        local,
        experts=2,
        hidden=hidden,
        per_rank=per_rank,
        rows=rows,
        names=NAMES,
        block=BLOCK,
    )


def test_scales_keep_the_blocks_of_the_weights_slice() -> None:
    # TP rank 1 of 2, intermediate 512: rows [256, 512) of gate/up, the same columns of down.
    w13 = shards("w13_weight_scale_inv", (2, 4, 2), per_rank=256, rows=(256, 256, 512))
    assert w13 == (
        ("w1", "gate_proj", (4, 2), (TensorPiece(0, 2, 2),)),
        ("w3", "up_proj", (4, 2), (TensorPiece(0, 2, 2),)),
    )
    (w2,) = shards("w2_weight_scale_inv", (2, 2, 2), per_rank=256, rows=(256, 256, 512))
    assert w2 == ("w2", "down_proj", (2, 4), (TensorPiece(1, 2, 2),))
    # Whole experts (EP, MoE-TP 1): no pieces; a partial last block at the tensor's end is whole.
    (down,) = shards("w2_weight_scale_inv", (2, 3, 2), per_rank=256, rows=(0, 256, 256), hidden=300)
    assert down == ("w2", "down_proj", (3, 2), ())
    assert expert_leaf("w2_weight_scale_inv") == "weight_scale_inv" and expert_leaf("w13_weight") == "weight"


def test_a_split_block_is_refused_naming_the_layer() -> None:
    with pytest.raises(
        ManifestError, match=r"experts\.w13_weight: rows \[64, 128\) of 128 split a 128 x 128"
    ):
        shards("w13_weight", (2, 128, 256), per_rank=64, rows=(64, 64, 128))
    with pytest.raises(ManifestError, match=r"experts\.w2_weight_scale_inv: columns \[192, 384\)"):
        shards("w2_weight_scale_inv", (2, 2, 2), per_rank=192, rows=(192, 192, 384))
    # Whole experts whose gate rows end inside a block: gate and up would share a scale block.
    with pytest.raises(ManifestError, match="96 gate/up rows per rank do not fill whole 128-row FP8 blocks"):
        shards("w13_weight", (2, 192, 256), per_rank=96, rows=(0, 96, 96))


def test_local_shapes_and_leaves_are_checked() -> None:
    with pytest.raises(
        ManifestError, match=r"holds shape \(2, 4, 4\) but the layer's sizes imply \(2, 4, 2\)"
    ):
        shards("w13_weight_scale_inv", (2, 4, 4), per_rank=256, rows=(256, 256, 512))
    check_expert_param("x.w13_weight_scale_inv", "w13_weight_scale_inv", "Fp8MoEMethod", BLOCK)
    with pytest.raises(ManifestError, match="expert parameter 'w13_weight_scale_inv'"):
        check_expert_param("x.w13_weight_scale_inv", "w13_weight_scale_inv", "UnquantizedFusedMoEMethod")
    with pytest.raises(ManifestError, match=r"experts are quantized \(AWQMoEMethod\)"):
        check_expert_param("x.w13_weight", "w13_weight", "AWQMoEMethod")
    with pytest.raises(ManifestError, match="expert parameter 'w13_input_scale'"):
        check_expert_param("x.w13_input_scale", "w13_input_scale", "Fp8MoEMethod", BLOCK)
