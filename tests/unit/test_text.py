"""core/text.py: the one home of bounded text on both sides."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from weightwire.core.text import clip, clip_utf8


@given(st.text(), st.integers(min_value=0, max_value=64))
def test_clip_is_bounded_and_keeps_short_text(text: str, limit: int) -> None:
    out = clip(text, limit)
    assert len(out) <= limit
    if len(text) <= limit:
        assert out == text
    elif limit > 3:
        assert out.endswith("...") and text.startswith(out[:-3])


@given(st.text(), st.integers(min_value=0, max_value=64))
def test_clip_utf8_is_bounded_in_bytes(text: str, limit: int) -> None:
    assert len(clip_utf8(text, limit).encode("utf-8", "surrogatepass")) <= limit


def test_clip_examples() -> None:
    assert clip("abcdefgh", 6) == "abc..."
    assert clip("abc", 3) == "abc"
    assert clip_utf8("ééé", 5) == "é..."
