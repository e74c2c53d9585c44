"""The torch adapter's per-piece application: a full tensor's delta applied to one rank's slice
gives exactly that slice of the new tensor, for every encoding, split dimension and rank."""

from __future__ import annotations

import pytest
import torch
from weightwire.adapters.torch.delta_pieces import apply_to_piece
from weightwire.core.delta import Encoding, encode
from weightwire.core.delta.encoding import as_bits
from weightwire.core.topology import tp_slice_bounds


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.2, 1.0])
@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_piece_becomes_its_slice_of_the_new_tensor(
    fraction: float, dim: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(int(fraction * 100) + 7 * dim)
    shape = (6, 10, 12)
    old = torch.randn(shape, generator=gen).to(dtype)
    new = old.clone()
    mask = torch.rand(shape, generator=gen) < fraction
    new[mask] += 1.0
    delta = encode(old, new)
    if fraction == 1.0:
        assert delta.encoding is Encoding.DENSE
    size = 3 if shape[dim] % 3 == 0 else 2
    for rank in range(size):
        start, end = tp_slice_bounds(shape[dim], rank, size)
        kept = old.narrow(dim, start, end - start).contiguous()
        apply_to_piece(kept, delta, shape, dim, start, end - start)
        want = new.narrow(dim, start, end - start).contiguous()
        assert torch.equal(as_bits(kept), as_bits(want)), (dim, rank)


def test_a_strided_piece_is_written_in_place() -> None:
    old = torch.arange(48, dtype=torch.float32).view(4, 12)
    new = old.clone()
    new[1, 7] = -1.0
    new[3, 2] = -2.0
    holder = old.clone().t()  # the piece lives in a transposed (non-contiguous) view
    kept = holder.t().narrow(1, 6, 6)
    assert not kept.is_contiguous()
    apply_to_piece(kept, encode(old, new), (4, 12), 1, 6, 6)
    assert torch.equal(kept, new.narrow(1, 6, 6))
