"""``python -m sglang.launch_server`` as a user runs it (SGLang 0.5.23 on this CPU, weightwire loaded by
its entry point), for the tests that drive an engine through its own HTTP routes."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ports import free_port
from real_engine import SGLANG_ENVS, cpu_env, stop_process_group

START_TIMEOUT_S = 600.0


class Server:
    """A running ``sglang.launch_server`` and its routes."""

    def __init__(self, url: str, proc: subprocess.Popen[str], log_path: str) -> None:
        self.url, self.proc, self.log_path = url, proc, log_path

    def call(self, route: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + route,
            data=data,
            headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read().decode()
        return json.loads(text) if text.strip() else None

    def tokens(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy tokens of ``prompts`` (no end-of-sequence stop)."""
        return [o["output_ids"] for o in self.generate(prompts, max_new_tokens)]

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[dict[str, Any]]:
        params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        out = self.call("/generate", {"input_ids": prompts, "sampling_params": params})
        assert isinstance(out, list) and len(out) == len(prompts), out
        return out

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-60:])


@contextmanager
def http_server(model: str, *, tp: int, log_path: str, env: dict[str, str]) -> Iterator[Server]:
    """Start the server on ``model`` with ``tp`` ranks (``env``: the WEIGHTWIRE_SGLANG_* variables
    of the test), wait until it answers, and stop it with every process it started."""
    release = SGLANG_ENVS["0.5.23"]
    port = free_port()
    process_env = {**cpu_env(tp), **env}
    # The CPU engine's settings (tests/sglang/real_engine.py engine_kwargs), as flags.
    cmd = [
        *(release.python, "-m", "sglang.launch_server", "--model-path", model, "--tp", str(tp)),
        *("--port", str(port), "--host", "127.0.0.1", "--device", "cpu"),
        *("--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--disable-cuda-graph"),
        *("--skip-tokenizer-init", "--max-total-tokens", "4096", "--max-running-requests", "4"),
        *("--dtype", "float32", "--random-seed", "0", "--log-level", "warning"),
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=process_env, start_new_session=True
        )
    srv = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang.launch_server exited with {proc.returncode}:\n{srv.log_tail()}")
            try:
                srv.call("/model_info", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"sglang.launch_server did not answer within {START_TIMEOUT_S:.0f} s:\n{srv.log_tail()}"
                    ) from None
                time.sleep(1.0)
        yield srv
    finally:
        stop_process_group(proc, grace_s=60)
