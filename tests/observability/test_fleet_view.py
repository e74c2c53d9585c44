"""``weightwire status ADDR... --watch`` against a real TP=2 engine of ``weightwire serve`` processes:
in a pseudo-terminal it redraws one table in place and shows a push land (versions, states, last
update) and a refused one (last error); with ``--json`` it writes one JSON object per refresh; a
worker that goes away shows as UNREACHABLE while the others are still shown."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import WorkerProcess, demo_args, spawn_workers
from terminal import Terminal
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.client import PushError, WeightPusher

CLI = [sys.executable, "-m", "weightwire.client.cli.main", "status"]


@pytest.fixture(scope="module")
def engine() -> Iterator[list[WorkerProcess]]:
    workers = spawn_workers([demo_args(tp=(0, 2)), demo_args(tp=(1, 2))])
    try:
        yield workers
    finally:
        for w in workers:
            w.stop()


def _last_frame(text: str) -> str:
    return text[text.rfind("weightwire fleet:") :]


def test_watch_redraws_in_place_and_shows_a_push(engine: list[WorkerProcess]) -> None:
    addrs = [w.address for w in engine]
    with WeightPusher(addrs) as p:
        status = p.status()
    v0 = max(s.weights_version for s in status.values())
    term = Terminal([*CLI, *addrs, "--watch", "--interval", "0.3"])
    try:
        first = term.read_until(lambda t: t.count("CONSISTENT") >= 2 and "weightwire fleet: 2 workers" in t)
        assert "tp0-pp0" in first and "tp1-pp0" in first
        config = DemoConfig()
        with WeightPusher(addrs) as pusher:
            pusher.push(full_checkpoint(config, seed=v0 + 1), version=v0 + 1)
            term.read_until(
                lambda t: f"weights v{v0 + 1} " in _last_frame(t) and _last_frame(t).count(f"v{v0 + 1} ") >= 3
            )
        # The same version again, to each worker on its own (one push would cancel the others at the
        # first refusal, and a cancelled stream may end before its worker read the header).
        for a in addrs:
            with WeightPusher([a]) as single, pytest.raises(PushError):
                single.push(full_checkpoint(config, seed=v0 + 1), version=v0 + 1)
        frame = _last_frame(term.read_until(lambda t: _last_frame(t).count("STALE_VERSION") >= 2))
        assert frame.count("CONSISTENT") == 2 + 1  # both rows, and the summary's "2 CONSISTENT"
        assert "2 CONSISTENT" in frame
    finally:
        code = term.close()
    assert code == 0
    # In place: rich moves the cursor up and erases the previous frame instead of appending.
    assert b"\x1b[2K" in term.raw and b"\x1b[1A" in term.raw


def test_watch_json_lines(engine: list[WorkerProcess]) -> None:
    addrs = [w.address for w in engine]
    with WeightPusher(addrs) as p:
        expected = {a: s.weights_version for a, s in p.status().items()}
    out = subprocess.run(
        [*CLI, *addrs, "--watch", "--json", "--count", "2", "--interval", "0.2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        snapshot = json.loads(line)
        assert set(snapshot["workers"]) == set(addrs)
        for a in addrs:
            w = snapshot["workers"][a]
            assert int(w.get("weights_version", 0)) == expected[a]
            assert w["state"] == "WORKER_STATE_CONSISTENT"
        assert "time" in snapshot


def test_watch_not_a_terminal_prints_each_refresh(engine: list[WorkerProcess]) -> None:
    addrs = [w.address for w in engine]
    out = subprocess.run(
        [*CLI, *addrs, "--watch", "--count", "2", "--interval", "0.2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("weightwire fleet: 2 workers") == 2
    assert "\x1b[" not in out.stdout  # plain text in a pipe
    # Every column, whatever the width: a pipe has no terminal to fit (rich squeezed it to 80
    # columns and dropped the worker and version columns).
    frame = out.stdout.strip().split("\n\n")[-1].splitlines()
    header, rows = frame[1], frame[3:]
    for column in (
        "worker",
        "address",
        "device",
        "ranks",
        "version",
        "state",
        "last update",
        "ok/failed",
        "mappings",
        "last error",
    ):
        assert column in header, header
    assert len(rows) == 2
    for w, row in zip(engine, rows, strict=True):
        cells = row.split()
        assert cells[0].startswith("tp") and cells[1] == w.address, row
        assert "CONSISTENT" in cells and cells[cells.index("CONSISTENT") - 1].isdigit(), row


def test_unreachable_worker_is_shown_with_the_others(
    engine: list[WorkerProcess], tmp_path: pathlib.Path
) -> None:
    gone = f"unix:{tmp_path}/nobody.sock"
    out = subprocess.run(
        [*CLI, engine[0].address, gone, "--watch", "--json", "--count", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    snapshot = json.loads(out.stdout)
    assert snapshot["workers"][gone]["error"]["reason"] == "UNAVAILABLE"
    assert snapshot["workers"][engine[0].address]["state"] == "WORKER_STATE_CONSISTENT"
