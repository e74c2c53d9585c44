"""Checkpoint tensors of a decoder model, from its Hugging Face ``config.json``: names, full shapes
and how an inference engine splits each under tensor and expert parallelism. Pure: no torch.

For planning fleets that are not here (``weightwire plan``): the model need not exist, only its
config. Three families are understood, by the keys their configs carry: Llama/Qwen-style dense
models (``num_key_value_heads``, ``intermediate_size``), Qwen3-MoE (``num_experts``,
``moe_intermediate_size``) and DeepSeek-V3 / Kimi-K2 (multi-head latent attention: ``kv_lora_rank``;
``n_routed_experts``, ``n_shared_experts``, ``first_k_dense_replace``). Multi-token-prediction layers
(``num_nextn_predict_layers``) are not part of the update and are left out.

Each tensor carries a ``split``, the engine's rule for it (the parallel layer SGLang and vLLM build
for it): ``column`` (rows split over TP ranks), ``row`` (columns split), ``q`` / ``kv`` (a QKV layer's
parts; k/v replicated when there are fewer heads than ranks), ``vocab`` (rows of the vocabulary),
``replicated``; routed experts carry their expert index and are split over expert-parallel ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelTensor:
    name: str
    shape: tuple[int, ...]
    split: str
    layer: int | None = None
    expert: int | None = None
    linear: bool = False
    """A linear layer's weight (what an FP8 engine holds in 8 bits); norms, biases, embeddings,
    routers stay in the model's dtype."""


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    tensors: tuple[ModelTensor, ...]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    family: str
    tied: bool
    """``lm_head`` reads the embedding (no ``lm_head.weight`` of its own)."""

    def parameters(self) -> int:
        total = 0
        for t in self.tensors:
            n = 1
            for d in t.shape:
                n *= d
            total += n
        return total


def _get(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = config.get(key, default)
    if value is None:
        raise ValueError(f"model config has no {key!r}")
    return value


def model_shapes(config: Mapping[str, Any]) -> ModelShapes:
    """The checkpoint tensors of the model ``config`` describes (see the module docstring)."""
    if "text_config" in config:
        config = config["text_config"]
    hidden = int(_get(config, "hidden_size"))
    layers = int(_get(config, "num_hidden_layers"))
    vocab = int(_get(config, "vocab_size"))
    heads = int(_get(config, "num_attention_heads"))
    tied = bool(config.get("tie_word_embeddings", False))
    out: list[ModelTensor] = [ModelTensor("model.embed_tokens.weight", (vocab, hidden), "vocab")]

    mla = "kv_lora_rank" in config
    if mla:
        family = "deepseek-v3"
        kv_heads = heads
        nope, rope = int(_get(config, "qk_nope_head_dim")), int(_get(config, "qk_rope_head_dim"))
        v_dim, kv_rank = int(_get(config, "v_head_dim")), int(_get(config, "kv_lora_rank"))
        q_rank = config.get("q_lora_rank")
        head_dim = nope + rope
        experts = int(config.get("n_routed_experts") or 0)
        dense_layers = int(config.get("first_k_dense_replace", 0))
        moe_every = int(config.get("moe_layer_freq", 1))
        shared = int(config.get("n_shared_experts") or 0)
    else:
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        experts = int(config.get("num_experts") or 0)
        family = "qwen3-moe" if experts else "dense"
        dense_layers = 0
        moe_every = int(config.get("decoder_sparse_step", 1))
        shared = 0
    moe_inter = int(config.get("moe_intermediate_size") or 0)
    inter = int(config.get("intermediate_size") or 0)

    for n in range(layers):
        p = f"model.layers.{n}."

        def add(
            name: str,
            shape: tuple[int, ...],
            split: str,
            *,
            expert: int | None = None,
            linear: bool = True,
            layer: int = n,
            prefix: str = p,
        ) -> None:
            out.append(ModelTensor(prefix + name, shape, split, layer, expert, linear))

        add("input_layernorm.weight", (hidden,), "replicated", linear=False)
        add("post_attention_layernorm.weight", (hidden,), "replicated", linear=False)
        a = "self_attn."
        if mla:
            if q_rank:
                add(a + "q_a_proj.weight", (int(q_rank), hidden), "replicated")
                add(a + "q_a_layernorm.weight", (int(q_rank),), "replicated", linear=False)
                add(a + "q_b_proj.weight", (heads * head_dim, int(q_rank)), "column")
            else:
                add(a + "q_proj.weight", (heads * head_dim, hidden), "column")
            add(a + "kv_a_proj_with_mqa.weight", (kv_rank + rope, hidden), "replicated")
            add(a + "kv_a_layernorm.weight", (kv_rank,), "replicated", linear=False)
            add(a + "kv_b_proj.weight", (heads * (nope + v_dim), kv_rank), "column")
            add(a + "o_proj.weight", (hidden, heads * v_dim), "row")
        else:
            add(a + "q_proj.weight", (heads * head_dim, hidden), "q")
            add(a + "k_proj.weight", (kv_heads * head_dim, hidden), "kv")
            add(a + "v_proj.weight", (kv_heads * head_dim, hidden), "kv")
            add(a + "o_proj.weight", (hidden, heads * head_dim), "row")
            if config.get("attention_bias") or config.get("qkv_bias"):
                add(a + "q_proj.bias", (heads * head_dim,), "q", linear=False)
                add(a + "k_proj.bias", (kv_heads * head_dim,), "kv", linear=False)
                add(a + "v_proj.bias", (kv_heads * head_dim,), "kv", linear=False)
            if family == "qwen3-moe" or config.get("model_type") == "qwen3":
                add(a + "q_norm.weight", (head_dim,), "replicated", linear=False)
                add(a + "k_norm.weight", (head_dim,), "replicated", linear=False)
        moe = experts > 0 and n >= dense_layers and (n - dense_layers) % moe_every == 0
        m = "mlp."
        if not moe:
            add(m + "gate_proj.weight", (inter, hidden), "column")
            add(m + "up_proj.weight", (inter, hidden), "column")
            add(m + "down_proj.weight", (hidden, inter), "row")
            continue
        add(m + "gate.weight", (experts, hidden), "replicated", linear=False)
        if mla:
            add(m + "gate.e_score_correction_bias", (experts,), "replicated", linear=False)
        for e in range(experts):
            q = f"{m}experts.{e}."
            add(q + "gate_proj.weight", (moe_inter, hidden), "column", expert=e)
            add(q + "up_proj.weight", (moe_inter, hidden), "column", expert=e)
            add(q + "down_proj.weight", (hidden, moe_inter), "row", expert=e)
        if shared:
            s = m + "shared_experts."
            add(s + "gate_proj.weight", (moe_inter * shared, hidden), "column")
            add(s + "up_proj.weight", (moe_inter * shared, hidden), "column")
            add(s + "down_proj.weight", (hidden, moe_inter * shared), "row")
    out.append(ModelTensor("model.norm.weight", (hidden,), "replicated"))
    if not tied:
        out.append(ModelTensor("lm_head.weight", (vocab, hidden), "vocab"))
    return ModelShapes(tuple(out), layers, heads, kv_heads, head_dim, experts, family, tied)
