"""The reasons a delta update is refused with, as ``WeightwireError`` values.

``INVALID_DELTA`` (an encoding that does not fit its payload or its target), ``DELTA_BASE_MISMATCH``
(the worker does not hold the base) and ``DELTA_RESULT_MISMATCH`` (the result's checksum differs
from the trainer's) are the contract's ``ErrorReason`` names. They are raised by name with their
status code given, so an error carries the right reason and code whether or not this build's
``Reason`` table lists them yet (``WeightwireError`` resolves a known name to its member).
"""

from __future__ import annotations

from weightwire.core.errors import WeightwireError

INVALID_DELTA = "INVALID_DELTA"
DELTA_BASE_MISMATCH = "DELTA_BASE_MISMATCH"
DELTA_RESULT_MISMATCH = "DELTA_RESULT_MISMATCH"

_CODES = {
    INVALID_DELTA: "INVALID_ARGUMENT",
    DELTA_BASE_MISMATCH: "FAILED_PRECONDITION",
    DELTA_RESULT_MISMATCH: "DATA_LOSS",
}


def delta_error(reason: str, message: str, **metadata: str) -> WeightwireError:
    """A ``WeightwireError`` of one of the three delta reasons, with the status code the contract gives it."""
    return WeightwireError(reason, message, code=_CODES[reason], **metadata)


def invalid_delta(message: str, **metadata: str) -> WeightwireError:
    return delta_error(INVALID_DELTA, message, **metadata)
