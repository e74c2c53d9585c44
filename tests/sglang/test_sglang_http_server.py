"""weightwire with SGLang's HTTP server: ``python -m sglang.launch_server`` (SGLang 0.5.23, TP2) as a
user runs it, weightwire loaded by its entry point; the test is the trainer, using the server's
own routes (/pause_generation, /continue_generation, /generate, /update_weight_version,
/model_info) around a ``WeightPusher`` push, and checks the tokens against transformers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from checkpoints import LLAMA, ModelSpec, full_checkpoint, reference_tokens, write_model_dir
from real_engine import SGLANG_ENVS, cpu_env, stop_process_group
from weightwire.adapters.sglang import discover
from weightwire.client import WeightPusher
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

SPEC = ModelSpec(LLAMA, tie=True)
PROMPTS = [[5, 6, 7, 8], [42, 1]]
NEW_TOKENS = 8
TP = 2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, url: str, proc: subprocess.Popen[str], log_path: str, socket_dir: str) -> None:
        self.url, self.proc, self.log_path, self.socket_dir = url, proc, log_path, socket_dir

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

    def generate(self) -> list[dict[str, Any]]:
        out = self.call(
            "/generate",
            {
                "input_ids": PROMPTS,
                "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
            },
        )
        assert isinstance(out, list) and len(out) == len(PROMPTS), out
        return out

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-60:])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = SGLANG_ENVS["0.5.23"]
    if not env.available():
        pytest.skip("no SGLang 0.5.23 environment: `make install-sglang` makes it")
    root = tmp_path_factory.mktemp("http")
    model = write_model_dir(SPEC, str(root / "model"), full_checkpoint(SPEC, seed=1))
    port = _free_port()
    process_env = cpu_env(TP)
    process_env["WEIGHTWIRE_SGLANG_SOCKET_DIR"] = f"/tmp/ww-sgl-{uuid.uuid4().hex[:10]}"
    log_path = str(root / "server.log")
    cmd = [
        env.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--tp",
        str(TP),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--disable-cuda-graph",
        "--skip-tokenizer-init",
        "--max-total-tokens",
        "4096",
        "--max-running-requests",
        "4",
        "--dtype",
        "float32",
        "--random-seed",
        "0",
        "--log-level",
        "warning",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=process_env, start_new_session=True
        )
    srv = Server(f"http://127.0.0.1:{port}", proc, log_path, process_env["WEIGHTWIRE_SGLANG_SOCKET_DIR"])
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang.launch_server exited with {proc.returncode}:\n{srv.log_tail()}")
            try:
                srv.call("/model_info", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"sglang.launch_server did not answer within 600 s:\n{srv.log_tail()}"
                    ) from None
                time.sleep(1.0)
        yield srv
    finally:
        stop_process_group(proc, grace_s=60)
        shutil.rmtree(srv.socket_dir, ignore_errors=True)


def test_http_server_generate_push_generate(server: Server) -> None:
    before = server.generate()
    assert [o["output_ids"] for o in before] == reference_tokens(
        SPEC, full_checkpoint(SPEC, 1), PROMPTS, NEW_TOKENS
    )

    endpoints = discover(server.socket_dir, count=TP, timeout_s=60)
    new = full_checkpoint(SPEC, seed=2)
    with WeightPusher(endpoints, transport="host_shm", timeout_s=120) as pusher:
        server.call("/pause_generation", {"mode": "abort"})
        results = pusher.push(new, version=2)
        server.call("/update_weight_version", {"new_version": "2", "abort_all_requests": False})
        server.call("/continue_generation", {})
        assert {(r.version, r.state) for r in results.values()} == {(2, "CONSISTENT")}
        assert {(s.weights_version, s.state) for s in pusher.status().values()} == {
            (2, pb.WORKER_STATE_CONSISTENT)
        }

    after = server.generate()
    assert [o["output_ids"] for o in after] == reference_tokens(SPEC, new, PROMPTS, NEW_TOKENS)
    assert {o["meta_info"]["weight_version"] for o in after} == {"2"}
    assert server.call("/model_info")["weight_version"] == "2"
