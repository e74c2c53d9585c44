"""Tiny Qwen2/Llama checkpoints for tests/sglang and the SGLang benchmark: their shapes, seeded
weights ("version N"), a Hugging Face model directory SGLang can start from, and greedy tokens
computed with transformers as the reference a pushed engine must reproduce.

No sglang import: the pytest process uses this next to engines running in other processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

QWEN2 = "qwen2"
LLAMA = "llama"
ARCHITECTURES = {QWEN2: "Qwen2ForCausalLM", LLAMA: "LlamaForCausalLM"}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A tiny model; ``hf_config`` turns it into the Hugging Face config SGLang reads."""

    family: str
    tie: bool = False
    kv_heads: int = 2
    dtype: torch.dtype = torch.float32
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    fp8_block: int = 0
    """> 0: every linear layer block-quantised FP8 (``weight_block_size`` [b, b]), as DeepSeek's."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def has_qkv_bias(self) -> bool:
        return self.family == QWEN2

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def hf_config(self) -> Any:
        kwargs: dict[str, Any] = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.kv_heads,
            tie_word_embeddings=self.tie,
            max_position_embeddings=4096,
            dtype=self.dtype_name,
            # No end-of-sequence token: greedy runs always produce max_new_tokens tokens.
            eos_token_id=None,
            bos_token_id=None,
            architectures=[ARCHITECTURES[self.family]],
        )
        if self.family == QWEN2:
            from transformers import Qwen2Config

            return Qwen2Config(**kwargs)
        if self.family == LLAMA:
            from transformers import LlamaConfig

            return LlamaConfig(**kwargs)
        raise ValueError(f"unknown model family {self.family!r}")


def checkpoint_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face checkpoint with its full shape, from the config."""
    h, i, v, hd = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not spec.tie:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if spec.has_qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
    return shapes


def full_checkpoint(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """The weights of "version ``seed``": deterministic, distinct per tensor and per seed.

    Unit-variance weights give logits far apart, so greedy tokens do not hinge on rounding: the
    engine's kernels and transformers' agree on every argmax.
    """
    gen = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(s, generator=gen).to(spec.dtype) for n, s in sorted(checkpoint_shapes(spec).items())
    }


def write_model_dir(spec: ModelSpec, path: str, weights: dict[str, torch.Tensor]) -> str:
    """A Hugging Face model directory (config.json + model.safetensors) SGLang can start from."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    spec.hf_config().save_pretrained(path)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
    # skip_tokenizer_init: the engine needs no tokenizer files, generation takes token ids.
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({}, f)
    return path


def reference_tokens(
    spec: ModelSpec, weights: dict[str, torch.Tensor], prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy tokens of transformers' own model class on ``weights`` (computed in float32)."""
    import sglang_cpu_shims  # test support: transformers' model classes import torchvision

    sglang_cpu_shims.define_torchvision_ops()
    from transformers import AutoModelForCausalLM

    config = spec.hf_config()
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    state = {k: v.to(torch.float32) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not (spec.tie and m == "lm_head.weight")]:
        raise ValueError(f"reference model: missing {missing}, unexpected {unexpected}")
    if spec.tie:
        model.tie_weights()
    model.eval()
    out: list[list[int]] = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            new: list[int] = []
            for _ in range(max_new_tokens):
                logits = model(input_ids=ids).logits[0, -1]
                token = int(torch.argmax(logits))
                new.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            out.append(new)
    return out
