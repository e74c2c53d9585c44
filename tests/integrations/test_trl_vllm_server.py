"""weightwire.integrations.trl with TRL 1.16's AsyncGRPOTrainer and a real vLLM server
(``vllm.entrypoints.openai.api_server`` on CPU, TP=1, float32, the ``weightwire`` weight-transfer
backend, ``VLLM_SERVER_DEV_MODE=1``), one server for the module; ``ENGINE`` carries what it holds
from test to test.

1. A real ``AsyncGRPOTrainer`` built with ``weight_transfer=WeightwireTransfer(...)`` runs its own
   sync code (``_sync_weight``: pause, ``send_weights(self._streaming_iter())``, resume) at the cold
   start and after two steps: the version is the trainer's ``state.global_step``, read by the backend.
2. The same calls on a transformers model trained for real (AdamW): tokens equal transformers' on
   the trainer's weights after each sync, the version is the step; a stale step (``STALE_VERSION``)
   and a trainer of another model (``SHAPE_MISMATCH``) fail ``send_weights`` with weightwire's
   reason and leave the engine serving its previous weights at its previous version.
3. docs/integrations.md's example, as written.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
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
# What the module's one server holds now (weights and version), carried from test to test.
ENGINE = Expected(SPEC, checkpoint(SPEC, START))


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


class NoRollouts:
    """TRL's ``RolloutWorkerProtocol`` with nothing to produce: the test drives the trainer's syncs
    itself (its training forward needs CUDA, below), so no rollout is ever asked for."""

    def __init__(self) -> None:
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        self.versions: list[int] = []

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        pass


def byte_tokenizer(vocab_size: int) -> Any:
    """A small byte-level BPE tokenizer padded to the model's vocabulary (the trainer needs one for
    its pad and eos ids; the rollouts here are token ids in and out)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["The weights are new."], vocab_size=300, min_frequency=1, special_tokens=["<eos>"]
    )
    bpe.add_tokens([f"<x{i}>" for i in range(bpe.get_vocab_size(), vocab_size)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")


def test_async_grpo_trainer_syncs_through_weightwire(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real AsyncGRPOTrainer built with the backend; its own train-begin setup and _sync_weight.

    TRL 1.16's training forward cannot run on a CPU: the trainer loads the policy with its tree
    attention, which calls flash-attn varlen kernels (the ``kernels`` package, CUDA only). So the
    test runs what ``train()`` runs around the optimisation steps, in its order: the train-begin
    callback's ``init_weight_transfer()`` and cold ``_sync_weight()``, then after each step (here the
    parameters moved by hand and ``state.global_step`` advanced, as the Trainer does)
    ``_sync_weight()``, TRL's own pause / ``send_weights(self._streaming_iter())`` / resume.
    """
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer

    # TRL reads the training GPU's name for its MFU metric (torch.cuda.get_device_name raises on a
    # CPU torch); None is what it uses for a device it does not know.
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *a, **k: None)
    assert ENGINE.version == 0, "runs first: a fresh run's cold sync meets the start-up checkpoint"
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        weight_sync_steps=1,
        dtype="float32",
        vllm_server_base_url=server.base,
        report_to="none",
        use_cpu=True,
    )
    transfer = WeightwireTransfer(
        server.base, socket_dir=str(server.socket_dir), worker_count=1, transport="host_shm"
    )
    rollouts = NoRollouts()
    trainer = AsyncGRPOTrainer(
        model=server.model,
        args=config,
        processing_class=byte_tokenizer(SPEC.vocab),
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]] * 8}),
        rollout_worker=rollouts,
        weight_transfer=transfer,
    )
    assert trainer.weight_transfer is transfer
    transfer.init_weight_transfer()
    try:
        trainer._sync_weight()  # the cold sync, at global_step 0
        assert transfer.last_version is None and server.weight_version() == "default"
        assert server.generate() == ENGINE.tokens()
        for step in (1, 2):
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            trainer.state.global_step = step
            trainer._sync_weight()
            ENGINE.weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            ENGINE.version = step
            assert server.weight_version() == str(step)
            assert server.generate() == ENGINE.tokens()
        assert rollouts.versions == [1, 2, 3]  # TRL's own count of syncs, told to its rollout worker
    finally:
        transfer.destroy()


def test_trainer_steps_reach_the_engine_as_its_weights_and_version(server: Server) -> None:
    base = ENGINE.version
    trainer = Trainer(SPEC, ENGINE.weights)
    trainer.state.global_step = base
    transfer = WeightwireTransfer(
        server.base, socket_dir=str(server.socket_dir), worker_count=1, transport="host_shm"
    )
    transfer.init_weight_transfer()
    try:
        # TRL's sync before the first step (of a fresh or a resumed run): the engine holds that step.
        trainer.sync(transfer)
        assert transfer.last_version is None
        assert server.generate() == ENGINE.tokens()

        before = ENGINE.tokens()
        for step in (base + 1, base + 2):
            trainer.train_step()
            trainer.sync(transfer)
            ENGINE.weights, ENGINE.version = trainer.weights(), step
            assert server.weight_version() == str(step)
            assert transfer.last_version == step
            assert server.generate() == ENGINE.tokens()
        assert ENGINE.tokens() != before, "training changed no greedy token: the test proves nothing"

        # A stale step (a trainer restarted from an older checkpoint): the workers refuse it.
        trainer.state.global_step = base + 1
        with pytest.raises(PushError) as stale:
            trainer.sync(transfer)
        assert {e.reason for e in stale.value.failures.values()} == {"STALE_VERSION"}
        assert server.weight_version() == str(ENGINE.version)
        # TRL's trainer stops at the error with the engine paused; resuming it serves the old weights.
        assert server.call("/is_paused", method="GET")["is_paused"] is True
        transfer.resume()
        assert server.generate() == ENGINE.tokens()
    finally:
        transfer.destroy()

    # A trainer of another model (wider layers) pointed at this engine: refused before any byte.
    other = Trainer(ModelSpec(intermediate=384), checkpoint(ModelSpec(intermediate=384), 3))
    other.state.global_step = ENGINE.version + 1
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
    assert server.weight_version() == str(ENGINE.version)
    assert server.generate() == ENGINE.tokens()


def docs_example() -> str:
    text = DOCS.read_text(encoding="utf-8")
    blocks = [
        b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if b.startswith("# trl_sync.py:")
    ]
    assert len(blocks) == 1, "docs/integrations.md has one trl_sync.py block"
    return blocks[0]


def test_the_docs_example_runs_as_written(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    model = Trainer(SPEC, checkpoint(SPEC, 7)).model
    steps = (ENGINE.version + 1, ENGINE.version + 2)
    namespace = {
        "server_url": server.base,
        "socket_dir": str(server.socket_dir),
        "model": model,
        "steps": steps,
    }
    exec(compile(docs_example(), "trl_sync.py", "exec"), namespace)
    printed = capsys.readouterr().out
    assert [line.split(":")[0] for line in printed.splitlines()] == [f"step {s}" for s in steps], printed
    with capsys.disabled():
        print("\n" + printed.strip())
    ENGINE.weights, ENGINE.version = checkpoint(SPEC, 7), steps[-1]
    assert server.weight_version() == str(steps[-1])
    assert server.generate() == ENGINE.tokens()
