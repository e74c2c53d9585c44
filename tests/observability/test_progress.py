"""The push progress bar: drawn on a terminal (a real pseudo-terminal here), silent otherwise."""

from __future__ import annotations

import io
import os
import re
import select

import pytest
from weightwire.client.progress import PushProgressBar
from weightwire.client.types import PushProgress

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][A-Z0-9]|\r")
_MIB = 1024 * 1024


def _feed(bar: PushProgressBar) -> None:
    for done in range(1, 5):
        bar(PushProgress(buckets_done=done, buckets_total=4, bytes_done=done * 8 * _MIB, bytes_total=32 * _MIB))


def test_silent_when_not_a_terminal() -> None:
    out = io.StringIO()
    with PushProgressBar(stream=out) as bar:
        assert not bar.enabled
        _feed(bar)
    assert out.getvalue() == ""


def test_silent_with_force_color_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    out = io.StringIO()
    with PushProgressBar(stream=out) as bar:
        _feed(bar)
    assert out.getvalue() == ""


def _read_all(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0.2)[0]:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def test_drawn_on_a_terminal() -> None:
    master, slave = os.openpty()
    try:
        with os.fdopen(os.dup(slave), "w") as term:
            with PushProgressBar("push v3", stream=term) as bar:
                assert bar.enabled
                _feed(bar)
            term.flush()
        text = _ANSI.sub("", _read_all(master))
    finally:
        os.close(master)
        os.close(slave)
    assert "push v3" in text
    assert "4/4 buckets" in text
    assert "32.0 MiB" in text  # rich's DownloadColumn, binary units
