"""Mixture-of-experts in a real, running ``sglang.Engine`` on CPU (SGLang 0.5.23, TP=2).

A tiny Qwen3-MoE (4 experts, top-2, router ``mlp.gate``): SGLang stacks each layer's experts in
one ``FusedMoE`` (``w13_weight``, ``w2_weight``), and with TP=2 and no expert parallelism every
rank holds half of the intermediate dimension of every expert. The manifests must say so in
checkpoint names (``mlp.experts.E.{gate,up,down}_proj.weight``, full shapes, the slice each rank
keeps); pushes must then give transformers' tokens on the pushed weights, the second time
through the direct copy; refusals (FP8 bytes into a float32 expert, a FULL update without one
expert, a PARTIAL update of one expert) must change nothing.

One engine serves the module (its tests run in order; the state flows). Qwen2-MoE's shared
expert is covered by tests/vllm (SGLang 0.5.23 applies its gate with a Triton kernel even on CPU).
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch
from helpers import bucket, commit, header, inline_payload, pack, push
from moe_checkpoints import (
    QWEN3_MOE,
    MoESpec,
    checkpoint_shapes,
    full_checkpoint,
    reference_tokens,
    write_model_dir,
)
from real_engine import SGLANG_ENVS, EngineHost, engine_kwargs
from weightwire.adapters.sglang import discover
from weightwire.client import PlanError, WeightPusher
from weightwire.core.manifest import TensorPiece
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

SPEC = MoESpec(arch=QWEN3_MOE)
TP = 2
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
NEW_TOKENS = 8
EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"


@dataclasses.dataclass
class Running:
    host: EngineHost
    pusher: WeightPusher
    weights: dict[str, torch.Tensor]
    version: int = 0

    def check_tokens(self) -> list[list[int]]:
        expected, gap = reference_tokens(SPEC, self.weights, PROMPTS, NEW_TOKENS)
        assert gap > 1e-3, f"reference too close to a tie ({gap}); pick other seeds"
        outputs = self.host.generate(PROMPTS, NEW_TOKENS)
        assert [o["output_ids"] for o in outputs] == expected
        assert {o["weight_version"] for o in outputs} == {str(self.version) if self.version else "default"}
        return expected

    def push(self, weights: dict[str, torch.Tensor], *, scope: str = "full") -> None:
        self.host.pause("abort")
        try:
            results = self.pusher.push(weights, version=self.version + 1, scope=scope)
        finally:
            self.host.resume()
        assert {(r.version, r.state) for r in results.values()} == {(self.version + 1, "CONSISTENT")}
        self.weights, self.version = {**self.weights, **weights}, self.version + 1

    def states(self) -> set[tuple[int, int]]:
        return {(st.weights_version, st.state) for st in self.pusher.status().values()}


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    env = SGLANG_ENVS["0.5.23"]
    if not env.available():
        pytest.skip("no SGLang 0.5.23 environment: `make install-sglang` makes it")
    root = tmp_path_factory.mktemp("sglang-moe")
    weights = full_checkpoint(SPEC, seed=1)
    model = write_model_dir(SPEC, str(root / "model"), weights)
    socket_dir = f"/tmp/ww-sgl-{uuid.uuid4().hex[:10]}"
    host = EngineHost(
        env, engine_kwargs(model, tp=TP), socket_dir=socket_dir, log_path=str(root / "engine.log")
    )
    try:
        endpoints = discover(socket_dir, count=TP, timeout_s=60)
        with WeightPusher(endpoints, transport="host_shm", timeout_s=120) as pusher:
            yield Running(host, pusher, weights)
    finally:
        host.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_manifests_name_every_expert_with_each_ranks_slice(running: Running) -> None:
    manifests = sorted(running.pusher.manifests().values(), key=lambda m: m.rank.tp_rank)
    assert [m.rank.tp_rank for m in manifests] == [0, 1]
    shapes = checkpoint_shapes(SPEC)
    half = SPEC.moe_intermediate_size // TP
    for m in manifests:
        # Exactly the checkpoint's names, at full shapes: no engine-internal w13/w2 name leaks out.
        assert set(m.tensors) == set(shapes)
        assert {n: tuple(t.shape) for n, t in m.tensors.items()} == shapes
        start = m.rank.tp_rank * half
        for layer in range(SPEC.num_layers):
            p = f"model.layers.{layer}.mlp."
            assert m.tensors[p + "gate.weight"].pieces == ()  # the router is replicated
            for e in range(SPEC.num_experts):
                for proj in ("gate_proj", "up_proj"):
                    assert m.tensors[f"{p}experts.{e}.{proj}.weight"].pieces == (TensorPiece(0, start, half),)
                assert m.tensors[f"{p}experts.{e}.down_proj.weight"].pieces == (TensorPiece(1, start, half),)
    running.check_tokens()


def test_full_pushes_give_transformers_tokens(running: Running) -> None:
    before = running.check_tokens()
    running.push(full_checkpoint(SPEC, seed=2))  # through SGLang's load_weights, then checked
    assert running.check_tokens() != before
    running.push(full_checkpoint(SPEC, seed=3))  # the same names again: the direct copy
    running.check_tokens()
    assert running.states() == {(running.version, pb.WORKER_STATE_CONSISTENT)}


def test_partial_push_of_one_layers_experts_and_router(running: Running) -> None:
    new = full_checkpoint(SPEC, seed=4)
    layer0 = {n: t for n, t in new.items() if n.startswith("model.layers.0.mlp.")}
    assert len(layer0) == 1 + 3 * SPEC.num_experts
    before = running.check_tokens()
    running.push(layer0, scope="partial")
    assert running.check_tokens() != before


def test_refusals_change_nothing(running: Running) -> None:
    before = running.check_tokens()
    version = running.version

    # FP8 bytes into a float32 expert: refused by the trainer before anything is sent ...
    fp8 = running.weights[EXPERT].to(torch.float8_e4m3fn)
    with pytest.raises(PlanError) as planned:
        running.pusher.push({EXPERT: fp8}, version=version + 1, scope="partial")
    assert planned.value.reason == "DTYPE_MISMATCH" and "float8_e4m3fn" in str(planned.value)

    # ... and by the worker, sent straight to it.
    owner, manifest = next(iter(running.pusher.manifests().items()))
    packed = pack({EXPERT: fp8})
    stub = pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(owner))
    outcome = push(
        stub,
        [
            header(version + 1, scope=pb.UPDATE_SCOPE_PARTIAL),
            bucket(0, packed.specs, [inline_payload(packed.data, device=manifest.device.to_proto())]),
            commit(1),
        ],
    )
    assert outcome.code == grpc.StatusCode.FAILED_PRECONDITION, outcome
    assert outcome.reason == "DTYPE_MISMATCH" and "float8_e4m3fn" in outcome.message, outcome

    # A FULL update without one expert's down projection: refused before sending, naming it.
    incomplete = {n: t for n, t in full_checkpoint(SPEC, seed=5).items() if n != EXPERT}
    with pytest.raises(PlanError) as missing:
        running.pusher.push(incomplete, version=version + 1)
    assert missing.value.reason == "INCOMPLETE_UPDATE" and EXPERT in str(missing.value)

    assert running.states() == {(version, pb.WORKER_STATE_CONSISTENT)}
    assert running.check_tokens() == before
