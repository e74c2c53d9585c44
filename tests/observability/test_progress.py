"""The push progress bar: drawn on a terminal (a real pseudo-terminal here), silent otherwise; and
``weightwire push`` to a real worker process drawing it in a pseudo-terminal."""

from __future__ import annotations

import io
import os
import pathlib
import re
import select
import sys

import pytest
from helpers import spawn_worker
from safetensors.torch import save_file
from terminal import Terminal
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.client.cli.progress import PushProgressBar
from weightwire.client.inputs.types import PushProgress

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][A-Z0-9]|\r")
_MIB = 1024 * 1024


def _feed(bar: PushProgressBar) -> None:
    for done in range(1, 5):
        bar(
            PushProgress(
                buckets_done=done, buckets_total=4, bytes_done=done * 8 * _MIB, bytes_total=32 * _MIB
            )
        )


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


def test_weightwire_push_draws_the_bar_on_a_terminal(tmp_path: pathlib.Path) -> None:
    worker = spawn_worker("--model", "demo", "--log-level", "WARNING")
    try:
        ckpt = tmp_path / "model.safetensors"
        save_file(full_checkpoint(DemoConfig(), seed=5), str(ckpt))
        term = Terminal(
            [
                sys.executable,
                "-m",
                "weightwire.client.cli.main",
                "push",
                "--from",
                str(ckpt),
                "--to",
                worker.address,
                "--version",
                "5",
                "--bucket-mb",
                "0.25",
            ]
        )
        try:
            text = term.read_until(lambda t: "GB/s" in t and "tp0-pp0" in t)  # the results table came
        finally:
            code = term.close(interrupt=False)
        assert code == 0, term.text()
        bar = [line for line in term.text().splitlines() if " buckets" in line and "v5" in line]
        assert bar, text
        assert "3/3 buckets" in bar[-1]
    finally:
        worker.stop()
