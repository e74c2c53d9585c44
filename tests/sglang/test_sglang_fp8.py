"""Block-quantised FP8 (DeepSeek-V3 / Kimi-K2 layout) into SGLang's real loaders, TP2 on CPU.

SGLang cannot run an FP8 forward pass on a CPU without AMX (its ``Fp8LinearMethod`` asserts it in
the post-load processing), so this module checks everything short of the kernels, against SGLang's
real Qwen2 class with ``Fp8Config(weight_block_size=[128, 128])`` under its real parallel state
(two rank processes over gloo, each serving its worker through the plugin's ``start_worker``;
rank_worker.py): every linear layer's ``weight`` (float8_e4m3fn) and ``weight_scale_inv``
(float32, one per 128 x 128 block) are owned tensors of their own with each rank's whole-block
slice; after a push each rank's parameters hold exactly its slice of the pushed FP8 bytes and
scales (as the loaders put them: q, k, v one after another); a bf16 trainer's weights go through
``quantize_for``; refusals (bf16 into an FP8 weight, a FULL update without one scale) leave every
rank as it was. The tokens after a push are checked on a GPU (docs/validation.md).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch
from checkpoints import QWEN2, ModelSpec, full_checkpoint
from cpu_engine import CpuEngine
from weightwire.adapters.sglang import discover
from weightwire.client import PlanError, WeightPusher
from weightwire.core.fp8_quant import dequantize_block, quantize_for
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="sglang is not installed in this environment: `make install-sglang` adds its CPU test stack",
    ),
]

# head_dim 128 and TP2 slices of 128 rows: every slice keeps whole 128 x 128 blocks.
SPEC = ModelSpec(
    QWEN2,
    kv_heads=2,
    hidden_size=256,
    intermediate_size=512,
    num_heads=2,
    num_layers=2,
    dtype=torch.bfloat16,
    fp8_block=128,
)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CpuEngine, WeightPusher]]:
    root = tmp_path_factory.mktemp("fp8")
    engine = CpuEngine(SPEC, tp=2, pp=1, socket_dir=str(root / "sock"), dump_dir=str(root / "dump"))
    try:
        with WeightPusher(
            discover(engine.socket_dir, count=2), transport="host_shm", timeout_s=120
        ) as pusher:
            yield engine, pusher
    finally:
        engine.stop()


def fp8_checkpoint(pusher: WeightPusher, seed: int) -> dict[str, torch.Tensor]:
    return dict(quantize_for(full_checkpoint(SPEC, seed).items(), pusher.manifests().values()))


def _half(t: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    n = t.shape[dim] // 2
    return t.narrow(dim, rank * n, n)


def expected_fp8(full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank``'s quantized parameters hold: its halves of every weight and scale (rows
    of q/k/v and gate/up, one after another; columns of o and down), computed from the sizes alone."""
    out = {}
    for layer in range(SPEC.num_layers):
        p = f"model.layers.{layer}."
        for leaf in ("weight", "weight_scale_inv"):
            qkv = [full[f"{p}self_attn.{m}_proj.{leaf}"] for m in "qkv"]
            out[f"{p}self_attn.qkv_proj.{leaf}"] = torch.cat([_half(t, 0, rank) for t in qkv])
            gate_up = [full[f"{p}mlp.{m}_proj.{leaf}"] for m in ("gate", "up")]
            out[f"{p}mlp.gate_up_proj.{leaf}"] = torch.cat([_half(t, 0, rank) for t in gate_up])
            out[f"{p}self_attn.o_proj.{leaf}"] = _half(full[f"{p}self_attn.o_proj.{leaf}"], 1, rank)
            out[f"{p}mlp.down_proj.{leaf}"] = _half(full[f"{p}mlp.down_proj.{leaf}"], 1, rank)
    return out


def check_held(engine: CpuEngine, full: dict[str, torch.Tensor], version: int) -> None:
    for r in engine.ranks:
        held = engine.dump(r, version)
        for name, want in expected_fp8(full, r.tp_rank).items():
            assert held[name].dtype == want.dtype, name
            # Bytes, not values: FP8 NaN patterns and -0 compare as what was pushed.
            assert torch.equal(held[name].view(torch.uint8), want.view(torch.uint8)), (
                f"{name} on {r.worker_id}"
            )


