"""One structured log line per update per worker, for log shippers (Loki, Vector, Fluent Bit).

``UpdateLog`` is on in every worker (``WorkerService`` adds it): when an update ends it logs one
record on the logger ``weightwire.updates``, INFO when committed, WARNING when refused or
cancelled, ERROR when it failed after loading (the worker is INCONSISTENT). The message is logfmt,
``key=value`` pairs separated by spaces, values with spaces or quotes in double quotes::

    event=weightwire.update worker=tp0-pp1 version=3 outcome=committed reason="" code=OK scope=full
    duration_ms=12.841 bytes=4194304 buckets=2 tensors=12 handles_opened=1 weights_version=3
    state=CONSISTENT update_id=v3 message=""

(one line; wrapped here). The field names are ``FIELDS``, documented in docs/server.md. The same
values are on the record as ``record.weightwire_update`` (a dict), for a JSON formatter.
``parse_update_line`` reads a line back.
"""

from __future__ import annotations

import logging
import re
import shlex

from weightwire.server.observe.update_events import UpdateOutcome
from weightwire.v1 import weight_transfer_pb2 as pb

LOGGER_NAME = "weightwire.updates"
EVENT = "weightwire.update"
FIELDS = (
    "event",
    "worker",
    "version",
    "outcome",
    "reason",
    "code",
    "scope",
    "duration_ms",
    "bytes",
    "buckets",
    "tensors",
    "handles_opened",
    "weights_version",
    "state",
    "update_id",
    "message",
)

log = logging.getLogger(LOGGER_NAME)

_BARE = re.compile(r"[A-Za-z0-9_.:/+\-]+")  # fullmatch: `$` would pass a value ending in a newline
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_LEVELS = {
    "committed": logging.INFO,
    "refused": logging.WARNING,
    "cancelled": logging.WARNING,
    "failed": logging.ERROR,
}


def update_fields(outcome: UpdateOutcome) -> dict[str, str | int | float]:
    """The fields of one update's line, in ``FIELDS`` order (``duration_ms`` is "" when refused at its header)."""
    return {
        "event": EVENT,
        "worker": outcome.worker_id,
        "version": outcome.version,
        "outcome": outcome.outcome,
        "reason": outcome.reason,
        "code": outcome.code,
        "scope": outcome.scope,
        "duration_ms": round(outcome.duration_s * 1e3, 3) if outcome.duration_s is not None else "",
        "bytes": outcome.bytes_loaded,
        "buckets": outcome.buckets,
        "tensors": outcome.tensors_loaded,
        "handles_opened": outcome.handles_opened,
        "weights_version": outcome.weights_version,
        "state": outcome.state,
        "update_id": outcome.update_id,
        "message": outcome.message,
    }


def _value(value: str | int | float) -> str:
    text = str(value)
    if _BARE.fullmatch(text):
        return text
    # One line per record whatever the trainer sent: control characters become spaces.
    text = _CONTROL.sub(" ", text).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def format_update_line(fields: dict[str, str | int | float]) -> str:
    """``key=value ...`` (logfmt); values that are not plain words are double-quoted."""
    return " ".join(f"{key}={_value(value)}" for key, value in fields.items())


def parse_update_line(line: str) -> dict[str, str]:
    """The fields of the first ``event=weightwire.update`` record in ``line`` (a formatter's prefix
    before it is ignored). Raises ValueError when the line has none."""
    start = line.find(f"event={EVENT}")
    if start < 0:
        raise ValueError(f"no {EVENT} record in {line!r}")
    fields: dict[str, str] = {}
    for token in shlex.split(line[start:], posix=True):
        key, sep, value = token.partition("=")
        if not sep:
            raise ValueError(f"{token!r} in an update line is not key=value")
        fields[key] = value
    return fields


class UpdateLog:
    """The observer that writes the line (``WorkerService`` adds one to every worker)."""

    def update_started(self, version: int) -> None:
        pass

    def bucket_acked(self, ack: pb.BucketAck) -> None:
        pass

    def update_finished(self, outcome: UpdateOutcome) -> None:
        level = _LEVELS[outcome.outcome]
        if not log.isEnabledFor(level):
            return
        fields = update_fields(outcome)
        log.log(level, "%s", format_update_line(fields), extra={"weightwire_update": fields})
