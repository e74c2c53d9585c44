"""Block-quantised FP8 experts (DeepSeek-V3 / Kimi-K2 layout) into SGLang's real Qwen3-MoE loaders, TP2 on CPU.

SGLang 0.5.23 cannot run FP8 kernels (dense or MoE) on a CPU without AMX, so, as
test_sglang_fp8.py does for dense layers, this module checks everything short of the kernels: two
rank processes (fp8_moe_rank.py) build SGLang's real Qwen3-MoE with ``Fp8Config(weight_block_size
=[128, 128])`` under its real parallel state over gloo (experts through ``Fp8MoEMethod``), load
checkpoint A through the model's own ``load_weights``, and serve through the plugin's
``start_worker``. Checked: every expert's ``gate/up/down_proj.weight`` (float8_e4m3fn) and
``.weight_scale_inv`` (float32 per 128 x 128 block) are owned tensors of their own with each rank's
whole-block half of the intermediate dimension; after a FULL push of checkpoint B (and of a bf16
one through ``quantize_for``) every parameter of both ranks equals, byte for byte, a fresh model
loaded from it by SGLang's ``load_weights``; a FULL update without one expert's scale and bf16 into
an FP8 expert are refused with every rank unchanged; blocks a rank's slice would split are refused
at engine start, naming the experts layer; a push from three trainer ranks of one gloo world
(``helpers.slice_trainer_main``, this file run as a script; thirds of each expert's 256 rows cut
through its blocks) lands the same bytes, each worker having received exactly its kept bytes.
Expert parallelism: test_sglang_fp8_moe_ep.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
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
)
from helpers import TrainerRanks, slice_trainer_main
from moe_checkpoints import write_model_dir
from ports import free_port
from rank_fleet import RankFleet, assert_same_bytes
from weightwire.adapters.sglang import discover
from weightwire.client import WeightPusher
from weightwire.core.fp8_quant import quantize_for

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="sglang is not installed in this environment: `make install-sglang` adds its CPU test stack",
    ),
]

HERE = Path(__file__).resolve().parent
EP = 1


def write(state: dict[str, torch.Tensor], directory: Path) -> str:
    return os.path.join(write_model_dir(SPEC, str(directory), state), "model.safetensors")


class Ranks(RankFleet):
    """The two rank processes (fp8_moe_rank.py), serving their workers in ``root/sock``."""

    def __init__(self, ckpt: str, root: Path, ep: int) -> None:
        (root / "sock").mkdir()
        (root / "dump").mkdir()
        self.socket_dir = str(root / "sock")
        args = ["--ep", str(ep), "--init-port", str(free_port()), "--ckpt", ckpt]
        args += ["--socket-dir", self.socket_dir, "--dump-dir", str(root / "dump")]
        super().__init__(
            [[str(HERE / "fp8_moe_rank.py"), "--rank", str(r), *args] for r in range(2)],
            {"PYTHONWARNINGS": "ignore", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
        )


def start(tmp_path_factory: pytest.TempPathFactory, ep: int) -> Iterator[tuple[Ranks, WeightPusher, Path]]:
    root = tmp_path_factory.mktemp(f"fp8-moe-ep{ep}")
    ranks = Ranks(write(fp8_checkpoint(seed=1), root / "ckpt1"), root, ep)
    try:
        with WeightPusher(discover(ranks.socket_dir, count=2), transport="host_shm", timeout_s=120) as pusher:
            yield ranks, pusher, root
    finally:
        ranks.stop()


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Ranks, WeightPusher, Path]]:
    yield from start(tmp_path_factory, EP)


def push_and_compare(
    ranks: Ranks, pusher: WeightPusher, root: Path, full: dict[str, torch.Tensor], version: int
) -> None:
    """Push ``full``; every parameter of each rank must equal a fresh model loaded from it."""
    before = ranks.dumps(root, "dump", f"before-v{version}")
    results = pusher.push(full, version=version)
    assert {r.state for r in results.values()} == {"CONSISTENT"}
    pushed = ranks.dumps(root, "dump", f"v{version}")
    want = ranks.dumps(root, f"reference {write(full, root / f'ckpt-v{version}')}", f"ref-v{version}")
    for r in range(2):
        assert_same_bytes(pushed[r], want[r], f"push v{version}, rank {r}")
        check_experts_changed(before[r], pushed[r], "model.layers.1.mlp.experts")


def test_manifests_list_expert_weights_and_scales_with_whole_blocks(
    running: tuple[Ranks, WeightPusher, Path],
) -> None:
    check_tp2_manifests(running[1])


def test_pushes_land_where_sglangs_loader_puts_the_checkpoint(
    running: tuple[Ranks, WeightPusher, Path],
) -> None:
    ranks, pusher, root = running
    push_and_compare(ranks, pusher, root, fp8_checkpoint(seed=2), version=1)
    # A bf16 trainer: quantize_for quantises the experts (and attention) the engine holds as FP8.
    quantized = dict(quantize_for(bf16_checkpoint(seed=3).items(), pusher.manifests().values()))
    assert quantized.keys() == fp8_checkpoint(seed=3).keys()
    push_and_compare(ranks, pusher, root, quantized, version=2)


def test_refusals_before_anything_loads(running: tuple[Ranks, WeightPusher, Path]) -> None:
    ranks, pusher, root = running
    check_refusals(ranks, pusher, root)
    # Blocks a rank's slice would split (256 x 256 blocks over TP2's 128-row halves of each expert):
    # the manifest builder refuses the model at engine start, naming the layer.
    for answer in ranks.ask("manifest_error 256"):
        assert "mlp.experts.w13_weight" in answer and "split a 256 x 256 FP8 block" in answer, answer
    assert ranks.ask("manifest_error 128") == ["none", "none"]


def test_slices_from_three_ranks_land_where_sglangs_loader_puts_them(
    running: tuple[Ranks, WeightPusher, Path],
) -> None:
    ranks, pusher, root = running
    manifests = pusher.manifests()
    assert all(m.receives_slices for m in manifests.values()), manifests
    trainers = TrainerRanks(__file__, list(manifests), world=3)
    try:
        version = max(s.weights_version for s in pusher.status().values())
        # The regions of the unquantized tensors (router, norms, embeddings) are proven by a load
        # from one source (the earlier tests' pushes do it too).
        assert trainers.push(version=version + 1, seed=5, single=True)[0]["ok"]
        answers = trainers.push(version=version + 2, seed=6)
    finally:
        trainers.close()
    assert all(a["ok"] for a in answers), answers
    for address, r in answers[0]["results"].items():
        m = manifests[address]
        assert (r["version"], r["state"], r["transport"]) == (version + 2, "CONSISTENT", "transfer_group"), r
        assert r["bytes_received"] == m.kept_bytes < m.total_bytes, (address, r)
    pushed = ranks.dumps(root, "dump", "slices")
    want = ranks.dumps(root, f"reference {write(fp8_checkpoint(seed=6), root / 'ckpt-slices')}", "ref-slices")
    for r in range(2):
        assert_same_bytes(pushed[r], want[r], f"slices push, rank {r}")


if __name__ == "__main__":
    from test_sglang_fp8 import local_fp8_shards

    local_fp8_shards()
    sys.exit(slice_trainer_main(sys.argv[1:], fp8_checkpoint))
