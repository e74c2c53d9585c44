"""weightwire.integrations.trl with ``engine="sglang"``: the calls TRL's AsyncGRPOTrainer makes at each
sync (pause, send_weights, resume) into a real SGLang HTTP server (``python -m sglang.launch_server``,
SGLang 0.5.23 on CPU, TP=1, the weightwire plugin loaded by its entry point), one server for the
module. The backend's protocol is structural, so TRL itself is not needed here (its trainer's own
sync runs against vLLM in test_trl_vllm_server.py). After each sync the server's greedy tokens equal
transformers' on the pushed weights and every response reports the step as its weight version; a
stale step is refused with the workers' reason and the server keeps its weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import types
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from checkpoints import LLAMA, ModelSpec, full_checkpoint, reference_tokens, write_model_dir
from ports import free_port
from real_engine import SGLANG_ENVS, cpu_env, stop_process_group
from weightwire.adapters.discovery import discover
from weightwire.client import PushError, WeightPusher
from weightwire.integrations.trl import WeightwireTransfer

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

SPEC = ModelSpec(LLAMA, tie=True)
PROMPTS = [[5, 6, 7, 8], [42, 1]]
NEW_TOKENS = 8


class Server:
    def __init__(self, url: str, log_path: str, socket_dir: str) -> None:
        self.url, self.log_path, self.socket_dir = url, log_path, socket_dir

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

    def generate(self) -> tuple[list[list[int]], set[str]]:
        out = self.call(
            "/generate",
            {
                "input_ids": PROMPTS,
                "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
            },
        )
        return [o["output_ids"] for o in out], {o["meta_info"]["weight_version"] for o in out}

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-60:])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = SGLANG_ENVS["0.5.23"]
    if not env.available():
        pytest.skip("no SGLang 0.5.23 environment: `make install-sglang` makes it")
    root = tmp_path_factory.mktemp("trl-sglang")
    model = write_model_dir(SPEC, str(root / "model"), full_checkpoint(SPEC, seed=1))
    port = free_port()
    process_env = cpu_env(1)
    process_env["WEIGHTWIRE_SGLANG_SOCKET_DIR"] = f"/tmp/ww-sgl-{uuid.uuid4().hex[:10]}"
    log_path = str(root / "server.log")
    cmd = [
        *(env.python, "-m", "sglang.launch_server", "--model-path", model, "--tp", "1"),
        *("--port", str(port), "--host", "127.0.0.1", "--device", "cpu"),
        *("--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--disable-cuda-graph"),
        *("--skip-tokenizer-init", "--max-total-tokens", "4096", "--max-running-requests", "4"),
        *("--dtype", "float32", "--random-seed", "0", "--log-level", "warning"),
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=process_env, start_new_session=True
        )
    srv = Server(f"http://127.0.0.1:{port}", log_path, process_env["WEIGHTWIRE_SGLANG_SOCKET_DIR"])
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


def test_syncs_reach_an_sglang_server_as_the_step(server: Server) -> None:
    tokens, _ = server.generate()
    assert tokens == reference_tokens(SPEC, full_checkpoint(SPEC, 1), PROMPTS, NEW_TOKENS)
    state = types.SimpleNamespace(step=0)
    transfer = WeightwireTransfer(
        server.url, engine="sglang", socket_dir=server.socket_dir, worker_count=1, step=lambda: state.step
    )
    transfer.init_weight_transfer()
    try:
        for step in (1, 2):
            weights = full_checkpoint(SPEC, seed=10 + step)
            state.step = step
            transfer.pause()
            transfer.send_weights(iter(weights.items()))
            transfer.resume()
            tokens, versions = server.generate()
            assert tokens == reference_tokens(SPEC, weights, PROMPTS, NEW_TOKENS)
            assert versions == {str(step)}
            assert server.call("/model_info")["weight_version"] == str(step)

        state.step = 1
        transfer.pause()
        with pytest.raises(PushError) as stale:
            transfer.send_weights(iter({k: torch.zeros_like(v) for k, v in weights.items()}.items()))
        assert {e.reason for e in stale.value.failures.values()} == {"STALE_VERSION"}
        transfer.resume()
        tokens, versions = server.generate()
        assert tokens == reference_tokens(SPEC, weights, PROMPTS, NEW_TOKENS)
        assert versions == {"2"}
    finally:
        transfer.destroy()


def test_a_push_after_resume_memory_occupation_gives_the_new_tokens(server: Server) -> None:
    """The colocated loop: release the engine's memory while the trainer trains, resume it, push.
    On CPU SGLang's memory saver is its no-op adapter (torch_memory_saver needs CUDA), so this checks
    the routes and the adapter's path around them, not memory really unmapped and mapped again."""
    weights = full_checkpoint(SPEC, seed=30)
    with WeightPusher(discover(server.socket_dir, count=1, timeout_s=60), transport="host_shm") as pusher:
        server.call("/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
        server.call("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
        server.call("/pause_generation", {"mode": "abort"})
        pusher.push(weights, version=3)
        server.call("/continue_generation", {})
    tokens, versions = server.generate()
    assert tokens == reference_tokens(SPEC, weights, PROMPTS, NEW_TOKENS)
    assert versions == {"3"}


def test_a_push_while_the_weights_are_released_is_refused(server: Server) -> None:
    with WeightPusher(discover(server.socket_dir, count=1, timeout_s=60), transport="host_shm") as pusher:
        server.call("/release_memory_occupation", {"tags": ["weights"]})
        try:
            server.call("/pause_generation", {"mode": "abort"})
            (before,) = {st.weights_version for st in pusher.status().values()}
            with pytest.raises(PushError) as refused:
                pusher.push(full_checkpoint(SPEC, seed=40), version=before + 1)
            (failure,) = refused.value.failures.values()
            assert failure.reason == "ENGINE_ASLEEP" and "released its weights" in failure.message, failure
            assert {st.weights_version for st in pusher.status().values()} == {before}
        finally:
            server.call("/continue_generation", {})
            server.call("/resume_memory_occupation", {"tags": ["weights"]})
        # once the weights are back, the same push lands
        pusher.push(full_checkpoint(SPEC, seed=40), version=before + 1)
        assert {st.weights_version for st in pusher.status().values()} == {before + 1}
