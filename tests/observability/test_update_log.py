"""The structured update line: every field written, read back by ``parse_update_line`` whatever the
values hold (spaces, quotes, backslashes, newlines a trainer put into an update id)."""

from __future__ import annotations

import logging

import pytest
from weightwire.server.observe.update_events import UpdateOutcome
from weightwire.server.observe.update_log import (
    FIELDS,
    LOGGER_NAME,
    UpdateLog,
    format_update_line,
    parse_update_line,
    update_fields,
)


def _outcome(**kw: object) -> UpdateOutcome:
    base: dict[str, object] = dict(
        worker_id="tp0-pp1",
        version=7,
        outcome="refused",
        reason="SHAPE_MISMATCH",
        code="FAILED_PRECONDITION",
        scope="full",
        update_id="v7",
        duration_s=0.0123456,
        buckets=2,
        tensors_loaded=0,
        bytes_loaded=0,
        handles_opened=0,
        weights_version=6,
        state="CONSISTENT",
        message="tensor 'a' has shape [2, 3], expected [3, 2]",
    )
    base.update(kw)
    return UpdateOutcome(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "update_id",
    ["v7", "", "with space", 'quote " inside', "back\\slash", "new\nline\r\tand tab", "key=value", "ünïcode"],
)
def test_line_round_trips(update_id: str) -> None:
    fields = update_fields(_outcome(update_id=update_id))
    line = format_update_line(fields)
    assert "\n" not in line and "\r" not in line
    parsed = parse_update_line("2026-12-01 08:00:00,000 WARNING weightwire.updates: " + line)
    assert list(parsed) == list(FIELDS)
    expected_id = update_id.replace("\n", " ").replace("\r", " ").replace("\t", " ")
    assert parsed["update_id"] == expected_id
    assert parsed["message"] == "tensor 'a' has shape [2, 3], expected [3, 2]"
    assert parsed["duration_ms"] == "12.346"
    assert parsed["version"] == "7" and parsed["weights_version"] == "6"
    assert parsed["reason"] == "SHAPE_MISMATCH" and parsed["outcome"] == "refused"


def test_refused_at_header_has_empty_duration() -> None:
    parsed = parse_update_line(format_update_line(update_fields(_outcome(duration_s=None))))
    assert parsed["duration_ms"] == ""


def test_not_an_update_line() -> None:
    with pytest.raises(ValueError, match=r"no weightwire\.update record"):
        parse_update_line("INFO weightwire.serve: ready")


def test_levels_and_record_fields(caplog: pytest.LogCaptureFixture) -> None:
    log = UpdateLog()
    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        log.update_finished(_outcome(outcome="committed", reason="", code="OK", message=""))
        log.update_finished(_outcome())
        log.update_finished(_outcome(outcome="failed", state="INCONSISTENT"))
        log.update_finished(_outcome(outcome="cancelled", reason="CANCELLED", code="CANCELLED"))
    records = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert [r.levelno for r in records] == [logging.INFO, logging.WARNING, logging.ERROR, logging.WARNING]
    assert [parse_update_line(r.getMessage())["outcome"] for r in records] == [
        "committed",
        "refused",
        "failed",
        "cancelled",
    ]
    assert records[0].weightwire_update["bytes"] == 0  # type: ignore[attr-defined]
    assert records[2].weightwire_update["state"] == "INCONSISTENT"  # type: ignore[attr-defined]
