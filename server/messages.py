"""Error-message text built from lists of names, bounded so it fits a message and a gRPC trailer.

Used by the update rules (``server/update.py``) when a message names many tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

# How many names an error message lists before "... and N more" (metadata carries more).
MAX_NAMES_IN_MESSAGE = 10
# Metadata values travel in a gRPC trailer, whose size is limited (8 KiB by default).
MAX_METADATA_CHARS = 3000


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
