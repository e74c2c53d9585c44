"""The pytest side of a real SGLang engine: start ``engine_host.py`` (a real ``sglang.Engine``) with
the Python of one SGLang environment, talk to it, and stop it with every process it started.

No sglang import here. Which environments exist: ``SGLANG_ENVS`` (the project's ``.venv`` has
SGLang 0.5.23; ``make install-sglang-0517`` makes ``.venv-sglang-0517`` with 0.5.17).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import threading
import time
from typing import Any

from shm_leftovers import GroupShm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
START_TIMEOUT_S = 600.0
COMMAND_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class SGLangEnv:
    """A Python environment with SGLang, weightwire and the CPU shims installed."""

    version: str
    python: str

    def available(self) -> bool:
        return os.access(self.python, os.X_OK)


SGLANG_ENVS = {
    "0.5.23": SGLangEnv("0.5.23", os.path.join(ROOT, ".venv", "bin", "python")),
    "0.5.17": SGLangEnv("0.5.17", os.path.join(ROOT, ".venv-sglang-0517", "bin", "python")),
}


def engine_kwargs(
    model_path: str,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "float32",
    sleep_on_idle: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """``sglang.Engine`` arguments that run on a CPU-only machine (no CPU kernels of sgl_kernel:
    every op runs its ``forward_native`` version)."""
    return {
        "model_path": model_path,
        "tp_size": tp,
        "pp_size": pp,
        "device": "cpu",
        "attention_backend": "torch_native",
        "sampling_backend": "pytorch",
        "disable_cuda_graph": True,
        "skip_tokenizer_init": True,
        "max_total_tokens": 4096,
        "context_length": 4096,
        "max_running_requests": 4,
        "dtype": dtype,
        "sleep_on_idle": sleep_on_idle,
        "random_seed": 0,
        "log_level": "warning",
        **extra,
    }


def cpu_env(tp: int, pp: int = 1, release: str = "0.5.23") -> dict[str, str]:
    """Environment of an engine with ``tp`` x ``pp`` ranks on this machine's cores."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.pop("SGLANG_USE_CPU_ENGINE", None)  # it needs a CPU build of sgl_kernel that no index serves
    env.pop("SGLANG_PLUGINS", None)
    env.pop("WEIGHTWIRE_SGLANG_ENABLE", None)
    cores = max(1, os.cpu_count() or 1)
    # SGLang binds each rank's OpenMP threads from this `|`-separated list: 0.5.17 wants exactly one
    # entry per TP rank, 0.5.23 one per rank of the whole engine (it indexes by device id).
    entries = tp if release == "0.5.17" else tp * pp
    env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(entries))
    return env


class EngineError(RuntimeError):
    """The engine host answered a command with an error, or died."""


class EngineHost:
    """One real SGLang engine in its own process tree (driver, schedulers, detokenizer)."""

    def __init__(
        self,
        env: SGLangEnv,
        kwargs: dict[str, Any],
        *,
        socket_dir: str,
        log_path: str,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.env = env
        self.socket_dir = socket_dir
        self.log_path = log_path
        process_env = cpu_env(int(kwargs.get("tp_size", 1)), int(kwargs.get("pp_size", 1)), env.version)
        process_env["WEIGHTWIRE_SGLANG_SOCKET_DIR"] = socket_dir
        process_env.update(extra_env or {})
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [env.python, os.path.join(HERE, "engine_host.py"), json.dumps(kwargs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=process_env,
            start_new_session=True,  # its own process group: stop() can end everything it started
        )
        self.shm = GroupShm(self.proc.pid)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            ready = self._read(START_TIMEOUT_S)
            if not ready.get("ready"):
                raise EngineError(f"unexpected first line from the engine host: {ready}")
            self.sglang_version: str = ready["sglang"]
            self.shm.sample()
        except BaseException:
            self.stop()
            raise

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(line)
        self._lines.put(None)

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def _read(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(
                f"the engine host said nothing for {timeout:g} s; log:\n{self.log_tail()}"
            ) from None
        if line is None:
            self.proc.wait(timeout=30)
            raise EngineError(f"the engine host exited with {self.proc.returncode}; log:\n{self.log_tail()}")
        return json.loads(line)  # type: ignore[no-any-return]

    def call(self, op: str, timeout: float = COMMAND_TIMEOUT_S, **args: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        answer = self._read(timeout)
        if not answer.get("ok"):
            raise EngineError(f"{op}: {answer.get('error')}\n{answer.get('traceback', '')}")
        return answer.get("result")

    # -- the user's view of the engine --

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[dict[str, Any]]:
        return self.call("generate", input_ids=prompts, max_new_tokens=max_new_tokens)  # type: ignore[no-any-return]

    def tokens(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return [o["output_ids"] for o in self.generate(prompts, max_new_tokens)]

    def pause(self, mode: str = "abort") -> None:
        self.call("pause", mode=mode)

    def resume(self) -> None:
        self.call("continue")

    def stop(self) -> None:
        """Shut the engine down; whatever is left of its process group after 60 s is killed, and
        the shared memory it leaves (SGLang kills its own processes) is removed."""
        self.shm.sample()  # while it still runs: its shutdown kills the processes that hold them
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        stop_process_group(self.proc, shm=self.shm)
        self._log.close()


def stop_process_group(
    proc: subprocess.Popen[str], grace_s: float = 0.0, shm: GroupShm | None = None
) -> None:
    """End ``proc`` and everything left in its process group (it was started with
    ``start_new_session=True``): SIGTERM, up to ``grace_s`` for a clean exit, then SIGKILL; then
    remove the /dev/shm segments the group held (``shm``: sampled while it ran; else sampled here,
    before the first signal) that nothing alive holds any more."""
    if shm is None:
        shm = GroupShm(proc.pid)
    shm.sample()
    if grace_s > 0 and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    deadline = time.monotonic() + 20
    sig = signal.SIGTERM
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.5)
        proc.poll()  # reap the leader, or its zombie keeps the group alive
        sig = signal.SIGKILL
    proc.wait(timeout=30)
    shm.remove_leftovers()
