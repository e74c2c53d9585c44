"""SGLang adapter end to end on CPU: SGLang's real Qwen2/Llama classes under SGLang's real parallel
state (gloo), one process per rank, each serving its worker through the plugin's ``start_worker``;
the test process is the trainer: it discovers the workers, checks every manifest against the model
config, pushes through real gRPC and host shared memory with ``WeightPusher``, and checks every
rank's real parameters against the slices of the pushed weights that rank must hold.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cpu_engine import (
    CpuEngine,
    ModelSpec,
    checkpoint_shapes,
    expected_names,
    expected_params,
    full_checkpoint,
)
from weightwire.adapters.sglang import discover
from weightwire.client import PlanError, PushError, WeightPusher
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef
from weightwire.core.topology import pp_layer_span
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="sglang is not installed in this environment: `make install-sglang` adds its CPU test stack",
    ),
]


@contextlib.contextmanager
def engine_and_pusher(tmp_path: Path, spec: ModelSpec, *, tp: int, pp: int) -> Iterator[tuple[CpuEngine, WeightPusher]]:
    engine = CpuEngine(spec, tp=tp, pp=pp, socket_dir=str(tmp_path / "sock"), dump_dir=str(tmp_path / "dump"))
    try:
        endpoints = discover(engine.socket_dir, count=tp * pp)
        assert sorted(endpoints) == sorted(r.address for r in engine.ranks)
        with WeightPusher(endpoints, transport="host_shm", timeout_s=120) as pusher:
            yield engine, pusher
    finally:
        engine.stop()


def check_manifests(engine: CpuEngine, pusher: WeightPusher) -> None:
    spec, shapes = engine.spec, checkpoint_shapes(engine.spec)
    by_id = {m.worker_id: m for m in pusher.manifests().values()}
    assert set(by_id) == {r.worker_id for r in engine.ranks}
    owned_anywhere: set[str] = set()
    for r in engine.ranks:
        m = by_id[r.worker_id]
        assert (m.rank.tp_rank, m.rank.tp_size, m.rank.pp_rank, m.rank.pp_size) == (r.tp_rank, engine.tp, r.pp_rank, engine.pp)
        assert m.engine == "sglang"
        assert m.device == DeviceRef.host()
        span = pp_layer_span(spec.num_layers, r.pp_rank, engine.pp)
        assert (m.layer_start, m.layer_end, m.num_layers) == (span.start, span.end, spec.num_layers)
        assert set(m.tensors) == expected_names(spec, engine.tp, r.pp_rank, engine.pp), r.worker_id
        for name, t in m.tensors.items():
            assert t.shape == shapes[name], name
            assert dtypes.to_torch(t.dtype) == spec.dtype, name
        owned_anywhere |= set(m.tensors)
    assert owned_anywhere == set(shapes)


def push_and_check(engine: CpuEngine, pusher: WeightPusher, version: int) -> None:
    full = full_checkpoint(engine.spec, seed=version)
    results = pusher.push(full, version=version)
    assert {res.version for res in results.values()} == {version}
    assert {res.state for res in results.values()} == {"CONSISTENT"}
    for r in engine.ranks:
        held = engine.dump(r, version)
        expected = expected_params(engine.spec, full, r.tp_rank, engine.tp, r.pp_rank, engine.pp)
        assert set(held) == set(expected), r.worker_id
        for name, want in expected.items():
            assert torch.equal(held[name], want), f"{r.worker_id}: {name} differs from its slice of version {version}"


def versions(pusher: WeightPusher) -> dict[str, tuple[int, int]]:
    return {st.worker_id: (st.weights_version, st.state) for st in pusher.status().values()}


def test_tp2_qwen2_push_pause_gate_and_unconsumed_tensor(tmp_path: Path) -> None:
    spec = ModelSpec("qwen2", dtype=torch.bfloat16)
    with engine_and_pusher(tmp_path, spec, tp=2, pp=1) as (engine, pusher):
        check_manifests(engine, pusher)
        push_and_check(engine, pusher, 1)

        # Requests running and no pause: every worker refuses before writing anything.
        engine.command("busy")
        with pytest.raises(PushError) as refused:
            pusher.push(full_checkpoint(spec, seed=2), version=2)
        # The first refusal cancels the update on the other worker (client rule); none commits.
        reasons = sorted(err.reason for err in refused.value.failures.values())
        assert set(refused.value.failures) == set(pusher.endpoints)
        assert "ENGINE_NOT_PAUSED" in reasons and set(reasons) <= {"ENGINE_NOT_PAUSED", "CANCELLED"}
        assert all(
            "pause_generation" in e.message for e in refused.value.failures.values() if e.reason == "ENGINE_NOT_PAUSED"
        )
        assert versions(pusher) == {"tp0-pp0": (1, pb.WORKER_STATE_CONSISTENT), "tp1-pp0": (1, pb.WORKER_STATE_CONSISTENT)}
        assert not any(engine.dump_exists(r, 2) for r in engine.ranks)

        # Paused with requests still in the batch (in-place pause): writing is allowed.
        engine.command("pause")
        push_and_check(engine, pusher, 2)
        engine.command("idle")

        # load_weights drops a tensor without a word on tp1: that worker fails the update by name.
        skipped = "model.layers.1.mlp.up_proj.weight"
        tp1 = engine.rank_of(1, 0)
        engine.command(f"skip {skipped}", [tp1])
        with pytest.raises(PushError) as dropped:
            pusher.push(full_checkpoint(spec, seed=3), version=3)
        failure = dropped.value.failures[tp1.address]
        assert failure.reason == "LOAD_FAILED"
        assert skipped in failure.message and "did not consume" in failure.message
        assert not dropped.value.results
        assert versions(pusher)["tp1-pp0"] == (2, pb.WORKER_STATE_INCONSISTENT)

        engine.command("unskip", [tp1])
        push_and_check(engine, pusher, 4)


def test_pp2_qwen2_tied_embeddings(tmp_path: Path) -> None:
    spec = ModelSpec("qwen2", tie=True)
    with engine_and_pusher(tmp_path, spec, tp=1, pp=2) as (engine, pusher):
        check_manifests(engine, pusher)
        last = next(m for m in pusher.manifests().values() if m.rank.pp_rank == 1)
        assert "model.embed_tokens.weight" in last.tensors and "lm_head.weight" not in last.tensors
        with pytest.raises(PlanError) as unowned:
            pusher.push({**full_checkpoint(spec, seed=1), "lm_head.weight": torch.zeros(256, 64)}, version=1)
        assert "lm_head.weight" in str(unowned.value)
        push_and_check(engine, pusher, 1)


def test_tp2_pp2_qwen2(tmp_path: Path) -> None:
    spec = ModelSpec("qwen2")
    with engine_and_pusher(tmp_path, spec, tp=2, pp=2) as (engine, pusher):
        check_manifests(engine, pusher)
        push_and_check(engine, pusher, 1)

        # SGLang's pipeline-parallel loop ignores an in-place pause: requests left in the batch
        # would keep running, so with PP > 1 only an empty engine (pause mode "abort") is written.
        engine.command("busy")
        engine.command("pause")
        with pytest.raises(PushError) as refused:
            pusher.push(full_checkpoint(spec, seed=2), version=2)
        assert any('"mode": "abort"' in e.message for e in refused.value.failures.values())
        assert {v for v, _ in versions(pusher).values()} == {1}

        engine.command("idle")
        push_and_check(engine, pusher, 2)


def test_tp2_llama_replicated_kv_head_tied(tmp_path: Path) -> None:
    # One KV head over two TP ranks: SGLang replicates it, so both ranks hold all of k/v_proj.
    spec = ModelSpec("llama", tie=True, kv_heads=1)
    with engine_and_pusher(tmp_path, spec, tp=2, pp=1) as (engine, pusher):
        check_manifests(engine, pusher)
        push_and_check(engine, pusher, 1)
