"""Rank processes driven over stdin, for the FP8 tests that build an engine's model in processes of
their own (tests/vllm/fp8_rank.py, tests/sglang/fp8_moe_rank.py): no engine can run FP8 on a CPU
without AMX, so these processes build each engine's model under its real parallel state and serve
it through weightwire, and the test asks them for dumps of their parameters.

Protocol of such a process: one line ``ready ...`` once serving; then one command per line on
stdin, answered by one line ``ok ...`` or ``error <message>``; ``dump PATH`` and
``reference CKPT PATH`` write a torch file of every parameter by engine name; ``quit`` ends it.
No engine import here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


class RankFleet:
    """One process per rank (``argv[r]``), started together and asked the same commands."""

    def __init__(self, argv: list[list[str]], env: dict[str, str]) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1", **env),
            )
            for args in argv
        ]
        try:
            for proc in self.procs:
                self._answer(proc, "ready")
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _answer(proc: subprocess.Popen[str], want: str = "ok") -> str:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(("ok", "error", "ready")):
                assert line.startswith(want), line
                return line[len(want) :].strip()
        raise RuntimeError(f"rank process ended (exit {proc.wait()})")

    def ask(self, command: str) -> list[str]:
        """Every rank's answer to ``command`` (what follows its ``ok``)."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        return [self._answer(proc) for proc in self.procs]

    def dumps(self, tmp: Path, command: str, tag: str) -> list[dict[str, torch.Tensor]]:
        """Each rank's parameters after ``command`` (``dump`` or ``reference CKPT``), by engine name."""
        paths = [tmp / f"{tag}-{r}.pt" for r in range(len(self.procs))]
        for r, proc in enumerate(self.procs):
            assert proc.stdin is not None
            proc.stdin.write(f"{command} {paths[r]}\n")
            proc.stdin.flush()
        for proc in self.procs:
            self._answer(proc)
        return [torch.load(p) for p in paths]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write("quit\n")
                proc.stdin.flush()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def assert_same_bytes(held: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """``held`` has exactly ``want``'s parameters, each of its dtype and shape and bytes."""
    assert held.keys() == want.keys()
    for name, t in want.items():
        assert held[name].dtype == t.dtype and held[name].shape == t.shape, (what, name)
        # Bytes, not values: FP8 NaN patterns and -0 compare as what was loaded.
        assert torch.equal(held[name].view(torch.uint8), t.view(torch.uint8)), f"{name} ({what})"
