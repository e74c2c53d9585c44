"""Synthetic models shaped like real ones, for the benchmarks in this folder.

``bench_gpu.py``, ``bench_cpu.py`` and ``worker.py`` build the same tensor list from a preset name:
Hugging Face checkpoint names and shapes of a Qwen2-style decoder (q/k/v with biases for Qwen2.5,
q_norm/k_norm for Qwen3), bf16 by default. Contents are random; only names, shapes and byte counts
matter for moving weights. A worker holds its TP slice (``TP_RULES``) of every tensor as a
parameter of a plain ``nn.Module`` whose parameter names are the checkpoint names, which is what
``weightwire.adapters.torch.TorchAdapter`` serves.
"""

from __future__ import annotations

import dataclasses

import torch
from weightwire.adapters.torch import TPRule, tp_split_dim
from weightwire.adapters.torch.demo import DEMO_TP_RULES
from weightwire.core.topology import tp_slice_bounds

# The demo model's rules: column-parallel projections split their output dim, row-parallel ones
# their input dim; norms, biases and the rest stay replicated.
TP_RULES: tuple[TPRule, ...] = DEMO_TP_RULES


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Qwen2-style decoder's dimensions."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool  # Qwen2/2.5
    qk_norm: bool  # Qwen3


PRESETS: dict[str, Shape] = {
    # Qwen2.5-0.5B: 494M parameters, 0.92 GiB in bf16, 290 tensors.
    "qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2, 64, 151936, True, True, False),
    # Qwen3-8B: 8.19B parameters, 15.26 GiB in bf16, 399 tensors.
    "qwen3-8b": Shape(4096, 12288, 36, 32, 8, 128, 151936, False, False, True),
    # Qwen3-1.7B's shapes with an untied lm_head: 2.03B parameters, 3.78 GiB in bf16, 311 tensors.
    "qwen3-1.7b": Shape(2048, 6144, 28, 16, 8, 128, 151936, False, False, True),
    # Small ones for CPU runs and tests (dims divisible by 16 so TP up to 16 splits evenly).
    "cpu-s": Shape(512, 1536, 4, 8, 4, 64, 4096, False, True, False),  # 32 MiB, 51 tensors
    "cpu-m": Shape(1024, 2816, 5, 16, 4, 64, 8192, False, True, False),  # 139 MiB, 63 tensors
    "cpu-l": Shape(2048, 5632, 4, 16, 8, 128, 32768, False, True, False),  # 616 MiB, 51 tensors
    "tiny": Shape(64, 128, 2, 4, 2, 16, 256, False, True, True),
    # Qwen3-8B's 399 tensor names with tiny shapes: per-tensor overheads without the bytes.
    "qwen3-8b-names": Shape(64, 128, 36, 4, 2, 16, 256, False, False, True),
}


@dataclasses.dataclass(frozen=True)
class TensorShape:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def tensor_shapes(preset: str, dtype: torch.dtype = torch.bfloat16) -> list[TensorShape]:
    """Checkpoint names and full shapes of ``preset``, in checkpoint order."""
    try:
        s = PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown model preset {preset!r}; known: {', '.join(PRESETS)}") from None
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [TensorShape("model.embed_tokens.weight", (s.vocab, s.hidden), dtype)]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        layer = [
            (p + "input_layernorm.weight", (s.hidden,)),
            (p + "self_attn.q_proj.weight", (q, s.hidden)),
            (p + "self_attn.k_proj.weight", (kv, s.hidden)),
            (p + "self_attn.v_proj.weight", (kv, s.hidden)),
        ]
        if s.qkv_bias:
            layer += [
                (p + "self_attn.q_proj.bias", (q,)),
                (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.bias", (kv,)),
            ]
        if s.qk_norm:
            layer += [
                (p + "self_attn.q_norm.weight", (s.head_dim,)),
                (p + "self_attn.k_norm.weight", (s.head_dim,)),
            ]
        layer += [
            (p + "self_attn.o_proj.weight", (s.hidden, q)),
            (p + "post_attention_layernorm.weight", (s.hidden,)),
            (p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.up_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.down_proj.weight", (s.hidden, s.intermediate)),
        ]
        out += [TensorShape(n, shape, dtype) for n, shape in layer]
    out.append(TensorShape("model.norm.weight", (s.hidden,), dtype))
    if not s.tied_embeddings:
        out.append(TensorShape("lm_head.weight", (s.vocab, s.hidden), dtype))
    return out


def model_bytes(preset: str) -> int:
    return sum(t.nbytes for t in tensor_shapes(preset))


def shard_shape(t: TensorShape, tp_rank: int, tp_size: int) -> tuple[int, ...]:
    """The shape of ``tp_rank``'s slice of ``t`` (full shape when replicated)."""
    dim = tp_split_dim(t.name, TP_RULES)
    if dim is None or tp_size == 1:
        return t.shape
    start, end = tp_slice_bounds(t.shape[dim], tp_rank, tp_size)
    shape = list(t.shape)
    shape[dim] = end - start
    return tuple(shape)


def build_module(
    shapes: list[TensorShape], device: torch.device, *, tp_rank: int = 0, tp_size: int = 1
) -> torch.nn.Module:
    """An ``nn.Module`` whose parameters are the checkpoint names (zero-filled TP slices)."""
    root = torch.nn.Module()
    for t in shapes:
        *path, leaf = t.name.split(".")
        mod = root
        for part in path:
            child = getattr(mod, part, None)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        data = torch.zeros(shard_shape(t, tp_rank, tp_size), dtype=t.dtype, device=device)
        mod.register_parameter(leaf, torch.nn.Parameter(data, requires_grad=False))
    return root


def random_tensors(shapes: list[TensorShape], device: torch.device, seed: int) -> list[torch.Tensor]:
    """One separate allocation per tensor (as a trainer's gathered parameters are), random contents."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out = []
    for t in shapes:
        x = torch.empty(t.shape, dtype=t.dtype, device=device)
        x.normal_(generator=gen)
        out.append(x)
    return out


def refill(tensors: list[torch.Tensor], seed: int) -> None:
    """New random contents in place (so every benchmark case moves bytes the worker did not have)."""
    if not tensors:
        return
    gen = torch.Generator(device=tensors[0].device)
    gen.manual_seed(seed)
    for x in tensors:
        x.normal_(generator=gen)


def digest(tensors: list[torch.Tensor]) -> list[int]:
    """Exact per-tensor fingerprints: the int64 sum of the raw 16-bit words (no float rounding, so
    the same bytes give the same numbers in every process and on every device)."""
    out = []
    for x in tensors:
        raw = (
            x.detach().contiguous().view(torch.int16)
            if x.element_size() == 2
            else x.detach().contiguous().view(torch.uint8)
        )
        out.append(int(raw.sum(dtype=torch.int64).item()))
    return out
