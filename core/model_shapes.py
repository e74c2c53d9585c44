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

A config is data from a file: every size must be a whole number from 1 to ``MAX_DIM`` (a string,
a float, zero or a negative number is refused naming the key), and a model of more than
``MAX_MODEL_TENSORS`` tensors (layers x tensors per layer, experts counted) is refused before one
is built, so a config claiming 10^9 layers or 10^6 experts costs nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

MAX_DIM = 1 << 24
"""Largest size of one dimension (hidden size, vocabulary, heads, layers, experts, ...): 16,777,216."""
MAX_MODEL_TENSORS = 500_000
"""Most checkpoint tensors a planned model may have (Kimi-K2 has ~70,000)."""


class ModelConfigError(ValueError):
    """A config this module cannot describe (the message names the key and why)."""


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


def _size(config: Mapping[str, Any], key: str, default: int | None = None, *, minimum: int = 1) -> int:
    """``config[key]`` as a size: a whole number from ``minimum`` to ``MAX_DIM`` (missing or null:
    ``default``, and without one the key is required)."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise ModelConfigError(f"model config has no {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelConfigError(f"model config {key!r} must be a whole number, got {_shown(value)}")
    if not minimum <= value <= MAX_DIM:
        raise ModelConfigError(f"model config {key!r} must be {minimum}..{MAX_DIM:,}, got {value}")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _flag(config: Mapping[str, Any], key: str) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise ModelConfigError(f"model config {key!r} must be true or false, got {_shown(value)}")
    return value


def _grouped_heads(config: Mapping[str, Any], hidden: int, heads: int) -> tuple[int, int]:
    """(k/v heads, head dim) of grouped-query attention."""
    kv_heads = _size(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelConfigError(
            f"model config: {heads} attention heads do not group over {kv_heads} k/v heads"
        )
    if hidden < heads and config.get("head_dim") is None:
        raise ModelConfigError(f"model config: hidden_size {hidden} is smaller than {heads} heads")
    return kv_heads, _size(config, "head_dim", hidden // heads)


def _check_tensor_count(layers: int, experts: int, moe_layers: int) -> None:
    # At most 16 tensors per layer besides the experts' three each; counted before any is built.
    estimate = 2 + layers * 16 + moe_layers * 3 * experts
    if estimate > MAX_MODEL_TENSORS:
        raise ModelConfigError(
            f"model config: {layers:,} layers and {experts:,} experts in {moe_layers:,} of them make about "
            f"{estimate:,} tensors, over the {MAX_MODEL_TENSORS:,} a planned model may have"
        )


def model_shapes(config: Mapping[str, Any]) -> ModelShapes:
    """The checkpoint tensors of the model ``config`` describes (see the module docstring)."""
    if "text_config" in config:
        config = config["text_config"]
        if not isinstance(config, Mapping):
            raise ModelConfigError(f"model config 'text_config' must be an object, got {_shown(config)}")
    hidden = _size(config, "hidden_size")
    layers = _size(config, "num_hidden_layers")
    vocab = _size(config, "vocab_size")
    heads = _size(config, "num_attention_heads")
    tied = _flag(config, "tie_word_embeddings")
    out: list[ModelTensor] = [ModelTensor("model.embed_tokens.weight", (vocab, hidden), "vocab")]

    mla = "kv_lora_rank" in config
    q_rank: int | None = None
    if mla:
        family = "deepseek-v3"
        kv_heads = heads
        nope, rope = _size(config, "qk_nope_head_dim"), _size(config, "qk_rope_head_dim")
        v_dim, kv_rank = _size(config, "v_head_dim"), _size(config, "kv_lora_rank")
        q_rank = _size(config, "q_lora_rank", 0, minimum=0) or None
        head_dim = nope + rope
        experts = _size(config, "n_routed_experts", 0, minimum=0)
        dense_layers = _size(config, "first_k_dense_replace", 0, minimum=0)
        moe_every = _size(config, "moe_layer_freq", 1)
        shared = _size(config, "n_shared_experts", 0, minimum=0)
    else:
        kv_heads, head_dim = _grouped_heads(config, hidden, heads)
        experts = _size(config, "num_experts", 0, minimum=0)
        family = "qwen3-moe" if experts else "dense"
        dense_layers = 0
        moe_every = _size(config, "decoder_sparse_step", 1)
        shared = 0
    moe_layers = 0 if not experts else len(range(dense_layers, layers, moe_every))
    _check_tensor_count(layers, experts, moe_layers)
    moe_inter = _size(config, "moe_intermediate_size") if experts else 0
    inter = _size(config, "intermediate_size") if moe_layers < layers else 0

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
                add(a + "q_a_proj.weight", (q_rank, hidden), "replicated")
                add(a + "q_a_layernorm.weight", (q_rank,), "replicated", linear=False)
                add(a + "q_b_proj.weight", (heads * head_dim, q_rank), "column")
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
