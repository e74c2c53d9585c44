"""``weightwire.core.transports.shm.sweep_orphans``: segments of dead creators go, everything else stays."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from weightwire.core.transports.shm import sweep_orphans


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_segments_of_dead_pids(tmp_path: pathlib.Path) -> None:
    dead = _dead_pid()
    names = {
        "dead": f"ww-{dead}-0123456789ab-0",
        "dead_tagged": f"ww-{dead}-0123456789ab-train",
        "alive": f"ww-{os.getpid()}-0123456789ab-0",
        "parent": f"ww-{os.getppid()}-0123456789ab-0",
        "no_pid": "ww-abc-0",
        "other_prefix": f"xx-{dead}-0",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / f"ww-{dead}-dir").mkdir()  # not a regular file: left alone

    removed = sweep_orphans(str(tmp_path))

    assert sorted(removed) == sorted([names["dead"], names["dead_tagged"]])
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {names["alive"], names["parent"], names["no_pid"], names["other_prefix"], f"ww-{dead}-dir"}
    assert sweep_orphans(str(tmp_path)) == []  # idempotent


def test_sweep_of_a_missing_directory_is_a_no_op(tmp_path: pathlib.Path) -> None:
    assert sweep_orphans(str(tmp_path / "not-there")) == []
