"""A bf16 (or float32) trainer pushing into an FP8 engine: block quantisation on the trainer side.

An engine serving a block-quantised FP8 checkpoint (DeepSeek-V3, Kimi-K2) publishes each such
layer as two checkpoint tensors, ``x.weight`` float8_e4m3fn and ``x.weight_scale_inv`` float32
(``core.fp8_geometry``). A trainer holds ``x.weight`` in bf16; pushing it as is is refused
(``DTYPE_MISMATCH``, naming both dtypes), and a plain cast to FP8 would be wrong (no scales, or the
old ones). ``quantize_for(named_tensors, manifests)`` is the documented way: every tensor the
engine holds as block FP8 is quantised here, 128 x 128 blocks, scale = block amax / 448, and its
``weight_scale_inv`` sent beside it; everything else passes through unchanged::

    pusher.push(quantize_for(model.state_dict().items(), pusher.manifests().values()), version=step)

The engine then holds exactly ``dequantize_block(q, scale_inv)`` for each such weight (what its
kernels compute with); ``quantize_block`` and ``dequantize_block`` are the same arithmetic as the
engines' own ``per_block_cast_to_fp8`` and ``block_quant_dequant``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from weightwire.core.fp8_geometry import BLOCK, SCALE_LEAF, WEIGHT_LEAF, blocks, scale_name
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)


def quantize_block(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, float32 weight_scale_inv)`` of a 2-D floating-point ``w``."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(
            f"block quantisation takes a 2-D floating-point tensor, got {w.dtype} {tuple(w.shape)}"
        )
    rows, cols = w.shape
    br, bc = blocks(rows, block[0]), blocks(cols, block[1])
    padded = torch.zeros(br * block[0], bc * block[1], dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(br, block[0], bc, block[1])
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    scale = amax / FP8_MAX
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(br * block[0], bc * block[1])
    return q[:rows, :cols].contiguous(), scale.view(br, bc).contiguous()


def dequantize_block(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """What an FP8 block-quantised weight stands for: ``q * scale_inv`` block by block."""
    rows, cols = q.shape
    s = (
        scale_inv.float()
        .repeat_interleave(block[0], dim=0)[:rows]
        .repeat_interleave(block[1], dim=1)[:, :cols]
    )
    return (q.float() * s).to(dtype)


def fp8_weight_names(manifests: Iterable[ShardManifest]) -> frozenset[str]:
    """Checkpoint names the engine holds as block FP8: a float8_e4m3fn ``x.weight`` whose
    ``x.weight_scale_inv`` the same manifest lists."""
    out: set[str] = set()
    for m in manifests:
        for name, t in m.tensors.items():
            if t.dtype == pb.DTYPE_FLOAT8_E4M3FN and name.endswith("." + WEIGHT_LEAF):
                if scale_name(name) in m.tensors:
                    out.add(name)
    return frozenset(out)


def quantize_for(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    manifests: Iterable[ShardManifest],
    block: tuple[int, int] = BLOCK,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_tensors`` as the engine's manifests hold them: each weight they list as block FP8
    quantised (unless it already is FP8), followed by its ``weight_scale_inv``; the rest unchanged.

    A tensor already in float8_e4m3fn passes through as is (the trainer then sends its own
    scales). A scale the trainer also sends for a weight quantised here is refused: two
    different scales for one weight."""
    fp8 = fp8_weight_names(manifests)
    made: set[str] = set()
    for name, t in named_tensors:
        if name in fp8 and t.dtype != FP8:
            q, s = quantize_block(t.detach(), block)
            made.add(scale_name(name))
            yield name, q
            yield scale_name(name), s
        elif name.endswith("." + SCALE_LEAF) and name in made:
            raise ValueError(f"{name}: sent by the trainer for a weight quantize_for quantised itself")
        else:
            yield name, t
