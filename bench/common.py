"""Helpers shared by ``bench_gpu.py`` and ``bench_cpu.py``: receiver processes, results files,
timing and the record of what ran where.

Receivers are ``worker.py`` processes driven line by line (JSON); results go to one JSON file,
rewritten after every case so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
now = time.perf_counter_ns

GiB = 1024**3
MiB = 1024**2


def ms(ns: float) -> float:
    return ns / 1e6


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def size_label(n: int) -> str:
    if n >= GiB and n % GiB == 0:
        return f"{n // GiB}GiB"
    return f"{n // MiB}MiB"


class Log:
    """Lines to stdout and to a file under the results folder."""

    def __init__(self, path: Path | None) -> None:
        self.f = open(path, "a", encoding="utf-8") if path else None
        self.t0 = time.monotonic()

    def __call__(self, *parts: object) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] " + " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self.f:
            self.f.write(line + "\n")
            self.f.flush()


class Results:
    """A JSON document ``{"env": ..., "cases": [...]}`` rewritten atomically after each change."""

    def __init__(self, path: Path, env: dict[str, Any]) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"env": env, "cases": []}
        self.save()

    def add(self, record: dict[str, Any]) -> None:
        self.doc["cases"].append(record)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.path)


def public_argv(argv: Sequence[str]) -> list[str]:
    """The command line as recorded in results: folder arguments shown as placeholders (results are
    committed; the paths of the machine that ran them mean nothing elsewhere)."""
    out: list[str] = []
    hide = False
    for a in argv:
        out.append("DIR" if hide else a)
        hide = a in ("--out", "--log-dir")
    return out


def environment(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    import grpc
    import torch
    from google import protobuf

    env: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "grpcio": grpc.__version__,
        "protobuf": protobuf.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_total_gib": _mem_total_gib(),
    }
    with contextlib.suppress(Exception):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=5
        )
        if commit.returncode == 0:
            env["commit"] = commit.stdout.strip()
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        with contextlib.suppress(Exception):
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            env["nvidia_smi"] = smi.stdout.strip().splitlines()
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
            env["nvidia_topo"] = topo.stdout.strip().splitlines()[:4]
    if extra:
        env.update(extra)
    return env


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _mem_total_gib() -> float:
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    return 0.0


def child_env(visible: str | None = None, threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    # Never let a child turn NVLink multicast on (it can take a shared host's GPUs down).
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    return env


class WorkerProc:
    """A ``worker.py`` process: JSON commands on stdin, one JSON line back each."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_dir / f"worker-{name}.log"
        self._log = open(self.log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "worker.py"), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.info: dict[str, Any] = {}

    def _readline(self, timeout_s: float) -> str:
        if self.proc.stdout is None:
            raise RuntimeError("no stdout pipe")
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"worker {self.name} gave no answer within {timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited (rc={self.proc.poll()}): {self.stderr_tail()}")
        return line

    def wait_ready(self, timeout_s: float = 180.0) -> dict[str, Any]:
        self.info = json.loads(self._readline(timeout_s))
        return self.info

    def send(self, cmd: dict[str, Any]) -> None:
        if self.proc.stdin is None:
            raise RuntimeError("no stdin pipe")
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float = 120.0) -> dict[str, Any]:
        out = json.loads(self._readline(timeout_s))
        if "error" in out:
            raise RuntimeError(f"worker {self.name}: {out['error']}\n{out.get('traceback', '')}")
        return out

    def call(self, cmd: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        self.send(cmd)
        return self.reply(timeout_s)

    def stderr_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def request_stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin and not self.proc.stdin.closed:
            with contextlib.suppress(Exception):
                self.send({"cmd": "quit"})
                self.proc.stdin.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.request_stop()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@contextlib.contextmanager
def worker_group(procs: list[WorkerProc], timeout_s: float = 240.0) -> Iterator[list[WorkerProc]]:
    """Wait for every (already started) worker to be ready; stop them all afterwards."""
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait_ready(max(1.0, deadline - time.monotonic()))
        yield procs
    finally:
        for p in procs:  # ask all first, so they wind down in parallel
            p.request_stop()
        for p in procs:
            p.stop()


def time_reps(fn: Callable[[], None], sync: Callable[[], None], reps: int, warmup: int = 1) -> list[float]:
    """Wall-clock milliseconds of ``fn`` (synchronised before and after), ``warmup`` runs dropped."""
    for _ in range(warmup):
        fn()
        sync()
    out = []
    for _ in range(reps):
        sync()
        t0 = now()
        fn()
        sync()
        out.append(ms(now() - t0))
    return out
