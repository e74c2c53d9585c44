"""weightwire in a real vLLM engine on CPU with two pipeline stages (PP=2) and tied embeddings.

Stage 0 holds the embedding and layers [0, 2); stage 1 holds layers [2, 4), the final norm and,
the embeddings being tied, its own copy of the embedding that vLLM's lm_head reads. Neither owns
``lm_head.weight``: a tied checkpoint has none, and a trainer that sends one is told before
anything is sent. One engine for the module.
"""

from __future__ import annotations

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
    push_wrong_shape_raw,
)
from vllm_cpu import CpuEngine, ModelSpec, checkpoint, started_engine
from weightwire.adapters.vllm import worker_endpoints
from weightwire.client import PlanError, WeightPusher

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SPEC = ModelSpec(tie=True)
START, SECOND, THIRD = 1, 2, 4


@pytest.fixture(scope="module")
def checkpoints() -> dict[int, dict[str, torch.Tensor]]:
    return {seed: checkpoint(SPEC, seed) for seed in (START, SECOND, THIRD)}


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[int, dict[str, torch.Tensor]]
) -> Iterator[CpuEngine]:
    with started_engine(tmp_path_factory.mktemp("vllm-pp2"), SPEC, checkpoints[START], tp=1, pp=2) as eng:
        yield eng


@pytest.fixture(scope="module")
def expected(checkpoints: dict[int, dict[str, torch.Tensor]]) -> Expected:
    return Expected(SPEC, dict(checkpoints[START]))


@pytest.fixture(scope="module")
def pusher(engine: CpuEngine) -> Iterator[WeightPusher]:
    with WeightPusher(worker_endpoints(engine.llm), transport="host_shm", timeout_s=120) as p:
        yield p


def test_stages_own_their_layers_and_the_tied_embedding(
    engine: CpuEngine, pusher: WeightPusher, checkpoints: dict[int, dict[str, torch.Tensor]]
) -> None:
    check_manifests(engine, pusher, checkpoints[START])
    first, last = sorted(pusher.manifests().values(), key=lambda m: m.rank.pp_rank)
    assert "model.embed_tokens.weight" in first.tensors and "model.norm.weight" not in first.tensors
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(last.tensors)
    assert not any("lm_head" in n for m in (first, last) for n in m.tensors)


def test_full_push_then_the_tied_embedding_alone(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    push_in_window(engine, pusher, expected, checkpoints[SECOND])
    # One tensor, two stages: the input embedding on stage 0 and the output projection on stage 1.
    embed = {"model.embed_tokens.weight": checkpoints[THIRD]["model.embed_tokens.weight"]}
    push_in_window(engine, pusher, expected, embed, scope="partial")


def test_lm_head_of_a_tied_model_and_a_wrong_shape_change_nothing(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    version = expected.version + 1
    with UpdateWindow(engine):
        with pytest.raises(PlanError, match=r"lm_head\.weight"):
            pusher.push(
                {**checkpoints[THIRD], "lm_head.weight": torch.zeros(SPEC.vocab, SPEC.hidden)},
                version=version,
            )
        last = next(a for a, m in pusher.manifests().items() if m.rank.pp_rank == 1)
        assert push_wrong_shape_raw(
            last, version, "model.layers.3.mlp.down_proj.weight", torch.ones(SPEC.hidden, 8)
        ) == (grpc.StatusCode.FAILED_PRECONDITION, "SHAPE_MISMATCH")
    check_engine(engine, pusher, expected)
