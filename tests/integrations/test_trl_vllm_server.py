"""weightwire.integrations.trl driven the way TRL's AsyncGRPOTrainer drives a weight-transfer backend,
into a real vLLM server (``vllm.entrypoints.openai.api_server`` on CPU, TP=1, the ``weightwire``
weight-transfer backend, ``VLLM_SERVER_DEV_MODE=1``), one server for the module.

The trainer is a transformers model of the checkpoint the server started from, trained for real
(AdamW steps on a language-model loss). Each sync is what ``AsyncGRPOTrainer._sync_weight_merged``
runs on the main process: ``pause()``, ``send_weights(self._streaming_iter())`` (the generator of
``(name, param.detach())`` over ``named_parameters()``, on an object whose ``state.global_step`` is
the step, as TRL's trainer is), ``resume()``. After each sync the server's greedy tokens equal
transformers' on the trainer's weights and ``/weight_info`` reports the step; a trainer of another
model and a stale step fail ``send_weights`` with weightwire's reason and leave the engine as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import transformers
from engine_checks import Expected
from trl.experimental.async_grpo.async_grpo_trainer import WeightTransferProtocol
from vllm_cpu import HERE, NEW_TOKENS, PROMPTS, ModelSpec, checkpoint, save_checkpoint
from weightwire.client import PlanError, PushError
from weightwire.integrations.trl import WeightwireTransfer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SPEC = ModelSpec()
START = 1
DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


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
    tmp = tmp_path_factory.mktemp("trl-vllm")
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
            *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)),
            *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager"),
            *("--max-model-len", "128", "--seed", "0", "--skip-tokenizer-init"),
            *("--weight-transfer-config", '{"backend": "weightwire"}'),
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


class Trainer:
    """What the backend sees of AsyncGRPOTrainer: ``state.global_step`` and ``_streaming_iter`` (the
    same generator as TRL's for an unwrapped, unsharded model), around a real model and optimizer."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor]) -> None:
        self.model = transformers.AutoModelForCausalLM.from_config(spec.hf_config())
        self.model.load_state_dict(weights, strict=False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-2)
        self.state = types.SimpleNamespace(global_step=0)
        self.spec = spec

    def train_step(self) -> None:
        ids = torch.tensor([[(13 * i + 5 * self.state.global_step) % self.spec.vocab for i in range(32)]])
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.state.global_step += 1

    def _streaming_iter(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, param.detach()

    def sync(self, transfer: WeightTransferProtocol) -> None:
        transfer.pause()
        transfer.send_weights(self._streaming_iter())
        transfer.resume()

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def test_trainer_steps_reach_the_engine_as_its_weights_and_version(server: Server) -> None:
    start = checkpoint(SPEC, START)
    expected = Expected(SPEC, start)
    assert server.generate() == expected.tokens()
    trainer = Trainer(SPEC, start)
    transfer = WeightwireTransfer(
        server.base, socket_dir=str(server.socket_dir), worker_count=1, transport="host_shm"
    )
    transfer.init_weight_transfer()
    try:
        # TRL's cold sync before the first step: the engine already serves that checkpoint.
        trainer.sync(transfer)
        assert server.generate() == expected.tokens()
        assert server.weight_version() == "default"

        before = expected.tokens()
        for step in (1, 2):
            trainer.train_step()
            trainer.sync(transfer)
            expected.weights = trainer.weights()
            assert server.weight_version() == str(step)
            assert transfer.last_version == step
            assert server.generate() == expected.tokens()
        assert expected.tokens() != before, "training changed no greedy token: the test proves nothing"

        # A stale step (a trainer restarted from an older checkpoint): the workers refuse it.
        trainer.state.global_step = 1
        with pytest.raises(PushError) as stale:
            trainer.sync(transfer)
        assert {e.reason for e in stale.value.failures.values()} == {"STALE_VERSION"}
        assert server.weight_version() == "2"
        # TRL's trainer stops at the error with the engine paused; resuming it serves the old weights.
        assert server.call("/is_paused", method="GET")["is_paused"] is True
        transfer.resume()
        assert server.generate() == expected.tokens()
    finally:
        transfer.destroy()

    # A trainer of another model (wider layers) pointed at this engine: refused before any byte.
    other = Trainer(ModelSpec(intermediate=384), checkpoint(ModelSpec(intermediate=384), 3))
    other.state.global_step = 3
    wrong = WeightwireTransfer(
        server.base, socket_dir=str(server.socket_dir), worker_count=1, transport="host_shm"
    )
    wrong.init_weight_transfer()
    try:
        with pytest.raises(PlanError) as mismatch:
            other.sync(wrong)
        assert mismatch.value.reason == "SHAPE_MISMATCH"
        assert "mlp.gate_proj.weight" in str(mismatch.value)
        wrong.resume()
    finally:
        wrong.destroy()
    assert server.weight_version() == "2"
    assert server.generate() == expected.tokens()


def docs_example() -> str:
    text = DOCS.read_text(encoding="utf-8")
    blocks = [
        b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if b.startswith("# trl_sync.py:")
    ]
    assert len(blocks) == 1, "docs/integrations.md has one trl_sync.py block"
    return blocks[0]


def test_the_docs_example_runs_as_written(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    # After the test above the engine is at version 2; the example pushes other weights as 3 and 4.
    model = Trainer(SPEC, checkpoint(SPEC, 7)).model
    exec(
        compile(docs_example(), "trl_sync.py", "exec"),
        {"server_url": server.base, "socket_dir": str(server.socket_dir), "model": model, "steps": (3, 4)},
    )
    printed = capsys.readouterr().out
    assert [line.split(":")[0] for line in printed.splitlines()] == ["step 3", "step 4"], printed
    with capsys.disabled():
        print("\n" + printed.strip())
    assert server.weight_version() == "4"
    assert server.generate() == Expected(SPEC, checkpoint(SPEC, 7)).tokens()
