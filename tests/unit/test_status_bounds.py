"""A status always fits a default client's trailer limit, whatever text it quotes; the cut text is a
prefix of the original, cut at a character boundary, measured in UTF-8 bytes."""

from __future__ import annotations

from google.rpc import error_details_pb2, status_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.text import clip_utf8
from weightwire.server.rpc.servicer import TRAILER_BUDGET_BYTES, _percent_encoded_len, to_rpc_status

TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=6000)


def _unpacked(err: WeightwireError) -> tuple[str, error_details_pb2.ErrorInfo, int]:
    status = to_rpc_status(err)
    details = dict(status.trailing_metadata)["grpc-status-details-bin"]
    parsed = status_pb2.Status.FromString(details)
    info = error_details_pb2.ErrorInfo()
    assert parsed.details[0].Unpack(info)
    size = _percent_encoded_len(status.details) + -(-len(details) // 3) * 4
    return status.details, info, size


@settings(deadline=None, database=None, max_examples=150)
@given(message=TEXT, values=st.lists(TEXT, max_size=20))
def test_every_status_fits_the_trailer_budget(message: str, values: list[str]) -> None:
    err = WeightwireError(Reason.DTYPE_UNSPECIFIED, message, **{f"k{i}": v for i, v in enumerate(values)})
    shown, info, size = _unpacked(err)
    assert size <= TRAILER_BUDGET_BYTES
    assert info.reason == "DTYPE_UNSPECIFIED" and info.domain == "weightwire"
    assert message.startswith(shown.removesuffix("..."))
    for key, value in info.metadata.items():
        assert err.metadata[key].startswith(value.removesuffix("..."))


def test_clip_utf8_counts_bytes_and_keeps_characters_whole() -> None:
    assert clip_utf8("é" * 10, 9) == "é" * 3 + "..."  # 6 bytes of é, then the ellipsis
    assert clip_utf8("中" * 10, 7) == "中" + "..."
    assert clip_utf8("short", 100) == "short"
    assert clip_utf8("abcdef", 2) == "ab"
