"""``slice_trainer.py`` as M trainer ranks of one gloo world, driven by JSON lines: what the
every-rank-a-source tests start as their trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from group_fleet import QUIET_ENV
from helpers import rank_env
from ports import free_port

HERE = os.path.dirname(os.path.abspath(__file__))


class Ranks:
    """M ``slice_trainer.py`` processes (``extra``: its options), each answering one JSON line per command."""

    def __init__(self, world: int, addresses: list[str], *extra: str) -> None:
        port = free_port()
        self.procs = [
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "slice_trainer.py"), *extra, *addresses],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, **QUIET_ENV, **rank_env(r, world, port)},
            )
            for r in range(world)
        ]
        for r in range(world):
            assert self.read(r).get("ready"), r

    def read(self, rank: int) -> dict[str, Any]:
        out = self.procs[rank].stdout
        assert out is not None
        while True:
            line = out.readline()
            if not line:
                err = self.procs[rank].stderr
                raise RuntimeError(f"rank {rank} ended: {err.read()[-3000:] if err else ''}")
            if line.startswith("{"):
                return json.loads(line)  # type: ignore[no-any-return]

    def send(self, rank: int, text: str) -> None:
        stdin = self.procs[rank].stdin
        assert stdin is not None
        stdin.write(text + "\n")
        stdin.flush()

    def command(self, **cmd: Any) -> None:
        for r in range(len(self.procs)):
            self.send(r, json.dumps(cmd))

    def push(self, ranks: list[int] | None = None, **cmd: Any) -> list[dict[str, Any]]:
        self.command(op="push", **cmd)
        return [self.read(r) for r in (ranks if ranks is not None else range(len(self.procs)))]

    def close(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is None:
                try:
                    self.send(r, json.dumps({"op": "quit"}))
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
