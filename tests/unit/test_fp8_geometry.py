"""Block-FP8 slice geometry (core.fp8_geometry) and the trainer-side quantisation (core.fp8_quant)."""

from __future__ import annotations

import types

import pytest
import torch
from weightwire.core import fp8_geometry, layer_geometry
from weightwire.core.devices import DeviceRef
from weightwire.core.fp8_quant import dequantize_block, quantize_block, quantize_for
from weightwire.core.layer_geometry import GeometryError
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest, TensorPiece
from weightwire.v1 import weight_transfer_pb2 as pb


def test_scale_of_a_row_slice_is_the_same_blocks() -> None:
    pieces = (TensorPiece(0, 256, 128),)
    assert fp8_geometry.scale_pieces("w", (512, 300), pieces) == (TensorPiece(0, 2, 1),)
    assert fp8_geometry.scale_shape((512, 300)) == (4, 3)
    # A slice ending at the tensor's end may end inside a block: that block is its own.
    assert fp8_geometry.scale_pieces("w", (300, 256), (TensorPiece(0, 256, 44),)) == (TensorPiece(0, 2, 1),)


@pytest.mark.parametrize(
    "piece",
    [TensorPiece(0, 64, 128), TensorPiece(0, 0, 192), TensorPiece(1, 128, 64)],
)
def test_slice_splitting_a_block_is_refused(piece: TensorPiece) -> None:
    with pytest.raises(GeometryError, match="split a 128 x 128 FP8 block"):
        fp8_geometry.scale_pieces("x.weight", (512, 512), (piece,))


def _qkv(tp_size: int, tp_rank: int, heads: int, kv_heads: int, head: int = 128) -> layer_geometry.LayerFeeds:
    layer = types.SimpleNamespace(
        head_size=head,
        v_head_size=head,
        total_num_heads=heads,
        total_num_kv_heads=kv_heads,
        num_heads=heads // tp_size,
        num_kv_heads=max(1, kv_heads // tp_size),
        num_kv_head_replicas=max(1, tp_size // kv_heads),
        input_size=256,
    )
    return layer_geometry.qkv(layer, "weight", tp_rank, tp_rank)


def test_fused_qkv_scale_keeps_each_components_blocks() -> None:
    scale = fp8_geometry.scale_feeds("qkv", _qkv(2, 1, heads=4, kv_heads=2))
    assert scale.local == (2 + 1 + 1, 2)
    assert [f.shape for f in scale.feeds] == [(4, 2), (2, 2), (2, 2)]
    assert [f.pieces for f in scale.feeds] == [
        (TensorPiece(0, 2, 2),),
        (TensorPiece(0, 1, 1),),
        (TensorPiece(0, 1, 1),),
    ]


def test_fused_component_inside_a_block_is_refused() -> None:
    with pytest.raises(GeometryError, match="64 rows does not fill whole 128-row FP8 blocks"):
        fp8_geometry.scale_feeds("qkv", _qkv(2, 0, heads=4, kv_heads=2, head=32 * 2))


def test_layer_feeds_of_a_block_quantised_layer() -> None:
    """``layer_feeds`` wraps a dense rule: the weight's slices checked, the scale derived, the
    bias as the dense rule states it."""
    layer = types.SimpleNamespace(
        output_size=512, output_size_per_partition=256, input_size=384, input_size_per_partition=384
    )
    weight = fp8_geometry.layer_feeds("o", layer_geometry.column, layer, "weight", 1)
    assert weight == layer_geometry.column(layer, "weight", 1)
    scale = fp8_geometry.layer_feeds("o", layer_geometry.column, layer, "weight_scale_inv", 1)
    assert scale.local == (2, 3) and scale.feeds[0].shape == (4, 3)
    assert scale.feeds[0].pieces == (TensorPiece(0, 2, 2),)
    bias = fp8_geometry.layer_feeds("o", layer_geometry.column, layer, "bias", 1)
    assert bias == layer_geometry.column(layer, "bias", 1)
    with pytest.raises(GeometryError, match="split a 512 x 512 FP8 block"):
        fp8_geometry.layer_feeds("o", layer_geometry.column, layer, "weight", 1, block=(512, 512))
    with pytest.raises(GeometryError, match="split a 384 x 384 FP8 block"):
        fp8_geometry.layer_feeds("o", layer_geometry.column, layer, "weight_scale_inv", 1, block=(384, 384))


def test_quantize_block_round_trip_and_layout() -> None:
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, s = quantize_block(w)
    assert (q.dtype, q.shape, s.dtype, s.shape) == (torch.float8_e4m3fn, (300, 200), torch.float32, (3, 2))
    back = dequantize_block(q, s)
    # e4m3 keeps 3 mantissa bits: within 1/16 relative, plus the block's smallest step.
    assert torch.all((back - w.float()).abs() <= w.float().abs() / 16 + s.max() * 2**-9)
    # Each block's largest magnitude maps to the largest finite e4m3 value.
    assert q[:128, :128].float().abs().max() == 448.0


def test_quantize_for_follows_the_manifest() -> None:
    tensors = [
        OwnedTensor("a.weight", pb.DTYPE_FLOAT8_E4M3FN, (128, 128)),
        OwnedTensor("a.weight_scale_inv", pb.DTYPE_FLOAT32, (1, 1)),
        OwnedTensor("n.weight", pb.DTYPE_BFLOAT16, (128,)),
    ]
    m = ShardManifest.build(DeviceRef("cpu", "x"), ParallelRank(), tensors)
    a, n = torch.randn(128, 128).bfloat16(), torch.randn(128).bfloat16()
    out = dict(quantize_for([("a.weight", a), ("n.weight", n)], [m]))
    assert list(out) == ["a.weight", "a.weight_scale_inv", "n.weight"]
    assert out["a.weight"].dtype == torch.float8_e4m3fn and out["n.weight"] is n
    with pytest.raises(ValueError, match="quantised itself"):
        list(quantize_for([("a.weight", a), ("a.weight_scale_inv", torch.ones(1, 1))], [m]))
