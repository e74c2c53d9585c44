"""The README's FSDP2 example runs as written: two gloo ranks under torchrun on this CPU, into two
``weightwire serve`` workers started the way the README's example starts them, and the workers hold
the demo checkpoint of seed 1 afterwards, bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from fsdp_ranks import Fleet, grid
from helpers import demo_args, spawn_workers

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")
MARKER = "# fsdp_push.py:"
pytestmark = pytest.mark.timeout(900)


def readme_example() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if b.startswith(MARKER)]
    assert len(blocks) == 1, "the README has one FSDP2 example, starting with the fsdp_push.py line"
    return blocks[0]


def test_readme_fsdp2_example_runs_as_written(tmp_path: pytest.TempPathFactory) -> None:
    script = tmp_path / "fsdp_push.py"  # type: ignore[operator]
    source = readme_example()
    script.write_text(source)
    dump_dir = str(tmp_path / "dumps")  # type: ignore[operator]
    sockets = [str(tmp_path / f"tp{t}.sock") for t in range(2)]  # type: ignore[operator]
    workers = spawn_workers(
        [demo_args(tp=(t, 2), listen=f"unix:{sockets[t]}", dump_dir=dump_dir) for t in range(2)]
    )
    fleet = Fleet(workers, grid(2, 1), dump_dir)
    try:
        # The command line of the example's first line, with this test's socket paths.
        command = source.splitlines()[0].removeprefix(MARKER).split()
        assert command[:4] == ["torchrun", "--standalone", "--nproc-per-node", "2"]
        args = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *command[1:4],
            str(script),
            *(f"unix:{s}" for s in sockets),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        out = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "{'tp0-pp0': 1, 'tp1-pp0': 1}" in out.stdout, out.stdout + out.stderr
        fleet.assert_dumps(1, seed=1)
    finally:
        fleet.stop()
