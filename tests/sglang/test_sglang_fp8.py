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

Every trainer rank a source: three trainer ranks of one gloo world (``helpers.slice_trainer_main``,
this file run as a script; each rank a ``Shard(0)`` third of every tensor) push into the same two
ranks over a transfer group. Thirds of 256 rows (86/86/84) cut through the 128 x 128 blocks and the
scales' rows (1/1/0); each worker stages its whole-block half of every weight and scale and loads
them through SGLang's ``load_weights`` at the commit. Checked: ``bytes_received`` is the manifest's
kept bytes, and every parameter of both ranks equals, byte for byte, what SGLang's loader makes of
the same checkpoint pushed from one source; a push from every rank missing one scale
(INCOMPLETE_UPDATE) and one of bf16 into the FP8 layers (DTYPE_MISMATCH) are refused with every
rank as it was.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator

import pytest
import torch
from checkpoints import QWEN2, ModelSpec, full_checkpoint
from cpu_engine import CpuEngine
from helpers import TrainerRanks, slice_trainer_main
from rank_fleet import assert_same_bytes
from weightwire.adapters.sglang import discover
from weightwire.client import PlanError, WeightPusher
from weightwire.core.fp8_quant import dequantize_block, quantize_block, quantize_for
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
    engine, pusher = running
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
        # Slices from every trainer rank: staged, then loaded through load_weights (never copied
        # in place: the FP8 layers' post-load processing may requantise or rebind them).
        assert m.receives_slices
        assert m.kept_bytes < m.total_bytes
    for rank in engine.ranks:
        # Deltas need regions to apply in: an FP8 rank takes its updates whole, and says so.
        said = "".join(rank.stderr)
        assert "does not apply deltas" in said and "block-FP8 layer" in said, said[-2000:]


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


MISSING = "model.layers.1.mlp.down_proj.weight_scale_inv"
# Seeds the trainer ranks map to hostile checkpoints (slice_trainer_main pushes checkpoint(seed)).
WITHOUT_SCALE, BF16 = 1000, 2000


def trainer_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """What ``fp8_checkpoint`` makes, without the manifests (a trainer rank has none at hand);
    the hostile seeds: one scale left out, or bf16 as it is."""
    if seed >= BF16:
        return full_checkpoint(SPEC, seed - BF16)
    out = {}
    for name, t in full_checkpoint(SPEC, seed % WITHOUT_SCALE).items():
        if name.endswith(".weight") and any(f".{m}." in name for m in LINEARS):
            out[name], out[name + "_scale_inv"] = quantize_block(t)
        else:
            out[name] = t
    return {n: t for n, t in out.items() if n != MISSING} if seed >= WITHOUT_SCALE else out


@pytest.fixture(scope="module")
def trainers(running: tuple[CpuEngine, WeightPusher]) -> Iterator[TrainerRanks]:
    _, pusher = running
    ranks = TrainerRanks(__file__, list(pusher.manifests()), world=3)
    try:
        yield ranks
    finally:
        ranks.close()


def test_slices_from_three_ranks_land_where_sglangs_loader_puts_them(
    running: tuple[CpuEngine, WeightPusher], trainers: TrainerRanks
) -> None:
    engine, pusher = running
    manifests = pusher.manifests()
    version = max(s.weights_version for s in pusher.status().values())
    assert trainer_checkpoint(5).keys() == fp8_checkpoint(pusher, 5).keys()
    # The regions of the unquantized tensors (embedding, norms) are proven by a load from one source.
    answers = trainers.push(version=version + 1, seed=5, single=True)
    assert answers[0]["ok"], answers

    answers = trainers.push(version=version + 2, seed=6)
    assert all(a["ok"] for a in answers), answers
    results = answers[0]["results"]
    assert set(results) == set(manifests)
    for address, r in results.items():
        m = manifests[address]
        assert (r["version"], r["state"], r["transport"]) == (version + 2, "CONSISTENT", "transfer_group"), r
        assert r["bytes_received"] == m.kept_bytes < m.total_bytes, (address, r)
    full = trainer_checkpoint(6)
    check_held(engine, full, version + 2)

    # The same checkpoint from one source, through SGLang's load_weights: the same bytes everywhere.
    answers = trainers.push(version=version + 3, seed=6, single=True)
    assert answers[0]["ok"], answers
    for r in engine.ranks:
        # Flat: the attention's KV-cache scales are 0-d (left as they were, NaN, by both pushes).
        pushed, want = (
            {n: t.reshape(-1) for n, t in engine.dump(r, v).items()} for v in (version + 2, version + 3)
        )
        assert_same_bytes(pushed, want, f"slices push, {r.worker_id}")


def test_slices_missing_a_scale_or_bf16_into_fp8_are_refused(
    running: tuple[CpuEngine, WeightPusher], trainers: TrainerRanks
) -> None:
    engine, pusher = running
    version = max(s.weights_version for s in pusher.status().values())
    for seed, reason, named in (
        (WITHOUT_SCALE + 7, "INCOMPLETE_UPDATE", MISSING),
        (BF16 + 7, "DTYPE_MISMATCH", "float8_e4m3fn"),
    ):
        answers = trainers.push(version=version + 1, seed=seed)
        assert not any(a["ok"] for a in answers), answers
        assert {a["reason"] for a in answers} == {reason}, answers
        assert named in answers[0]["message"], answers[0]["message"]
    assert {(s.weights_version, s.state) for s in pusher.status().values()} == {
        (version, pb.WORKER_STATE_CONSISTENT)
    }
    assert not any(engine.dump_exists(r, version + 1) for r in engine.ranks)


def local_fp8_shards() -> None:
    """Every trainer rank builds the same full checkpoint, so each takes its own ``Shard(0)`` part
    without a scatter (``src_data_rank=None``): gloo has no float8 collectives, and an FSDP trainer
    holds its FP8 shards already."""
    import torch.distributed.tensor as dt

    scatter = dt.distribute_tensor
    dt.distribute_tensor = lambda t, mesh, placements: scatter(t, mesh, placements, src_data_rank=None)  # type: ignore[assignment]


if __name__ == "__main__":
    local_fp8_shards()
    sys.exit(slice_trainer_main(sys.argv[1:], trainer_checkpoint))
