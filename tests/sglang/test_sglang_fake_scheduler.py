"""What a real SGLang engine cannot be made to show (everything else is in
test_sglang_real_engine.py): SGLang's ``load_weights`` silently dropping a tensor it was handed,
and which updates copy straight into the parameters instead of calling it.

SGLang's Qwen2/Llama loaders skip a name they do not know with at most a log line; the adapter
therefore checks that the weight loaders of every target parameter were really called, and fails
the bucket (LOAD_FAILED, naming the tensor, worker INCONSISTENT) otherwise. A real engine's loader
never drops a name the manifest lists, so this check runs against SGLang's real Qwen2 class under
its real parallel state in a rank process whose scheduler is a ``FakeScheduler`` (rank_worker.py)
with ``load_weights`` made to drop one tensor.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoints import ModelSpec, full_checkpoint
from cpu_engine import CpuEngine, expected_params
from weightwire.adapters.sglang import discover
from weightwire.client import PushError, WeightPusher
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="sglang is not installed in this environment: `make install-sglang` adds its CPU test stack",
    ),
]


@contextlib.contextmanager
def engine_and_pusher(tmp_path: Path, spec: ModelSpec) -> Iterator[tuple[CpuEngine, WeightPusher]]:
    engine = CpuEngine(spec, tp=1, pp=1, socket_dir=str(tmp_path / "sock"), dump_dir=str(tmp_path / "dump"))
    try:
        with WeightPusher(
            discover(engine.socket_dir, count=1), transport="host_shm", timeout_s=120
        ) as pusher:
            yield engine, pusher
    finally:
        engine.stop()


def push_and_check(engine: CpuEngine, pusher: WeightPusher, version: int) -> None:
    full = full_checkpoint(engine.spec, seed=version)
    results = pusher.push(full, version=version)
    assert {res.state for res in results.values()} == {"CONSISTENT"}
    (rank,) = engine.ranks
    held = engine.dump(rank, version)
    expected = expected_params(engine.spec, full, 0, 1, 0, 1)
    assert set(held) == set(expected)
    for name, want in expected.items():
        assert torch.equal(held[name], want), f"{name} differs from version {version}"


def test_tensor_dropped_by_load_weights_fails_the_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every update through load_weights, so the drop made after the first update is seen.
    monkeypatch.setenv("WEIGHTWIRE_SGLANG_DIRECT_COPY", "0")
    spec = ModelSpec("qwen2")
    with engine_and_pusher(tmp_path, spec) as (engine, pusher):
        push_and_check(engine, pusher, 1)

        skipped = "model.layers.1.mlp.up_proj.weight"
        (rank,) = engine.ranks
        engine.command(f"skip {skipped}")
        with pytest.raises(PushError) as dropped:
            pusher.push(full_checkpoint(spec, seed=2), version=2)
        failure = dropped.value.failures[rank.address]
        assert failure.reason == "LOAD_FAILED"
        assert skipped in failure.message and "did not consume" in failure.message
        assert not dropped.value.results
        (status,) = pusher.status().values()
        assert (status.weights_version, status.state) == (1, pb.WORKER_STATE_INCONSISTENT)

        # The next good FULL update makes the worker consistent again.
        engine.command("unskip")
        push_and_check(engine, pusher, 3)


def test_later_updates_copy_directly_and_a_first_drop_is_still_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load of a set of names goes through load_weights (so a tensor it drops fails that
    update), later ones copy the checked regions directly and give the same parameters."""
    phase_log = tmp_path / "phases.jsonl"
    monkeypatch.setenv("WEIGHTWIRE_SGLANG_PHASE_LOG", str(phase_log))
    spec = ModelSpec("qwen2", kv_heads=1)
    with engine_and_pusher(tmp_path, spec) as (engine, pusher):
        skipped = "model.layers.0.self_attn.k_proj.weight"
        (rank,) = engine.ranks
        engine.command(f"skip {skipped}")
        with pytest.raises(PushError) as dropped:
            pusher.push(full_checkpoint(spec, seed=1), version=1)
        assert dropped.value.failures[rank.address].reason == "LOAD_FAILED"
        engine.command("unskip")
        for version in (2, 3, 4):
            push_and_check(engine, pusher, version)
        phases = [json.loads(line) for line in phase_log.read_text().splitlines()]
        assert [(p["version"], p["success"]) for p in phases] == [(1, False), (2, True), (3, True), (4, True)]
        # Update 2 is the first that loaded (and checked) every bucket; 3 and 4 copy directly.
        assert phases[1]["direct_loads"] == 0 and phases[1]["loads"] > 0
        assert all(p["direct_loads"] == p["loads"] > 0 for p in phases[2:])
