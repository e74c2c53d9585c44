"""weightwire.integrations.trl with TRL 1.16's AsyncGRPOTrainer and a real vLLM server
(``vllm.entrypoints.openai.api_server`` on CPU, TP=1, float32, the ``weightwire`` weight-transfer
backend, ``VLLM_SERVER_DEV_MODE=1``), one server for the module; ``ENGINE`` carries what it holds
from test to test.

1. ``AsyncGRPOTrainer(..., weight_transfer=WeightwireTransfer(...)).train()`` for two optimisation
   steps, TRL's rollout process sampling from the server: after each sync the server's greedy tokens
   are transformers' greedy tokens on the trainer's weights (to a near tie: the trained weights are
   not chosen by the test) and its version is the step; a run of another model
   fails ``train()`` with weightwire's reason. The one stand-in is the flash-attn varlen kernel TRL's
   tree attention calls (CUDA only), replaced by the same computation in torch.
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
import re
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
from ports import free_port
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
    # TRL's rollouts apply the chat template and ask vLLM for logprobs, which vLLM detokenizes.
    byte_tokenizer(SPEC.vocab).save_pretrained(model)
    port = free_port()
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
            *("--max-model-len", "128", "--seed", "0"),
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


def byte_tokenizer(vocab_size: int) -> Any:
    """A small byte-level BPE tokenizer padded to the model's vocabulary, saved with the checkpoint:
    TRL tokenizes its prompts through the chat template, vLLM detokenizes the logprobs TRL asks for."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["The weights are new."], vocab_size=300, min_frequency=1, special_tokens=["<eos>"]
    )
    bpe.add_tokens([f"<x{i}>" for i in range(bpe.get_vocab_size(), vocab_size)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")
    # A chat template TRL knows how to parse responses of (it refuses one it does not recognise).
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def varied_reward(completions: list[Any], **_: Any) -> list[float]:
    """A reward that differs between a prompt's samples, so GRPO's advantages (and the gradient) are
    not zero. Module-level: TRL pickles reward functions into its rollout process."""
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


class TorchVarlenAttention:
    """Stand-in for the one thing here that cannot run on a CPU: the flash-attn 3 varlen kernel that
    TRL 1.16's tree attention (``trl.experimental.async_grpo.packing.tree_attention``) loads through
    the ``kernels`` package, which has CUDA / ROCm builds only. The same computation in torch: each
    packed segment's queries attend causally (bottom-right aligned, as flash-attn) to the keys and
    values tree attention gathered for that segment's path."""

    @staticmethod
    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float | None = None,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        **_: Any,
    ) -> torch.Tensor:
        assert causal and window_size == (-1, -1), "the test's model has neither"
        out = torch.empty_like(q)
        groups = q.shape[1] // k.shape[1]
        for s in range(len(cu_seqlens_q) - 1):
            q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
            k0, k1 = int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
            keys, values = (x[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1) for x in (k, v))
            mask = torch.arange(k1 - k0)[None, :] <= torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
            attended = torch.nn.functional.scaled_dot_product_attention(
                q[q0:q1].transpose(0, 1), keys, values, attn_mask=mask, scale=softmax_scale
            )
            out[q0:q1] = attended.transpose(0, 1)
        return out


class RecordingTransfer(WeightwireTransfer):
    """The backend as a user configures it, recording after each sync that pushed (at TRL's
    ``resume()``, when the engine generates again) the engine's version and greedy tokens beside
    the trainer's weights at that moment."""

    def __init__(self, server: Server) -> None:
        super().__init__(server.base, socket_dir=str(server.socket_dir), worker_count=1, transport="host_shm")
        self.server = server
        self.trainer: Any = None
        self.synced: list[tuple[int, str, list[list[int]], dict[str, torch.Tensor]]] = []

    def resume(self) -> None:
        super().resume()
        if self.last_version is not None and (not self.synced or self.synced[-1][0] != self.last_version):
            weights = {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()}
            self.synced.append(
                (self.last_version, self.server.weight_version(), self.server.generate(), weights)
            )


def grpo_trainer(server: Server, model: str, out: Path, transfer: WeightwireTransfer) -> Any:
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    config = AsyncGRPOConfig(
        output_dir=str(out),
        max_steps=2,
        weight_sync_steps=1,
        dtype="float32",
        learning_rate=1e-2,
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=8,
        vllm_server_base_url=server.base,
        report_to="none",
        use_cpu=True,
    )
    # A system turn keeps the chat template's default one (longer than the server's 128 tokens) out.
    prompt = [{"role": "system", "content": "w"}, {"role": "user", "content": "The weights"}]
    return AsyncGRPOTrainer(
        model=model,
        args=config,
        reward_funcs=varied_reward,
        train_dataset=Dataset.from_dict({"prompt": [prompt] * 8}),
        weight_transfer=transfer,
    )


def test_async_grpo_trainer_trains_through_weightwire(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AsyncGRPOTrainer.train()`` for two optimisation steps: TRL's rollout process samples from
    the server, the trainer trains on CPU and syncs through weightwire after each step. After each
    sync the server's greedy tokens equal transformers' on the trainer's weights and it reports the
    step as its weights version. Then a trainer of another model fails ``train()`` with weightwire's
    reason at its first sync, and the engine keeps serving the first run's weights."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    monkeypatch.setattr(packing, "_flash_attn", lambda: TorchVarlenAttention)
    # TRL reads the training GPU's name for its MFU metric (torch.cuda.get_device_name raises on a
    # CPU torch); None is what it uses for a device it does not know.
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *a, **k: None)
    assert ENGINE.version == 0, "runs first: a fresh run's cold sync meets the start-up checkpoint"
    before = server.generate()
    ENGINE.check_generated(before)

    transfer = RecordingTransfer(server)
    trainer = grpo_trainer(server, server.model, tmp_path / "out", transfer)
    transfer.trainer = trainer
    trainer.train()

    assert trainer.state.global_step == 2
    assert [(step, version) for step, version, _, _ in transfer.synced] == [(1, "1"), (2, "2")]
    for _, _, tokens, weights in transfer.synced:
        Expected(SPEC, weights).check_generated(tokens)
    ENGINE.weights, ENGINE.version = transfer.synced[-1][3], 2
    after = server.generate()
    assert server.weight_version() == "2"
    ENGINE.check_generated(after)
    assert after != before, "training changed no greedy token: the test proves nothing"

    # A run of another model (wider MLPs) against this engine: its cold sync is refused before any
    # byte is sent, and train() fails with weightwire's reason naming the tensor.
    other = ModelSpec(intermediate=384)
    other_model = save_checkpoint(other, checkpoint(other, 3), tmp_path / "other")
    transformers.AutoTokenizer.from_pretrained(server.model).save_pretrained(other_model)
    wrong = grpo_trainer(server, str(other_model), tmp_path / "wrong", RecordingTransfer(server))
    with pytest.raises(PlanError) as mismatch:
        wrong.train()
    assert mismatch.value.reason == "SHAPE_MISMATCH" and "mlp.gate_proj.weight" in str(mismatch.value)
    assert wrong.state.global_step == 0
    # TRL stopped at the error with the engine paused (as with its own backend); resumed, the engine
    # serves the first run's weights at its version.
    server.call("/resume")
    assert server.weight_version() == "2"
    ENGINE.check_generated(server.generate())


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
        before = server.generate()
        ENGINE.check_generated(before)

        for step in (base + 1, base + 2):
            trainer.train_step()
            trainer.sync(transfer)
            ENGINE.weights, ENGINE.version = trainer.weights(), step
            assert server.weight_version() == str(step)
            assert transfer.last_version == step
            ENGINE.check_generated(server.generate())
        assert server.generate() != before, "training changed no greedy token: the test proves nothing"

        # A stale step (a trainer restarted from an older checkpoint): the workers refuse it.
        trainer.state.global_step = base + 1
        with pytest.raises(PushError) as stale:
            trainer.sync(transfer)
        assert {e.reason for e in stale.value.failures.values()} == {"STALE_VERSION"}
        assert server.weight_version() == str(ENGINE.version)
        # TRL's trainer stops at the error with the engine paused; resuming it serves the old weights.
        assert server.call("/is_paused", method="GET")["is_paused"] is True
        transfer.resume()
        ENGINE.check_generated(server.generate())
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
    ENGINE.check_generated(server.generate())


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
