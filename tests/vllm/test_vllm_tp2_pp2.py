"""weightwire in a real vLLM engine on CPU with TP=2 x PP=2 (four workers on two cores).

Several versions in a row, a PARTIAL push across one stage, and a refused update; after each,
every worker is at the expected version and the engine's tokens equal the reference. One engine
for the module.
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
)
from vllm_cpu import CpuEngine, ModelSpec, checkpoint, started_engine
from weightwire.adapters.vllm import worker_endpoints
from weightwire.client import WeightPusher

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SPEC = ModelSpec()
START, SECOND, THIRD, FOURTH = 1, 2, 4, 5


@pytest.fixture(scope="module")
def checkpoints() -> dict[int, dict[str, torch.Tensor]]:
    return {seed: checkpoint(SPEC, seed) for seed in (START, SECOND, THIRD, FOURTH)}


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[int, dict[str, torch.Tensor]]
) -> Iterator[CpuEngine]:
    with started_engine(tmp_path_factory.mktemp("vllm-tp2pp2"), SPEC, checkpoints[START], tp=2, pp=2) as eng:
        yield eng


@pytest.fixture(scope="module")
def expected(checkpoints: dict[int, dict[str, torch.Tensor]]) -> Expected:
    return Expected(SPEC, dict(checkpoints[START]))


@pytest.fixture(scope="module")
def pusher(engine: CpuEngine) -> Iterator[WeightPusher]:
    with WeightPusher(worker_endpoints(engine.llm), transport="host_shm", timeout_s=120) as p:
        yield p


def test_four_workers_split_the_checkpoint(
    engine: CpuEngine, pusher: WeightPusher, checkpoints: dict[int, dict[str, torch.Tensor]]
) -> None:
    check_manifests(engine, pusher, checkpoints[START])


def test_several_versions_a_partial_and_a_refusal(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    for seed in (SECOND, THIRD, FOURTH):
        push_in_window(engine, pusher, expected, checkpoints[seed])
    # The last stage only: layer 3's attention and the output projection.
    src = checkpoints[SECOND]
    partial = {n: t for n, t in src.items() if n.startswith(("model.layers.3.self_attn.", "lm_head."))}
    results = push_in_window(engine, pusher, expected, partial, scope="partial")
    assert {r.tensors_loaded for r in results.values() if r.worker_id.endswith("pp0")} == {0}
    with UpdateWindow(engine):
        mislabelled = push_mislabelled(
            pusher, {"lm_head.weight": checkpoints[THIRD]["lm_head.weight"]}, expected.version + 1
        )
        assert refused(mislabelled, {"NO_PAYLOAD_FOR_DEVICE", "CANCELLED"}) >= {"NO_PAYLOAD_FOR_DEVICE"}
    check_engine(engine, pusher, expected)
