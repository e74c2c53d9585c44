"""SGLang's real model classes under its real parallel state, for the fake-scheduler rank processes
(``rank_worker.py``); never imported by the pytest process, which stays free of sglang. The shims
that let SGLang import on a CPU machine come from the test-support package ``sglang_cpu_shims``
(tests/support), applied here explicitly because these processes are not started by SGLang.
"""

from __future__ import annotations

import os
from typing import Any

import sglang_cpu_shims
import torch

QWEN2 = "qwen2"
LLAMA = "llama"


def prepare_cpu_import() -> None:
    sglang_cpu_shims.apply()


def init_parallel(
    *, rank: int, world_size: int, tp_size: int, pp_size: int, init_port: int, ep_size: int = 1
) -> None:
    """SGLang's distributed environment and model-parallel groups over gloo, as its layer tests do
    (``ep_size`` > 1: the MoE layers' expert parallelism within the TP group)."""
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
        ServerArgs(model_path="dummy", tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, device="cpu"),
        role="test",
        ranks=SpawnRanks(world_rank=rank),
    )
    initialize_model_parallel(backend="gloo")


def fp8_config(block: int) -> Any:
    """SGLang's config of a block-quantised FP8 checkpoint (DeepSeek-V3's: dynamic activations)."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    return Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[block, block]
    )


def build_model(family: str, config: Any, dtype: torch.dtype, quant_config: Any = None) -> torch.nn.Module:
    """SGLang's own model class for ``family``, built under the current parallel state."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if family == QWEN2:
            from sglang.srt.models.qwen2 import Qwen2ForCausalLM

            return Qwen2ForCausalLM(config, quant_config=quant_config)
        if family == LLAMA:
            from sglang.srt.models.llama import LlamaForCausalLM

            return LlamaForCausalLM(config, quant_config=quant_config)
    finally:
        torch.set_default_dtype(previous)
    raise ValueError(f"unknown model family {family!r}")
