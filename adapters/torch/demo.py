"""The built-in demo model: a small Llama/Qwen-shaped weight holder with Hugging Face names.

``weightwire serve --model demo``, the demo, the tests and the benchmarks use it as a real model
whose shard (TP slice, PP stage) can be checked bit-for-bit: ``full_checkpoint(config, seed=v)`` is
"the weights of version v", ``expected_shard`` is what a rank must hold after loading them.
"""

from __future__ import annotations

import dataclasses

import torch
from weightwire.adapters.torch import TPRule, shard_tensor
from weightwire.core.manifest import ParallelRank
from weightwire.core.topology import pp_layer_span, stage_owns

__all__ = [
    "DEMO_TP_RULES",
    "DemoConfig",
    "DemoModel",
    "build_demo_model",
    "expected_shard",
    "full_checkpoint",
]

# Column-parallel projections and the vocab-parallel embedding/lm_head split the output dim (0);
# row-parallel o_proj/down_proj split the input dim (1). Norms are replicated.
DEMO_TP_RULES: tuple[TPRule, ...] = (
    TPRule(r"\.self_attn\.(q|k|v)_proj\.weight$", 0),
    TPRule(r"\.self_attn\.o_proj\.weight$", 1),
    TPRule(r"\.mlp\.(gate|up)_proj\.weight$", 0),
    TPRule(r"\.mlp\.down_proj\.weight$", 1),
    TPRule(r"^model\.embed_tokens\.weight$", 0),
    TPRule(r"^lm_head\.weight$", 0),
)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """The demo model's sizes (Llama/Qwen-shaped, with Hugging Face names) and its weights' dtype."""

    num_layers: int = 4
    """Decoder layers; a pipeline stage holds a contiguous range of them (``pp_layer_span``)."""
    hidden_size: int = 64
    intermediate_size: int = 128
    vocab_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    dtype: torch.dtype = torch.float32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def checkpoint_shapes(config: DemoConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint name of the full model with its full shape, in a fixed order."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def full_checkpoint(config: DemoConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic full checkpoint (CPU tensors) for ``seed``: the same seed gives the same bits."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in checkpoint_shapes(config).items():
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            t = t + 1.0
        out[name] = t.to(config.dtype)
    return out


def _owns(name: str, rank: ParallelRank, config: DemoConfig) -> bool:
    span = pp_layer_span(config.num_layers, rank.pp_rank, rank.pp_size)
    return stage_owns(name, span, rank.pp_rank, rank.pp_size)


def expected_shard(
    full: dict[str, torch.Tensor], rank: ParallelRank, config: DemoConfig
) -> dict[str, torch.Tensor]:
    """What ``rank``'s demo module must hold after loading ``full``: its stage's tensors, TP-sliced."""
    return {
        name: shard_tensor(name, t, rank, DEMO_TP_RULES).contiguous()
        for name, t in full.items()
        if _owns(name, rank, config)
    }


class _Weight(torch.nn.Module):
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DemoModel(torch.nn.Module):
    """Holds exactly one rank's shard under checkpoint names (``model.layers.N...`` keep global N)."""

    def __init__(self, config: DemoConfig, rank: ParallelRank, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.rank = rank
        probe = {n: torch.empty(s, device="meta") for n, s in checkpoint_shapes(config).items()}
        shard_shapes = {n: tuple(t.shape) for n, t in expected_shard(probe, rank, config).items()}
        # Build nested modules so named_parameters() yields the checkpoint names themselves.
        for name, shape in shard_shapes.items():
            path = name.split(".")[:-1]  # drop the trailing "weight"
            parent: torch.nn.Module = self
            for part in path[:-1]:
                child = parent._modules.get(part)
                if child is None:
                    child = torch.nn.Module()
                    parent.add_module(part, child)
                parent = child
            parent.add_module(path[-1], _Weight(shape, config.dtype, device))


def build_demo_model(
    config: DemoConfig, rank: ParallelRank, device: torch.device | str, seed: int
) -> DemoModel:
    """A demo module for ``rank`` holding the shard of ``full_checkpoint(config, seed)``."""
    model = DemoModel(config, rank, torch.device(device))
    shard = expected_shard(full_checkpoint(config, seed), rank, config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in shard.items():
            params[name].copy_(t)
    return model
