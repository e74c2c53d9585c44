"""Helpers of the multi-GPU scenarios (tests/gpu/test_multi_gpu.py): GPUs of the run, engines laid
out over a span of GPUs, worker and trainer-rank processes pinned to their GPUs, gathered buckets
built from every rank's own payload, and the checks on dumps and results.

Every worker and every trainer rank is its own process (CUDA IPC cannot open a handle in the process
that exported it). Several of them may share a GPU: with fewer GPUs than the scenario's natural size,
each GPU hosts several workers and several trainer ranks, and the labels still tell GPUs apart.

WEIGHTWIRE_GPU_SIM=N runs the same scenarios on a machine without GPUs, as a dry run of their logic:
N simulated GPUs, each a made-up host-memory label; workers (tests/gpu/multi_sim_worker.py) and
ranks run on the CPU and exchange host shared memory labelled as their simulated GPU. Nothing of
CUDA IPC is exercised then; mappings are opened per update instead of cached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_procs import HERE, JsonProcess, cuda_count, gpu_env, gpu_uuid
from weightwire.core.manifest import ParallelRank

SIM_ENV = "WEIGHTWIRE_GPU_SIM"


def sim_count() -> int:
    raw = os.environ.get(SIM_ENV, "").strip()
    return int(raw) if raw else 0


def gpu_count() -> int:
    """GPUs the scenarios may use: real CUDA GPUs, or simulated ones in a dry run."""
    return sim_count() or cuda_count()


def needs(n: int) -> pytest.MarkDecorator:
    have = gpu_count()
    what = f"{have} simulated ({SIM_ENV})" if sim_count() else str(have)
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPUs of one host; this machine has {what}")


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    visible: str  # CUDA_VISIBLE_DEVICES of the processes pinned to it ("" in a dry run)
    uuid: str  # normalised label of its payloads and its workers' own device
    sim: bool = False


def gpus(n: int) -> list[Gpu]:
    if sim_count():
        return [Gpu(i, "", f"00000000-0000-4000-8000-{i:012d}", sim=True) for i in range(n)]
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [v.strip() for v in parent.split(",")] if parent else [str(i) for i in range(cuda_count())]
    return [Gpu(i, physical[i], gpu_uuid(i)) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Placed:
    """One worker of an engine and the GPU it runs on."""

    worker_id: str
    rank: ParallelRank
    gpu: Gpu
    engine: str


def tp_pp_engine(name: str, span: list[Gpu], tp: int = 2, pp: int = 2) -> list[Placed]:
    """TP x PP workers spread evenly over ``span``, TP rank outermost: with two GPUs, GPU g hosts
    tp_rank g's pipeline stages; with one GPU per worker, worker (t, p) is on span[t * pp + p]."""
    n = tp * pp
    prefix = f"{name}-" if name else ""
    return [
        Placed(
            f"{prefix}tp{t}-pp{p}",
            ParallelRank(tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp),
            span[(t * pp + p) * len(span) // n],
            name,
        )
        for t in range(tp)
        for p in range(pp)
    ]


@dataclasses.dataclass
class RankProc:
    """A trainer rank: ``local`` is its position among the ranks on its GPU."""

    index: int
    gpu: Gpu
    local: int
    proc: JsonProcess


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    if proc.stdout is None:
        return ""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else ""


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def start_workers(placed: list[Placed], workdir: Path, dump_dir: Path) -> Iterator[dict[str, Placed]]:
    """Start every worker at once; yield address -> placement once each one listens."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    started: list[tuple[Placed, subprocess.Popen[str], Path]] = []
    try:
        for w in placed:
            r = w.rank
            ranks = [
                "--tp-rank",
                str(r.tp_rank),
                "--tp-size",
                str(r.tp_size),
                "--pp-rank",
                str(r.pp_rank),
                "--pp-size",
                str(r.pp_size),
                "--sp-rank",
                str(r.sp_rank),
                "--sp-size",
                str(r.sp_size),
            ]
            if w.gpu.sim:
                cmd = [sys.executable, str(HERE / "multi_sim_worker.py"), "--label", w.gpu.uuid]
            else:
                cmd = [
                    sys.executable,
                    "-m",
                    "weightwire.client.cli.main",
                    "serve",
                    "--model",
                    "demo",
                    "--device",
                    "cuda",
                    "--listen",
                    "127.0.0.1:0",
                ]
            cmd += ["--worker-id", w.worker_id, "--dump-dir", str(dump_dir), *ranks]
            log = workdir / f"{w.worker_id}.log"
            with open(log, "w") as errf:
                proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=errf, text=True, env=gpu_env(w.gpu.visible)
                )
            started.append((w, proc, log))
        out: dict[str, Placed] = {}
        prefix = "weightwire-serve listening "
        for w, proc, log in started:
            line = _readline(proc, 120.0)
            if not line.startswith(prefix):
                raise RuntimeError(
                    f"worker {w.worker_id} did not start (got {line!r}):\n{log.read_text()[-4000:]}"
                )
            out[line[len(prefix) :].strip()] = w
        yield out
    finally:
        _stop([p for _, p, _ in started])


@contextlib.contextmanager
def start_ranks(
    span: list[Gpu], per_gpu: int, workdir: Path, engines: dict[str, list[str]]
) -> Iterator[list[RankProc]]:
    """``per_gpu`` trainer ranks on each GPU of ``span`` (rank r on span[r // per_gpu]); rank 0 holds a
    WeightPusher per engine and pushes, the others only export."""
    ranks: list[RankProc] = []
    try:
        for g in span:
            for local in range(per_gpu):
                index = len(ranks)
                cmd = [sys.executable, str(HERE / "multi_trainer.py")]
                if index == 0:
                    cmd += [f"--engine={name}={','.join(eps)}" for name, eps in engines.items()]
                if g.sim:
                    cmd += ["--sim-label", g.uuid]
                errlog = workdir / f"rank{index}.log"
                with open(errlog, "w") as errf:
                    proc = subprocess.Popen(
                        cmd,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=errf,
                        text=True,
                        env=gpu_env(g.visible),
                    )
                ranks.append(RankProc(index, g, local, JsonProcess(proc, errlog)))
        yield ranks
    finally:
        for r in ranks:
            r.proc.close()


def bucket_count(per_gpu: int) -> int:
    # At least two buckets, so that each update also reuses a handle within itself when one rank
    # feeds several buckets.
    return max(2, per_gpu)


def gather(
    ranks: list[RankProc],
    version: int,
    nb: int,
    *,
    seed_of: Callable[[Gpu], int] | None = None,
    on: set[int] | None = None,
) -> list[list[str]]:
    """Every rank (on the GPUs ``on``, default all) packs and exports its copy; bucket j carries, for
    each GPU, the copy of that GPU's rank number ``j % per_gpu`` (so every rank's copy is used)."""
    chosen = [r for r in ranks if on is None or r.gpu.index in on]
    payloads: dict[tuple[int, int], str] = {}
    for r in chosen:
        seed = seed_of(r.gpu) if seed_of else version
        answer = r.proc.call("prepare", version, {"seed": seed})
        if "payload" not in answer or answer["uuid"] != r.gpu.uuid:
            raise AssertionError(f"rank {r.index} on GPU {r.gpu.index} answered {answer}")
        payloads[(r.gpu.index, r.local)] = answer["payload"]
    per_gpu = 1 + max(r.local for r in ranks)
    gpus_on = sorted({r.gpu.index for r in chosen})
    return [[payloads[(g, j % per_gpu)] for g in gpus_on] for j in range(nb)]


def expect_dump(dump_dir: Path, w: Placed, version: int, seed: int | None = None) -> None:
    """The worker's dump of ``version`` holds exactly its shard of the checkpoint of ``seed``."""
    from safetensors.torch import load_file

    path = dump_dir / f"{w.worker_id}-v{version}.safetensors"
    if not path.exists():
        raise AssertionError(f"no dump {path.name}; have {sorted(p.name for p in dump_dir.iterdir())}")
    got = load_file(str(path))
    want = expected(w.rank, version if seed is None else seed)
    if set(got) != set(want):
        raise AssertionError(f"{w.worker_id}: dumped names differ: {sorted(set(got) ^ set(want))}")
    for name, t in want.items():
        if not torch.equal(got[name], t):
            raise AssertionError(
                f"{w.worker_id} v{version}: {name} differs from its slice of checkpoint seed {seed or version}"
            )


def expected(rank: ParallelRank, seed: int) -> dict[str, torch.Tensor]:
    from weightwire.adapters.torch.demo import DemoConfig, expected_shard, full_checkpoint

    config = DemoConfig()
    return expected_shard(full_checkpoint(config, seed), rank, config)


def check_manifests(manifests: dict[str, Any], workers: dict[str, Placed]) -> None:
    """Each worker publishes its own GPU and exactly its TP slice's and pipeline stage's tensors."""
    assert set(manifests) == set(workers)
    for a, w in workers.items():
        m = manifests[a]
        assert m["worker_id"] == w.worker_id and m["device_uuid"] == w.gpu.uuid, (m, w)
        assert m["names"] == sorted(expected(w.rank, 0)), (w.worker_id, m["names"])


def check_results(
    results: dict[str, Any],
    workers: dict[str, Placed],
    manifests: dict[str, Any],
    version: int,
    *,
    handles: Callable[[str], int],
) -> None:
    """Committed at ``version`` over the expected transport, with every owned tensor loaded once:
    bytes loaded equal the worker's manifest bytes; handles opened as ``handles(address)`` says."""
    assert set(results) == set(workers), (sorted(results), sorted(workers))
    for a, r in results.items():
        w, m = workers[a], manifests[a]
        transport = "host_shm" if w.gpu.sim else "cuda_ipc"
        assert (r["version"], r["state"], r["transport"]) == (version, "CONSISTENT", transport), (
            w.worker_id,
            r,
        )
        assert r["tensors_loaded"] == len(m["names"]), (w.worker_id, r)
        assert r["bytes_loaded"] == m["total_bytes"], (w.worker_id, r["bytes_loaded"], m["total_bytes"])
        assert r["handles_opened"] == handles(a), (w.worker_id, r["handles_opened"], handles(a))


def handles_per_update(
    workers: dict[str, Placed], manifests: dict[str, Any], nb: int, per_gpu: int
) -> dict[str, int]:
    """How many distinct payloads (ranks' buffers) each worker imports in one update: one per local
    rank that feeds a bucket holding some of its tensors."""
    from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint

    order = list(full_checkpoint(DemoConfig(), 0))
    out: dict[str, int] = {}
    for a in workers:
        owned = set(manifests[a]["names"])
        out[a] = len({j % per_gpu for j in range(nb) if owned & set(order[j::nb])})
    return out


def timing_lines(label: str, results: dict[str, Any], workers: dict[str, Placed]) -> list[str]:
    """One line per worker: what its UpdateResult says (server duration, bytes) and the client's view."""
    lines = []
    for a, r in sorted(results.items(), key=lambda kv: workers[kv[0]].worker_id):
        w = workers[a]
        lines.append(
            f"timing {label} {w.worker_id} gpu{w.gpu.index} v{r['version']}: bytes_loaded={r['bytes_loaded']} "
            f"tensors={r['tensors_loaded']} handles_opened={r['handles_opened']} "
            f"server_duration_ms={r['server_duration_s'] * 1e3:.3f} client_duration_ms={r['duration_s'] * 1e3:.3f}"
        )
    return lines
