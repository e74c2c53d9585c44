"""Tiny mixture-of-experts checkpoints for the MoE tests of both engine adapters: their
checkpoint names and shapes, seeded weights ("version N"), a Hugging Face model directory an
engine can start from, and greedy tokens of transformers' own model class on the same weights (the
reference a pushed engine must reproduce).

Two architectures, between them every part a mixture-of-experts manifest has to state:

- Qwen2-MoE (``QWEN2_MOE``): per-expert ``mlp.experts.E.{gate,up,down}_proj`` (the engines fuse
  them into one ``w13``/``w2`` tensor per layer), a shared expert (a dense gate/up/down MLP) and
  two small linear layers (the router ``mlp.gate`` and ``mlp.shared_expert_gate``);
- Qwen3-MoE (``QWEN3_MOE``): routed experts and the router only, plus q/k norms. SGLang 0.5.23
  runs it on CPU; its Qwen2-MoE applies the shared-expert gate with a Triton kernel even on CPU,
  so the SGLang engine tests use this one.

Head size 32: vLLM's CPU attention needs at least that. No engine import: tests/sglang and
tests/vllm both use it in the pytest process, next to engines running in other processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

QWEN2_MOE = "qwen2_moe"
QWEN3_MOE = "qwen3_moe"


@dataclasses.dataclass(frozen=True)
class MoESpec:
    arch: str = QWEN2_MOE
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 128
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 64
    num_experts: int = 4
    num_experts_per_tok: int = 2
    num_layers: int = 2
    num_heads: int = 4
    kv_heads: int = 2
    dtype: torch.dtype = torch.float32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def shared_expert(self) -> bool:
        return self.arch == QWEN2_MOE

    def hf_config(self) -> Any:
        from transformers import Qwen2MoeConfig, Qwen3MoeConfig

        if self.arch == QWEN2_MOE:
            cls: Any = Qwen2MoeConfig
            extra: dict[str, Any] = {
                "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                "architectures": ["Qwen2MoeForCausalLM"],
            }
        elif self.arch == QWEN3_MOE:
            cls = Qwen3MoeConfig
            extra = {"head_dim": self.head_dim, "architectures": ["Qwen3MoeForCausalLM"]}
        else:
            raise ValueError(f"unknown architecture {self.arch!r}")
        return cls(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.kv_heads,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            dtype=self.dtype_name,
            eos_token_id=None,
            bos_token_id=None,
            **extra,
        )


def checkpoint_shapes(spec: MoESpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face checkpoint with its full shape."""
    h, v, hd, e = spec.hidden_size, spec.vocab_size, spec.head_dim, spec.moe_intermediate_size
    q, kv, s = spec.num_heads * hd, spec.kv_heads * hd, spec.shared_expert_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate.weight": (spec.num_experts, h),
            }
        )
        if spec.arch == QWEN2_MOE:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                    p + "mlp.shared_expert.gate_proj.weight": (s, h),
                    p + "mlp.shared_expert.up_proj.weight": (s, h),
                    p + "mlp.shared_expert.down_proj.weight": (h, s),
                    p + "mlp.shared_expert_gate.weight": (1, h),
                }
            )
        else:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        for x in range(spec.num_experts):
            shapes.update(
                {
                    p + f"mlp.experts.{x}.gate_proj.weight": (e, h),
                    p + f"mlp.experts.{x}.up_proj.weight": (e, h),
                    p + f"mlp.experts.{x}.down_proj.weight": (h, e),
                }
            )
    return shapes


def full_checkpoint(spec: MoESpec, seed: int) -> dict[str, torch.Tensor]:
    """The weights of "version ``seed``": deterministic, distinct per tensor and per seed.

    Unit-variance weights give logits far apart, so greedy tokens do not hinge on rounding; the
    router's weights are scaled up so the top-k choice of experts is far from a tie as well.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for n, s in sorted(checkpoint_shapes(spec).items()):
        t = torch.randn(s, generator=gen)
        out[n] = (t * 4 if n.endswith("mlp.gate.weight") else t).to(spec.dtype)
    return out


def write_model_dir(spec: MoESpec, path: str, weights: dict[str, torch.Tensor]) -> str:
    """A Hugging Face model directory (config.json + model.safetensors) an engine can start from."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    spec.hf_config().save_pretrained(path)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({}, f)
    return path


def transformers_state(spec: MoESpec, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint in the layout of transformers' own model class, which keeps each layer's
    experts stacked (``experts.gate_up_proj`` [E, 2 * I, H], gate rows first; ``experts.down_proj``)."""
    state = {k: v.to(torch.float32) for k, v in weights.items() if ".mlp.experts." not in k}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        experts = range(spec.num_experts)
        state[p + "gate_up_proj"] = torch.stack(
            [
                torch.cat([weights[f"{p}{x}.gate_proj.weight"], weights[f"{p}{x}.up_proj.weight"]])
                for x in experts
            ]
        ).to(torch.float32)
        state[p + "down_proj"] = torch.stack([weights[f"{p}{x}.down_proj.weight"] for x in experts]).to(
            torch.float32
        )
    return state


def reference_tokens(
    spec: MoESpec, weights: dict[str, torch.Tensor], prompts: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], float]:
    """Greedy tokens of transformers' ``Qwen2MoeForCausalLM`` on ``weights`` (float32), and the
    smallest gap between the best and second-best logit seen (how far from a tie they are)."""
    from transformers import AutoModelForCausalLM

    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(
            spec.hf_config(), dtype=torch.float32, attn_implementation="eager"
        )
    missing, unexpected = model.load_state_dict(transformers_state(spec, weights), strict=False)
    if missing or unexpected:
        raise ValueError(f"reference model: missing {missing}, unexpected {unexpected}")
    model.eval()
    out: list[list[int]] = []
    gap = float("inf")
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            new: list[int] = []
            for _ in range(max_new_tokens):
                logits = model(input_ids=ids).logits[0, -1]
                top = torch.topk(logits, 2).values
                gap = min(gap, float(top[0] - top[1]))
                token = int(torch.argmax(logits))
                new.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            out.append(new)
    return out, gap
