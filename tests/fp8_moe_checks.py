"""The block-FP8 mixture-of-experts model both engine adapters are checked with
(tests/sglang/test_sglang_fp8_moe.py, tests/vllm/test_vllm_fp8_moe.py), and what both check of it.

A tiny Qwen3-MoE in the DeepSeek-V3 / Kimi-K2 checkpoint layout: attention and routed experts
block FP8 (``x.weight`` float8_e4m3fn, ``x.weight_scale_inv`` float32 per 128 x 128 block), the
router, norms and embeddings bf16. Head size 128 and 4 experts of 256 intermediate rows, so TP2
halves keep whole blocks. No engine import.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_fleet import RankFleet, assert_same_bytes
from weightwire.client import PlanError, WeightPusher
from weightwire.core.fp8_quant import quantize_block
from weightwire.v1 import weight_transfer_pb2 as pb


def _moe_checkpoints() -> Any:
    """tests/sglang/moe_checkpoints.py (shared with tests/vllm, where tests/sglang is not on sys.path)."""
    if "moe_checkpoints" in sys.modules:
        return sys.modules["moe_checkpoints"]
    spec = importlib.util.spec_from_file_location(
        "moe_checkpoints", Path(__file__).resolve().parent / "sglang" / "moe_checkpoints.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["moe_checkpoints"] = module
    spec.loader.exec_module(module)
    return module


moe = _moe_checkpoints()
SPEC = moe.MoESpec(
    arch=moe.QWEN3_MOE,
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=256,
    num_heads=2,
    kv_heads=2,
    dtype=torch.bfloat16,
)
QUANTIZED = (
    "self_attn.q_proj.",
    "self_attn.k_proj.",
    "self_attn.v_proj.",
    "self_attn.o_proj.",
    "mlp.experts.",
)
EXPERT_LEAVES = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")


def bf16_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    return moe.full_checkpoint(SPEC, seed)


def fp8_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """A random checkpoint with its attention and expert weights block-quantised (router bf16)."""
    out = {}
    for name, t in bf16_checkpoint(seed).items():
        if name.endswith(".weight") and any(f".{m}" in name for m in QUANTIZED):
            out[name], out[name + "_scale_inv"] = quantize_block(t)
        else:
            out[name] = t
    return out


def check_tp2_manifests(pusher: WeightPusher) -> None:
    """Both TP ranks list every checkpoint tensor (scales included, nothing else), each expert's
    FP8 weight and scale with the rank's whole-block half of the intermediate dimension."""
    manifests = pusher.manifests()
    assert len(manifests) == 2
    full = fp8_checkpoint(seed=1)
    for m in manifests.values():
        tp = m.rank.tp_rank
        assert set(m.tensors) == set(full)
        for layer in range(SPEC.num_layers):
            for e in range(SPEC.num_experts):
                for proj, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
                    name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                    w, s = m.tensors[name], m.tensors[name + "_scale_inv"]
                    assert (w.dtype, s.dtype) == (pb.DTYPE_FLOAT8_E4M3FN, pb.DTYPE_FLOAT32)
                    assert tuple(s.shape) == (w.shape[0] // 128, w.shape[1] // 128)
                    (wp,) = w.pieces
                    (sp,) = s.pieces
                    assert (wp.dim, wp.offset, wp.length) == (dim, tp * 128, 128), name
                    assert (sp.dim, sp.offset, sp.length) == (dim, tp, 1), name
            router = m.tensors[f"model.layers.{layer}.mlp.gate.weight"]
            assert router.dtype == pb.DTYPE_BFLOAT16 and not router.pieces


def check_experts_changed(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], experts: str
) -> None:
    """Every fused FP8 expert parameter of module ``experts`` changed (the push reached it)."""
    for leaf in EXPERT_LEAVES:
        name = f"{experts}.{leaf}"
        assert not torch.equal(before[name].view(torch.uint8), after[name].view(torch.uint8)), name


def check_refusals(ranks: RankFleet, pusher: WeightPusher, root: Path) -> None:
    """A FULL update without one expert's scale and bf16 into an FP8 expert: refused before
    anything is sent, naming the tensor (and both dtypes), every rank's parameters unchanged."""
    version = max(s.weights_version for s in pusher.status().values())
    before = ranks.dumps(root, "dump", "before-refusals")
    full = fp8_checkpoint(seed=5)

    scale = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    with pytest.raises(PlanError) as missing:
        pusher.push({n: t for n, t in full.items() if n != scale}, version=version + 1)
    assert missing.value.reason == "INCOMPLETE_UPDATE" and scale in str(missing.value)

    expert = "model.layers.0.mlp.experts.1.gate_proj.weight"
    with pytest.raises(PlanError) as raw:
        pusher.push({**full, expert: bf16_checkpoint(seed=5)[expert]}, version=version + 1)
    assert raw.value.reason == "DTYPE_MISMATCH" and expert in str(raw.value)
    assert "float8_e4m3fn" in str(raw.value) and "bfloat16" in str(raw.value)

    assert {(s.weights_version, s.state) for s in pusher.status().values()} == {
        (version, pb.WORKER_STATE_CONSISTENT)
    }
    after = ranks.dumps(root, "dump", "after-refusals")
    for r in range(len(after)):
        assert_same_bytes(after[r], before[r], f"after refusals, rank {r}")
