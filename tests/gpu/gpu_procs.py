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

    def ask(self, line: str) -> str:
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError("process has no pipes")
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"process exited (rc={self.proc.wait()}) while answering {line!r}:\n{err}")
        return answer.strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.ask("quit")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def producer(visible: str, size: int, lead: int = 0) -> Iterator[LineProcess]:
    """tests/gpu/ipc_producer.py on the GPU(s) ``visible`` (a CUDA_VISIBLE_DEVICES value)."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "ipc_producer.py"), str(size), str(lead)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=gpu_env(visible),
    )
    lp = LineProcess(proc)
    try:
        yield lp
    finally:
        lp.close()
