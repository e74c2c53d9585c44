"""Bounded text for both sides: clipping, lists of names, and bounds on text a client can make the worker store or echo.

Used by the update rules (``server/worker/update.py``) when a message names many tensors, by the service
for what GetStatus keeps, and by the servicer for what a status carries. Text that comes from a
client (tensor names, labels, fingerprints) is bounded in UTF-8 bytes, not characters: gRPC's limits
are on bytes, and a non-ASCII character takes up to four.
"""

from __future__ import annotations

from collections.abc import Iterable

# How many names an error message lists before "... and N more" (metadata carries more).
MAX_NAMES_IN_MESSAGE = 10
# Metadata values travel in a gRPC trailer, whose size is limited (8 KiB by default).
MAX_METADATA_CHARS = 3000
# An error message as GetStatus keeps it, a log line shows it and a status carries it.
MAX_MESSAGE_BYTES = 1024
_ELLIPSIS = "..."


def clip_utf8(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes at a character boundary; ends with
    ``...`` when cut."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= max_bytes:
        return text
    if max_bytes <= len(_ELLIPSIS):
        return raw[: max(0, max_bytes)].decode("utf-8", "ignore")
    return raw[: max_bytes - len(_ELLIPSIS)].decode("utf-8", "ignore") + _ELLIPSIS


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ending with ``...`` when cut (for text a log line
    or a message shows; what must fit a byte limit on the wire goes through ``clip_utf8``)."""
    if len(text) <= limit:
        return text
    return (
        text[: max(0, limit - len(_ELLIPSIS))] + _ELLIPSIS
        if limit > len(_ELLIPSIS)
        else text[: max(0, limit)]
    )


def name_list(names: Iterable[str], limit: int = MAX_NAMES_IN_MESSAGE) -> str:
    """``a, b, c ... and 12 more`` for messages."""
    items = list(names)
    text = ", ".join(items[:limit])
    return text + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


def bounded_join(names: Iterable[str], max_chars: int = MAX_METADATA_CHARS) -> str:
    """Comma-joined names cut at a name boundary to fit a trailer; ends with ``,...`` when cut."""
    out: list[str] = []
    used = 0
    for name in names:
        if used + len(name) + 1 > max_chars:
            out.append("...")
            break
        out.append(name)
        used += len(name) + 1
    return ",".join(out)