def test_manifests_list_weights_and_scales_with_whole_blocks(running: tuple[CpuEngine, WeightPusher]) -> None:
    _, pusher = running
    manifests = pusher.manifests()
    assert len(manifests) == 2
    for m in manifests.values():
        tp = m.rank.tp_rank
        for layer in range(SPEC.num_layers):
            for mod in LINEARS:
                w = m.tensors[f"model.layers.{layer}.{mod}.weight"]
                s = m.tensors[f"model.layers.{layer}.{mod}.weight_scale_inv"]
                assert (w.dtype, s.dtype) == (pb.DTYPE_FLOAT8_E4M3FN, pb.DTYPE_FLOAT32)
                assert s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
                (wp,) = w.pieces
                (sp,) = s.pieces
                # The weight's half and the scale's half are the same blocks.
                assert wp.offset % 128 == 0 and wp.length % 128 == 0, (mod, wp)
                assert (sp.dim, sp.offset, sp.length) == (wp.dim, wp.offset // 128, wp.length // 128)
                assert wp.offset == tp * wp.length
        # KV-cache scales are not checkpoint weights a trainer sends.
        assert not [n for n in m.tensors if n.endswith(("k_scale", "v_scale"))]
        # No slices from every trainer rank into SGLang's FP8 layers (their post-load processing may
        # requantise or rebind them, so nothing may be written in place): a multi-rank push is
        # refused before any data moves (TRANSPORT_UNAVAILABLE), a single-source push loads them.
        assert not m.receives_slices


def test_pushes_land_as_fp8_bytes_and_scales(running: tuple[CpuEngine, WeightPusher]) -> None:
    engine, pusher = running
    full = fp8_checkpoint(pusher, seed=1)
    bf16 = full_checkpoint(SPEC, seed=1)
    w = "model.layers.0.mlp.down_proj.weight"
    # quantize_for: what the engine holds stands for the trainer's weights (e4m3 rounding only).
    assert torch.allclose(
        dequantize_block(full[w], full[w + "_scale_inv"]), bf16[w].float(), rtol=0.07, atol=1e-3
    )
    results = pusher.push(full, version=1)
    assert {res.state for res in results.values()} == {"CONSISTENT"}
    check_held(engine, full, 1)

    # A second FULL push of other weights, then a PARTIAL push of one layer's weight and scale.
    full2 = fp8_checkpoint(pusher, seed=2)
    pusher.push(full2, version=2)
    check_held(engine, full2, 2)
    partial = {n: t for n, t in fp8_checkpoint(pusher, seed=3).items() if ".layers.1.mlp.gate_proj." in n}
    assert len(partial) == 2
    pusher.push(partial, version=3, scope="partial")
    check_held(engine, {**full2, **partial}, 3)


def test_refusals_name_the_dtype_and_the_missing_scale(running: tuple[CpuEngine, WeightPusher]) -> None:
    engine, pusher = running
    version = max(s.weights_version for s in pusher.status().values())

    # bf16 weights pushed as they are into FP8 parameters: refused, naming both dtypes.
    bf16 = full_checkpoint(SPEC, seed=4)
    with pytest.raises(PlanError) as raw:
        pusher.push(bf16, version=version + 1)
    assert raw.value.reason == "DTYPE_MISMATCH"
    assert "float8_e4m3fn" in str(raw.value) and "bfloat16" in str(raw.value)

    # A FULL update without one weight's scale: refused before sending, naming it.
    scale = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    incomplete = {n: t for n, t in fp8_checkpoint(pusher, seed=4).items() if n != scale}
    with pytest.raises(PlanError) as missing:
        pusher.push(incomplete, version=version + 1)
    assert missing.value.reason == "INCOMPLETE_UPDATE" and scale in str(missing.value)

    assert {(s.weights_version, s.state) for s in pusher.status().values()} == {
        (version, pb.WORKER_STATE_CONSISTENT)
    }
    assert not any(engine.dump_exists(r, version + 1) for r in engine.ranks)
