"""Read plans and views: every owned tensor comes out of its batch with exactly its bytes, a copying
plan reads only (near) owned ranges and keeps each batch within its chunk, misaligned tensors are
copied, empty ones made, and nothing is viewed outside the fetched bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from weightwire.core.errors import WeightwireError
from weightwire.server.rules.views import (
    ALIGN_BYTES,
    MAX_GAP_BYTES,
    ReadBatch,
    ViewItem,
    copy_plan,
    in_place_plan,
    views_over,
)

DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64)


def _fetch(source: torch.Tensor, batch: ReadBatch) -> torch.Tensor:
    """What a copying payload does: each segment into its place in a fresh staging buffer."""
    staging = torch.full((batch.size_bytes,), 0xAB, dtype=torch.uint8)
    for seg in batch.segments:
        staging[seg.staging_at : seg.staging_at + seg.end - seg.start] = source[seg.start : seg.end]
    return staging


def _holds(view: torch.Tensor, source: torch.Tensor, item: ViewItem) -> bool:
    """``view`` is ``item``'s tensor over exactly its bytes of ``source`` (compared as bytes: NaN
    patterns are not equal to themselves as floats)."""
    if (view.dtype, tuple(view.shape)) != (item.dtype, item.shape):
        return False
    if item.numel == 0:
        return True
    raw = view.contiguous().view(-1).view(torch.uint8)
    return torch.equal(raw, source[item.offset_bytes : item.offset_bytes + item.nbytes])


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[ViewItem], int]:
    count = draw(st.integers(min_value=1, max_value=12))
    items = []
    end = 0
    for _ in range(count):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=3)))
        offset = draw(
            st.one_of(
                st.integers(
                    min_value=0, max_value=max(0, end + 3 * MAX_GAP_BYTES)
                ),  # gaps, overlaps, misalignment
                st.just(end - end % 64),
            )
        )
        item = ViewItem.of(offset, dtype, shape)
        items.append(item)
        end = max(end, offset + item.nbytes)
    return items, end


@settings(max_examples=200, deadline=None, database=None)
@given(layout=layouts(), chunk=st.sampled_from([64, 256, 4096, 1 << 20, 1 << 30]))
def test_copy_plan_reads_every_tensor_exactly(layout: tuple[list[ViewItem], int], chunk: int) -> None:
    items, end = layout
    names = [f"t{i}" for i in range(len(items))]
    source = torch.randint(0, 256, (max(end, 1),), dtype=torch.uint8)
    plan = copy_plan(names, items, chunk)
    seen: dict[str, torch.Tensor] = {}
    for batch in plan:
        largest = max(i.nbytes for i in batch.items)
        # A batch stays within its chunk, or holds a single tensor that is larger than it.
        assert batch.size_bytes <= chunk or (len(batch.items) == 1 and largest + ALIGN_BYTES > chunk)
        for seg in batch.segments:
            assert seg.start % ALIGN_BYTES == 0 and seg.staging_at % ALIGN_BYTES == 0
        for name, view in zip(
            batch.names, views_over(_fetch(source, batch), batch.positions, batch.items), strict=True
        ):
            seen[name] = view.clone()
    assert sorted(seen) == sorted(names)
    for name, item in zip(names, items, strict=True):
        assert _holds(seen[name], source, item), name


def test_copy_plan_skips_large_unowned_gaps() -> None:
    a = ViewItem.of(0, torch.float32, (16,))
    b = ViewItem.of(10 * MAX_GAP_BYTES, torch.float32, (16,))
    (batch,) = copy_plan(["a", "b"], [a, b], 1 << 20)
    assert [(s.start, s.end) for s in batch.segments] == [
        (0, 64),
        (10 * MAX_GAP_BYTES, 10 * MAX_GAP_BYTES + 64),
    ]
    assert batch.size_bytes == 128  # only the owned bytes are read


def test_in_place_plan_views_tensors_without_copying() -> None:
    source = torch.arange(256, dtype=torch.uint8)
    items = [
        ViewItem.of(64, torch.float32, (2, 2)),
        ViewItem.of(3, torch.float32, (1,)),
        ViewItem.of(0, torch.int64, (0, 5)),
    ]
    (batch,) = in_place_plan(["aligned", "misaligned", "empty"], items)
    aligned, misaligned, empty = views_over(source, batch.positions, batch.items)
    assert aligned.data_ptr() == source.data_ptr() + 64  # a view of the payload, not a copy
    assert _holds(aligned, source, items[0])
    assert misaligned.data_ptr() != source.data_ptr() + 3 and _holds(misaligned, source, items[1])
    assert empty.shape == (0, 5) and empty.dtype == torch.int64


def test_a_view_past_the_fetched_bytes_is_refused() -> None:
    with pytest.raises(WeightwireError) as err:
        views_over(torch.zeros(16, dtype=torch.uint8), [8], [ViewItem.of(8, torch.float32, (4,))])
    assert err.value.reason == "TENSOR_OUT_OF_BOUNDS"
