"""weightwire behind vLLM's OpenAI-compatible server, driven the way docs/vllm.md tells an HTTP user.

One ``vllm.entrypoints.openai.api_server`` process (TP=1; ``VLLM_SERVER_DEV_MODE=1`` for vLLM's
weight-update routes; ``--weight-transfer-config '{"backend": "weightwire"}'``), started and stopped
by this module. The trainer finds the worker with ``discover`` on the socket directory, and the
update is ``POST /pause``, ``POST /start_weight_update``, ``WeightPusher.push``,
``POST /finish_weight_update {"weight_version": ...}``, ``POST /resume``; completions (token ids in,
token ids out) must then equal the reference of the pushed weights, and ``GET /weight_info`` must
report the version.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from engine_checks import Expected, refused
from vllm_cpu import HERE, NEW_TOKENS, PROMPTS, ModelSpec, checkpoint, save_checkpoint
from weightwire.adapters.discovery import discover
from weightwire.client import PushError, WeightPusher

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SPEC = ModelSpec()
START, SECOND = 1, 2


class Server:
    def __init__(self, base: str, model: str, socket_dir: Path) -> None:
        self.base, self.model, self.socket_dir = base, model, socket_dir

    def call(self, path: str, body: dict[str, Any] | None = None, *, method: str = "POST") -> Any:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        request = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read() or b"null")

    def generate(self) -> list[list[int]]:
        out = []
        for prompt in PROMPTS:
            reply = self.call(
                "/v1/completions",
                {
                    "model": self.model,
                    "prompt": list(prompt),
                    "max_tokens": NEW_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            out.append(list(reply["choices"][0]["token_ids"]))
        return out

    def weight_version(self) -> str:
        return str(self.call("/weight_info", method="GET")["weight_version"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("vllm-http")
    model = save_checkpoint(SPEC, checkpoint(SPEC, START), tmp / "ckpt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "WEIGHTWIRE_VLLM_SOCKET_DIR": str(tmp / "sock"),
        "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p),
    }
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "128",
            "--seed",
            "0",
            "--skip-tokenizer-init",
            "--weight-transfer-config",
            '{"backend": "weightwire"}',
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    srv = Server(f"http://127.0.0.1:{port}", str(model), tmp / "sock")
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(urllib.error.URLError, ConnectionError, OSError):
                srv.call("/health", method="GET")
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM's server did not come up; its log:\n{(tmp / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(1)
        yield srv
    finally:
        tree = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        _, alive = psutil.wait_procs(tree, timeout=30)
        for child in alive:  # only the server's own processes
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        log.close()
        assert not alive, f"vLLM's server left {len(alive)} process(es) running: {[c.pid for c in alive]}"


def test_the_documented_http_sequence_updates_tokens_and_version(server: Server) -> None:
    expected = Expected(SPEC, checkpoint(SPEC, START))
    assert server.generate() == expected.tokens()
    assert server.weight_version() == "default"
    with WeightPusher(
        discover(str(server.socket_dir), count=1, timeout_s=60), transport="host_shm", timeout_s=120
    ) as pusher:
        second = checkpoint(SPEC, SECOND)
        with pytest.raises(PushError) as outside:
            pusher.push(second, version=1)  # no /start_weight_update yet
        assert refused(outside.value, {"ENGINE_NOT_PAUSED"})
        assert server.generate() == expected.tokens()

        assert server.call("/pause?mode=abort") == {"status": "paused"}
        server.call("/start_weight_update")
        results = pusher.push(second, version=1)
        server.call("/finish_weight_update", {"weight_version": "1"})
        assert server.call("/resume") == {"status": "resumed"}
    assert {r.version for r in results.values()} == {1}
    expected.weights = dict(second)
    assert server.generate() == expected.tokens()
    assert server.weight_version() == "1"
