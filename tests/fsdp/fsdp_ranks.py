"""Helpers of the FSDP2 tests: start N trainer ranks (``fsdp_rank.py``, gloo, one process each),
start fleets of workers, and check what the workers dumped.

``run_ranks`` is what ``torchrun`` would do for these tests, minus its habit of killing every rank
when one exits (the tests make a rank die on purpose and look at what the others did).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from helpers import WorkerProcess, demo_args, load_dump, spawn_worker, spawn_workers
from ports import free_port
from weightwire.adapters.torch.demo import DemoConfig, expected_shard, full_checkpoint
from weightwire.core.manifest import ParallelRank
from weightwire.v1 import weight_transfer_pb2 as pb

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_SCRIPT = os.path.join(HERE, "fsdp_rank.py")
LABELLED_WORKER = os.path.join(HERE, "labelled_worker.py")


@dataclasses.dataclass
class RankRun:
    """What N ranks did: exit codes, each rank's scenario records, and their stderr."""

    returncodes: list[int]
    records: list[dict[str, Any]]
    stderr: list[str]

    def of(self, scenario: str) -> list[dict[str, Any]]:
        """Every rank's record of one scenario (a rank that never got there has none)."""
        return [r.get(scenario, {"missing": True}) for r in self.records]

    def explain(self) -> str:
        return "\n".join(
            f"--- rank {i} (exit {rc}) ---\n{err[-4000:]}"
            for i, (rc, err) in enumerate(zip(self.returncodes, self.stderr, strict=True))
        )


def run_ranks(
    world: int,
    scenarios: Sequence[dict[str, Any]],
    out_dir: str,
    *,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
) -> RankRun:
    """Run ``fsdp_rank.py`` on ``world`` ranks over the scenarios; kill every rank still running at
    ``timeout_s`` (a hang is then visible as exit code -9 in ``returncodes``)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "scenarios.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(list(scenarios), f)
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    err_paths = [os.path.join(out_dir, f"rank{r}.stderr") for r in range(world)]
    for r in range(world):
        rank_env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            **(env or {}),
        )
        with open(err_paths[r], "w", encoding="utf-8") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, RANK_SCRIPT, path, out_dir],
                    env=rank_env,
                    stdout=err,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
    codes: list[int] = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout_s))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    records: list[dict[str, Any]] = []
    for r in range(world):
        try:
            with open(os.path.join(out_dir, f"rank{r}.json"), encoding="utf-8") as f:
                records.append(json.load(f))
        except FileNotFoundError:
            records.append({})
    stderr = []
    for p in err_paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            stderr.append(f.read())
    return RankRun(codes, records, stderr)


# ---------------------------------------------------------------------------------------------
# Fleets
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Fleet:
    """Workers of one engine: their processes, ranks and worker ids, and where they dump."""

    workers: list[WorkerProcess]
    ranks: list[ParallelRank]
    dump_dir: str
    config: DemoConfig = dataclasses.field(default_factory=DemoConfig)

    @property
    def endpoints(self) -> list[str]:
        return [w.address for w in self.workers]

    def worker_ids(self) -> list[str]:
        return [f"tp{r.tp_rank}-pp{r.pp_rank}" for r in self.ranks]

    def statuses(self) -> list[pb.GetStatusResponse]:
        return [w.stub().GetStatus(pb.GetStatusRequest(), timeout=30) for w in self.workers]

    def next_version(self) -> int:
        return max(s.weights_version for s in self.statuses()) + 1

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    def assert_dumps(self, version: int, seed: int, dtype: torch.dtype | None = None) -> None:
        """Every worker's parameters after ``version`` equal its shard of ``full_checkpoint(seed)``, bit for bit."""
        full = full_checkpoint(dataclasses.replace(self.config, dtype=torch.float32), seed)
        if dtype is not None:
            full = {n: t.to(dtype) for n, t in full.items()}
        for rank, wid in zip(self.ranks, self.worker_ids(), strict=True):
            got = load_dump(self.dump_dir, wid, version)
            want = expected_shard(full, rank, self.config)
            assert sorted(got) == sorted(want), wid
            for name, t in want.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), (
                    f"{wid}: {name} differs after v{version}"
                )


def grid(tp: int, pp: int) -> list[ParallelRank]:
    return [ParallelRank(tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp) for p in range(pp) for t in range(tp)]


def serve_fleet(tp: int, pp: int, dump_dir: str) -> Fleet:
    """Real ``weightwire serve --model demo`` workers (host devices of this machine)."""
    ranks = grid(tp, pp)
    workers = spawn_workers(
        [demo_args(tp=(r.tp_rank, tp), pp=(r.pp_rank, pp), dump_dir=dump_dir) for r in ranks]
    )
    return Fleet(workers, ranks, dump_dir)


def labelled_fleet(
    tp: int,
    pp: int,
    dump_dir: str,
    *,
    labels: Sequence[str | None],
    config_args: Sequence[str] = (),
    config: DemoConfig | None = None,
) -> Fleet:
    """``labelled_worker.py`` workers, worker i (tp-major within a stage) on device ``labels[i]``
    (a stand-in GPU label, or None for this host)."""
    ranks = grid(tp, pp)
    commands = []
    for r, label in zip(ranks, labels, strict=True):
        cmd = [
            sys.executable,
            LABELLED_WORKER,
            "--tp-rank",
            str(r.tp_rank),
            "--tp-size",
            str(tp),
            "--pp-rank",
            str(r.pp_rank),
            "--pp-size",
            str(pp),
            "--worker-id",
            f"tp{r.tp_rank}-pp{r.pp_rank}",
            "--dump-dir",
            dump_dir,
            *config_args,
        ]
        if label is not None:
            cmd += ["--label", label]
        commands.append(cmd)
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        futures = [pool.submit(spawn_worker, command=cmd, timeout=90.0) for cmd in commands]
    workers, errors = [], []
    for f in futures:
        try:
            workers.append(f.result())
        except Exception as e:
            errors.append(e)
    if errors:
        for w in workers:
            w.stop()
        raise errors[0]
    return Fleet(workers, ranks, dump_dir, config or DemoConfig())
