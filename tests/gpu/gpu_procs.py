"""Helpers for the GPU suite: GPU discovery, and processes pinned to GPUs by CUDA_VISIBLE_DEVICES.

Everything here runs only on a CUDA machine (``make test-gpu``); on CPU the tests skip. Workers,
trainers and producers always run in their own processes: CUDA IPC cannot open a handle in the
process that exported it, and each process must see the GPUs a real deployment would give it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int) -> pytest.MarkDecorator:
    have = cuda_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPU(s); this machine has {have}")


def gpu_uuid(index: int) -> str:
    """Normalised UUID of GPU ``index`` as this (all-GPU) test process sees it."""
    from weightwire.core.devices import cuda_device_uuid

    return cuda_device_uuid(index)


def nvml_uuid(index: int) -> str:
    """The UUID exactly as NVML prints it (``GPU-...``), for the label-normalisation tests."""
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = int(visible.split(",")[index]) if visible else index
        raw = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(physical))
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    finally:
        pynvml.nvmlShutdown()


def nvml_used_bytes(index: int) -> int:
    """Device memory in use on GPU ``index`` (all processes), as NVML counts it."""
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    finally:
        pynvml.nvmlShutdown()


def nvml_used_by_process(index: int) -> list[tuple[int, int]]:
    """(pid, bytes) of every compute process on GPU ``index``, as NVML counts them."""
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(index))
        return sorted((int(p.pid), int(p.usedGpuMemory or 0)) for p in procs)
    finally:
        pynvml.nvmlShutdown()


def gpu_env(visible: str) -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = visible
    env["PYTHONUNBUFFERED"] = "1"
    # Never let a child turn NVLink multicast on (it can take a shared host's GPUs down).
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    return env


@dataclasses.dataclass
class LineProcess:
    """A child that answers one stdout line per stdin line."""

    proc: subprocess.Popen[str]
    # stderr goes to a file (a pipe nobody drains could fill up and block the child).
    errlog: Path | None = None

    def stderr_tail(self) -> str:
        return self.errlog.read_text(errors="replace")[-6000:] if self.errlog and self.errlog.exists() else ""

    def ask(self, line: str) -> str:
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError("process has no pipes")
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(
                f"process exited (rc={self.proc.wait()}) while answering {line!r}:\n{self.stderr_tail()}"
            )
        return answer.strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            # "quit" gets no answer: the child just exits.
            with contextlib.suppress(BrokenPipeError, OSError):
                if self.proc.stdin is not None:
                    self.proc.stdin.write("quit\n")
                    self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def producer(visible: str, size: int, lead: int = 0) -> Iterator[LineProcess]:
    """tests/gpu/ipc_producer.py on the GPU(s) ``visible`` (a CUDA_VISIBLE_DEVICES value)."""
    errlog = Path(tempfile.mkstemp(prefix="ww-producer-", suffix=".log")[1])
    with open(errlog, "w") as errf:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "ipc_producer.py"), str(size), str(lead)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errf,
            text=True,
            env=gpu_env(visible),
        )
    lp = LineProcess(proc, errlog)
    try:
        yield lp
    finally:
        lp.close()
        errlog.unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One ``weightwire serve --model demo --device cuda`` process and the GPUs it may see."""

    visible: str
    worker_id: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    sp_rank: int = 0
    sp_size: int = 1
    seed: int = 0

    def rank(self):  # type: ignore[no-untyped-def]
        from weightwire.core.manifest import ParallelRank

        return ParallelRank(
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            sp_rank=self.sp_rank,
            sp_size=self.sp_size,
        )


@dataclasses.dataclass
class RunningWorker:
    spec: WorkerSpec
    proc: subprocess.Popen[str]
    address: str
    log: Path


def _first_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    import select

    if proc.stdout is None:
        return ""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else ""


@contextlib.contextmanager
def workers(
    specs: list[WorkerSpec], workdir: Path, *, dump_dir: Path | None = None
) -> Iterator[list[RunningWorker]]:
    """Start every worker (concurrently), wait for each one's 'listening' line, stop them after."""
    started: list[tuple[WorkerSpec, subprocess.Popen[str], Path]] = []
    running: list[RunningWorker] = []
    try:
        for spec in specs:
            log = workdir / f"{spec.worker_id}.log"
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
                "--worker-id",
                spec.worker_id,
                "--seed",
                str(spec.seed),
                "--tp-rank",
                str(spec.tp_rank),
                "--tp-size",
                str(spec.tp_size),
                "--pp-rank",
                str(spec.pp_rank),
                "--pp-size",
                str(spec.pp_size),
                "--sp-rank",
                str(spec.sp_rank),
                "--sp-size",
                str(spec.sp_size),
            ]
            if dump_dir is not None:
                cmd += ["--dump-dir", str(dump_dir)]
            with open(log, "w") as errf:
                proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=errf, text=True, env=gpu_env(spec.visible)
                )
            started.append((spec, proc, log))
        for spec, proc, log in started:
            line = _first_line(proc, 120.0)
            prefix = "weightwire-serve listening "
            if not line.startswith(prefix):
                raise RuntimeError(
                    f"worker {spec.worker_id} did not start (got {line!r}):\n{log.read_text()[-4000:]}"
                )
            running.append(RunningWorker(spec, proc, line[len(prefix) :].strip(), log))
        yield running
    finally:
        for _, proc, _ in started:
            if proc.poll() is None:
                proc.terminate()
        for _, proc, _ in started:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def trainer(visible: str, endpoints: list[str], bucket_size_bytes: int = 128 * 1024) -> Iterator[JsonProcess]:
    """tests/gpu/trainer.py (weightwire's client) on GPU ``visible``."""
    errlog = Path(tempfile.mkstemp(prefix="ww-trainer-", suffix=".log")[1])
    with open(errlog, "w") as errf:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "trainer.py"),
                "--endpoints",
                ",".join(endpoints),
                "--bucket-size-bytes",
                str(bucket_size_bytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errf,
            text=True,
            env=gpu_env(visible),
        )
    jp = JsonProcess(proc, errlog)
    try:
        yield jp
    finally:
        jp.close()
        errlog.unlink(missing_ok=True)


class JsonProcess(LineProcess):
    """A LineProcess whose answers are JSON."""

    def call(self, cmd: str, version: int = 0, opts: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
        import json

        line = f"{cmd} {version}" + (f" {json.dumps(opts)}" if opts is not None else "")
        return json.loads(self.ask(line))


def expect_dump(dump_dir: Path, spec: WorkerSpec, version: int) -> None:
    """The worker's dump of ``version`` holds exactly its shard of the weights of that version."""
    from safetensors.torch import load_file
    from weightwire.adapters.torch.demo import DemoConfig, expected_shard, full_checkpoint

    path = dump_dir / f"{spec.worker_id}-v{version}.safetensors"
    if not path.exists():
        raise AssertionError(f"no dump {path.name}; have {sorted(p.name for p in dump_dir.iterdir())}")
    got = load_file(str(path))
    config = DemoConfig()
    want = expected_shard(full_checkpoint(config, version), spec.rank(), config)
    if set(got) != set(want):
        raise AssertionError(f"{spec.worker_id}: dumped names differ: {sorted(set(got) ^ set(want))}")
    for name, t in want.items():
        if not torch.equal(got[name], t):
            raise AssertionError(
                f"{spec.worker_id} v{version}: {name} differs from the weights of that version"
            )
