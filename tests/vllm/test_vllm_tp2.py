"""weightwire in a real vLLM engine on CPU with two tensor-parallel workers (TP=2), on Llama (no
q/k/v biases, unlike the Qwen2 of the other modules).

Both workers own every checkpoint name (each loads its TP slice through vLLM's weight loaders);
a push must change both, and a refusal on both must change neither. One engine for the module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from engine_checks import (
    Expected,
    UpdateWindow,
    check_engine,
    check_manifests,
    push_in_window,
    push_mislabelled,
    refused,
    updates_held_open,
)
from vllm_cpu import CpuEngine, ModelSpec, checkpoint, started_engine
from weightwire.adapters.vllm import worker_endpoints
from weightwire.client import PushError, WeightPusher

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SPEC = ModelSpec(arch="llama")
START, SECOND, THIRD = 1, 2, 4


@pytest.fixture(scope="module")
def checkpoints() -> dict[int, dict[str, torch.Tensor]]:
    return {seed: checkpoint(SPEC, seed) for seed in (START, SECOND, THIRD)}


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[int, dict[str, torch.Tensor]]
) -> Iterator[CpuEngine]:
    with started_engine(tmp_path_factory.mktemp("vllm-tp2"), SPEC, checkpoints[START], tp=2, pp=1) as eng:
        yield eng


@pytest.fixture(scope="module")
def expected(checkpoints: dict[int, dict[str, torch.Tensor]]) -> Expected:
    return Expected(SPEC, dict(checkpoints[START]))


@pytest.fixture(scope="module")
def pusher(engine: CpuEngine) -> Iterator[WeightPusher]:
    with WeightPusher(worker_endpoints(engine.llm), transport="host_shm", timeout_s=120) as p:
        yield p


def test_both_ranks_own_every_tensor_at_full_shape(
    engine: CpuEngine, pusher: WeightPusher, checkpoints: dict[int, dict[str, torch.Tensor]]
) -> None:
    check_manifests(engine, pusher, checkpoints[START])
    assert all(set(m.tensors) == set(checkpoints[START]) for m in pusher.manifests().values())
    assert not any(n.endswith("_proj.bias") for n in checkpoints[START])


def test_full_then_partial_push(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    push_in_window(engine, pusher, expected, checkpoints[SECOND])
    src = checkpoints[THIRD]
    partial = {n: t for n, t in src.items() if n.startswith(("model.layers.0.mlp.", "lm_head."))}
    push_in_window(engine, pusher, expected, partial, scope="partial")


def test_refusals_on_both_ranks_change_nothing(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    version = expected.version + 1
    with pytest.raises(PushError) as outside:
        pusher.push(checkpoints[THIRD], version=version)
    assert refused(outside.value, {"ENGINE_NOT_PAUSED", "CANCELLED"}) >= {"ENGINE_NOT_PAUSED"}
    with UpdateWindow(engine):
        mislabelled = push_mislabelled(
            pusher, {"lm_head.weight": checkpoints[THIRD]["lm_head.weight"]}, version
        )
        assert refused(mislabelled, {"NO_PAYLOAD_FOR_DEVICE", "CANCELLED"}) >= {"NO_PAYLOAD_FOR_DEVICE"}
        with updates_held_open(pusher, version), pytest.raises(PushError) as concurrent:
            pusher.push(checkpoints[THIRD], version=version)
        # The first refusal cancels the push on the other worker (client rule); neither commits.
        assert refused(concurrent.value, {"UPDATE_IN_PROGRESS", "CANCELLED"}) >= {"UPDATE_IN_PROGRESS"}
    check_engine(engine, pusher, expected)
