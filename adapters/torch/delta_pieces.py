"""A full checkpoint tensor's delta applied to the piece of it a worker keeps.

A ``Delta`` addresses the full tensor's row-major elements; a tensor-parallel worker keeps one
piece, ``[start, start + length)`` along one dimension with every other dimension whole. The
changes that fall inside the piece are written at their place in it; the rest are another rank's.
"""

from __future__ import annotations

import math

import torch
from weightwire.core.delta import Delta
from weightwire.core.delta.encoding import Encoding, as_bits, changed_positions

__all__ = ["apply_to_piece"]


def apply_to_piece(
    kept: torch.Tensor, delta: Delta, full_shape: tuple[int, ...], dim: int, start: int, length: int
) -> None:
    """Write the changes of ``delta`` (checked against ``full_shape``) that fall in the piece into
    ``kept`` (the piece, of shape ``full_shape`` with ``length`` along ``dim``), in place."""
    if delta.changed_count == 0:
        return
    bits = as_bits(kept)
    values = delta.values.to(kept.device).view(bits.dtype)
    if delta.encoding is Encoding.DENSE:
        bits.copy_(values.view(full_shape).narrow(dim, start, length))
        return
    positions = changed_positions(delta)
    assert positions is not None
    positions = positions.to(kept.device)
    inner = math.prod(full_shape[dim + 1 :])
    along = (positions // inner) % full_shape[dim]
    inside = (along >= start) & (along < start + length)
    positions, along, values = positions[inside], along[inside], values[inside]
    outer = positions // (inner * full_shape[dim])
    local = outer * (length * inner) + (along - start) * inner + positions % inner
    if bits.is_contiguous():
        bits.view(-1)[local] = values
    else:
        bits.index_put_(torch.unravel_index(local, bits.shape), values)
