"""Running SGLang's real model classes and parallel state on a CPU machine, for tests/sglang.

Imported by the rank processes (``rank_worker.py``) and the plugin-hook check (``hook_check.py``),
never by the pytest process itself, which stays free of sglang. Two stand-ins make SGLang 0.5.23
importable here, each for something that only a GPU forward pass would use:

- the torchvision on the package index is built for a CUDA torch; with the CPU torch its
  ``torchvision::nms``/``qnms`` operators are missing and ``import torchvision`` fails, and SGLang
  imports torchvision unconditionally. Defining the two operator schemas first lets it import
  (they are never called: no detection model runs here).
- on a machine without CUDA, ``RotaryEmbedding.__init__`` imports ``vllm._custom_ops`` for its
  fallback kernel, used only in forward; ``FakeVllmCustomOps`` provides the name and raises if
  anything ever calls it.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch

QWEN2 = "qwen2"
LLAMA = "llama"


def prepare_cpu_import() -> None:
    """Make ``import sglang`` work with the CPU torch (see module docstring). Idempotent."""
    if not _op_defined("nms"):
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold, float? score_threshold=None) -> Tensor")
        _KEEP_ALIVE.append(lib)
    if "vllm._custom_ops" not in sys.modules:
        vllm = types.ModuleType("vllm")
        ops = types.ModuleType("vllm._custom_ops")

        def rotary_embedding(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("FakeVllmCustomOps.rotary_embedding: no forward pass runs in these CPU tests")

        ops.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
        vllm._custom_ops = ops  # type: ignore[attr-defined]
        sys.modules["vllm"] = vllm
        sys.modules["vllm._custom_ops"] = ops


_KEEP_ALIVE: list[Any] = []


def _op_defined(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def init_parallel(*, rank: int, world_size: int, tp_size: int, pp_size: int, init_port: int) -> None:
    """SGLang's distributed environment and model-parallel groups over gloo, as its layer tests do."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(init_port))
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(
        world_size=world_size,
        rank=rank,
        local_rank=rank,
        backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{init_port}",
    )
    publish(
        ServerArgs(model_path="dummy", tp_size=tp_size, pp_size=pp_size, device="cpu"),
        role="test",
        ranks=SpawnRanks(world_rank=rank),
    )
    initialize_model_parallel(backend="gloo")


def hf_config(family: str, **overrides: Any) -> Any:
    """A tiny Hugging Face config of ``family`` (the tests' expectations read the same values)."""
    base: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )
    base.update(overrides)
    if family == QWEN2:
        from transformers import Qwen2Config

        return Qwen2Config(**base)
    if family == LLAMA:
        from transformers import LlamaConfig

        return LlamaConfig(**base)
    raise ValueError(f"unknown model family {family!r}")


def build_model(family: str, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """SGLang's own model class for ``family``, built under the current parallel state."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if family == QWEN2:
            from sglang.srt.models.qwen2 import Qwen2ForCausalLM

            return Qwen2ForCausalLM(config)
        if family == LLAMA:
            from sglang.srt.models.llama import LlamaForCausalLM

            return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    raise ValueError(f"unknown model family {family!r}")
