"""Whether an object has one of the optional abilities a runtime-checkable protocol declares
(``PreparesLoads``, ``KeepsViews``, ``ReadsAhead``, ...), decided once per class.

``isinstance`` against a runtime-checkable protocol inspects every member each time it is asked
(tens of microseconds), and the worker asks per batch of every bucket. The classes that have these
abilities define the members in the class or set them in ``__init__``, so the answer is one per
class and is kept.
"""

from __future__ import annotations

_KNOWN: dict[tuple[type, type], bool] = {}


def has_capability(obj: object, protocol: type) -> bool:
    """``isinstance(obj, protocol)``, worked out once for ``type(obj)`` (callers ``cast`` to the
    protocol: mypy does not narrow through a protocol class passed as a value)."""
    key = (type(obj), protocol)
    known = _KNOWN.get(key)
    if known is None:
        known = _KNOWN[key] = isinstance(obj, protocol)
    return known
