"""Block-quantised FP8 weights: the scale tensor each one carries, and which part of both a rank
keeps. Pure: no torch, no engine import.

The layout DeepSeek-V3 and Kimi-K2 checkpoints use (and SGLang's and vLLM's ``Fp8LinearMethod``
load with ``weight_block_size``): ``<module>.weight`` float8_e4m3fn ``[out, in]`` and
``<module>.weight_scale_inv`` float32 ``[ceil(out / bn), ceil(in / bk)]``, one scale per
``bn x bk`` block (128 x 128), the weight dequantised as ``weight * scale_inv`` block by block.
Both are checkpoint tensors of their own in a manifest.

A rank's tensor-parallel slice of the weight keeps whole blocks only: rows (or columns) starting on
a block boundary and ending on one or at the tensor's end, so its slice of the scale is exactly
the blocks' rows (columns) ``[offset / b, ceil(end / b))``. A slice that would split a block is
refused (``GeometryError``): no rank could dequantise its part with the scale alone. The
engines' own loaders compute the scale's shard the same way (SGLang 0.5.23 / vLLM 0.32
``layers/linear.py``: offsets and sizes divided by the block size, rounded up), and refuse such
layers themselves when they build them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weightwire.core.layer_geometry import Feed, GeometryError, LayerFeeds
from weightwire.core.manifest import TensorPiece

BLOCK = (128, 128)
WEIGHT_LEAF = "weight"
SCALE_LEAF = "weight_scale_inv"


def blocks(n: int, b: int) -> int:
    """How many blocks of ``b`` cover ``n`` (the last one may be partial)."""
    return -(-n // b)


def scale_name(weight_name: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv``."""
    if not weight_name.endswith("." + WEIGHT_LEAF):
        raise ValueError(f"{weight_name}: not a weight name (ends with .{WEIGHT_LEAF})")
    return weight_name[: -len(WEIGHT_LEAF)] + SCALE_LEAF


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a 2-D weight of ``weight_shape``."""
    if len(weight_shape) != 2:
        raise GeometryError(f"block-quantised weights are 2-D, got shape {weight_shape}")
    return blocks(weight_shape[0], block[0]), blocks(weight_shape[1], block[1])


def check_block_aligned(
    what: str, weight_shape: tuple[int, ...], pieces: tuple[TensorPiece, ...], block: tuple[int, int] = BLOCK
) -> None:
    """Refuse a slice of a block-quantised weight that does not start and end on block boundaries."""
    for p in pieces:
        b = block[p.dim]
        if p.offset % b or (p.end % b and p.end != weight_shape[p.dim]):
            axis = "rows" if p.dim == 0 else "columns"
            raise GeometryError(
                f"{what}: {axis} [{p.offset}, {p.end}) of {weight_shape[p.dim]} split a {block[0]} x {block[1]} "
                "FP8 block; a slice of a block-quantised weight must start and end on block boundaries "
                f"(multiples of {b}, or the tensor's end)"
            )


def scale_pieces(
    what: str, weight_shape: tuple[int, ...], pieces: tuple[TensorPiece, ...], block: tuple[int, int] = BLOCK
) -> tuple[TensorPiece, ...]:
    """The part of ``weight_scale_inv`` that goes with ``pieces`` of the weight (block-aligned)."""
    check_block_aligned(what, weight_shape, pieces, block)
    out = []
    for p in pieces:
        b = block[p.dim]
        start = p.offset // b
        out.append(TensorPiece(p.dim, start, blocks(p.end, b) - start))
    return tuple(out)


def scale_feeds(what: str, weight: LayerFeeds, block: tuple[int, int] = BLOCK) -> LayerFeeds:
    """A block-quantised layer's ``weight_scale_inv``, from the feeds of its ``weight``: each
    checkpoint scale's shape and kept blocks, and the fused local parameter's shape (the
    components' kept blocks one after another, as the loaders place them)."""
    feeds = []
    rows = 0
    cols: int | None = None
    fused = len(weight.feeds) > 1
    for f in weight.feeds:
        if len(f.shape) != 2:
            raise GeometryError(f"{what}: block-quantised weights are 2-D, got {f.shape}")
        kept = list(f.shape)
        for p in f.pieces:
            kept[p.dim] = p.length
        if fused and kept[0] % block[0]:
            # The loaders place a fused component's scale rows at offset/b (rounded up): a component
            # ending inside a block would share that block's scale with the next one.
            raise GeometryError(
                f"{what}: fused component of {kept[0]} rows does not fill whole {block[0]}-row FP8 blocks"
            )
        pieces = scale_pieces(what, f.shape, f.pieces, block)
        feeds.append(Feed(f.component, f.shard_id, scale_shape(f.shape, block), pieces))
        rows += blocks(kept[0], block[0])
        c = blocks(kept[1], block[1])
        if cols is not None and c != cols:
            raise GeometryError(f"{what}: fused components keep different column blocks ({cols}, {c})")
        cols = c
    return LayerFeeds((rows, cols or 0), tuple(feeds))


def layer_feeds(
    what: str,
    rule: Callable[..., LayerFeeds],
    layer: Any,
    leaf: str,
    *args: Any,
    block: tuple[int, int] = BLOCK,
) -> LayerFeeds:
    """The feeds of parameter ``leaf`` of a block-quantised linear ``layer`` whose dense feeds
    ``rule(layer, leaf, *args)`` gives (``core.layer_geometry``): its ``weight``'s slices checked
    to keep whole blocks, its ``weight_scale_inv`` derived from them; other leaves (a bias) as
    ``rule`` states them."""
    if leaf not in (WEIGHT_LEAF, SCALE_LEAF):
        return rule(layer, leaf, *args)
    weight = rule(layer, WEIGHT_LEAF, *args)
    if leaf == SCALE_LEAF:
        return scale_feeds(what, weight, block)
    for feed in weight.feeds:
        check_block_aligned(what, feed.shape, feed.pieces, block)
    return weight
