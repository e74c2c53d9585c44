"""Sleep and wake around pushes into a real vLLM engine on CPU (one worker).

vLLM's CPU worker cannot sleep (``LLM.sleep`` releases nothing there), so the worker extension
``vllm_sleep_probe.SleepProbe`` runs the backend's own wrappers of ``Worker.sleep`` / ``wake_up``
around a stand-in for the release, in the worker process; the GPU run of the real sleep is
``tests/gpu/sleep_wake.py``. Checked: the backend hooked the GPU worker class in the worker
process; a push while asleep is refused with ENGINE_ASLEEP (nothing written: tokens, version and a
CONSISTENT worker unchanged); waking only the KV cache keeps it refused; after waking the weights a
push lands, with the direct copies proven before a level-1 sleep still used, and forgotten (proven
again by the next push through vLLM's reload) after a level-2 sleep; a sleep that fails leaves
pushes accepted.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from engine_checks import Expected, check_engine, push_in_window, refused
from test_vllm_direct_copy import NORMS, norm_tensors
from vllm_cpu import CpuEngine, ModelSpec, checkpoint, save_checkpoint
from weightwire.adapters.vllm import update_window, worker_endpoints
from weightwire.client import PushError, WeightPusher

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SPEC = ModelSpec()
SEEDS = (1, 2, 4)


@pytest.fixture(scope="module")
def checkpoints() -> dict[int, dict[str, torch.Tensor]]:
    return {seed: checkpoint(SPEC, seed) for seed in SEEDS}


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[int, dict[str, torch.Tensor]]
) -> Iterator[CpuEngine]:
    tmp = tmp_path_factory.mktemp("vllm-sleep")
    eng = CpuEngine(
        save_checkpoint(SPEC, checkpoints[SEEDS[0]], tmp / "ckpt"),
        tp=1,
        pp=1,
        socket_dir=tmp / "sock",
        worker_extension_cls="vllm_sleep_probe.SleepProbe",
    )
    try:
        yield eng
    finally:
        eng.stop()


def rpc(engine: CpuEngine, method: str, *args: object) -> object:
    (answer,) = engine.llm.collective_rpc(method, args=args)
    return answer


def refused_while_asleep(engine: CpuEngine, pusher: WeightPusher, expected: Expected, tensors: dict) -> str:
    with pytest.raises(PushError) as err, update_window(engine.llm, expected.version + 1):
        pusher.push(tensors, version=expected.version + 1)
    assert refused(err.value, {"ENGINE_ASLEEP"}) == {"ENGINE_ASLEEP"}
    check_engine(engine, pusher, expected)  # old tokens, version, CONSISTENT
    (failure,) = err.value.failures.values()
    return failure.message


def test_a_push_while_asleep_is_refused_and_lands_after_wake_up(
    engine: CpuEngine, checkpoints: dict[int, dict[str, torch.Tensor]]
) -> None:
    expected = Expected(SPEC, dict(checkpoints[SEEDS[0]]))
    assert rpc(engine, "weightwire_sleep_hooked") is True
    with WeightPusher(worker_endpoints(engine.llm), transport="host_shm", timeout_s=120) as pusher:
        push_in_window(engine, pusher, expected, checkpoints[SEEDS[1]])  # proves the norms
        assert rpc(engine, "weightwire_direct")["proven"] == NORMS  # type: ignore[index]

        assert rpc(engine, "weightwire_sleep", 1) == 1
        message = refused_while_asleep(engine, pusher, expected, checkpoints[SEEDS[2]])
        assert "sleep level 1" in message and "wake_up" in message, message
        assert rpc(engine, "weightwire_wake_up", ["kv_cache"]) == 1  # the weights still sleep
        refused_while_asleep(engine, pusher, expected, checkpoints[SEEDS[2]])
        assert rpc(engine, "weightwire_wake_up", ["weights"]) is None
        copied = rpc(engine, "weightwire_direct")["copied"]  # type: ignore[index]
        push_in_window(engine, pusher, expected, checkpoints[SEEDS[2]])
        # Level 1 kept the bytes at the same addresses: the proven norms were copied directly.
        assert rpc(engine, "weightwire_direct")["copied"] == copied + len(NORMS)  # type: ignore[index]

        assert rpc(engine, "weightwire_sleep", 2) == 2
        message = refused_while_asleep(engine, pusher, expected, checkpoints[SEEDS[0]])
        assert "level 2" in message and "FULL" in message, message
        assert rpc(engine, "weightwire_wake_up", None) is None
        state = rpc(engine, "weightwire_direct")
        assert state["proven"] == [], state  # type: ignore[index]
        # The first push after a level-2 wake goes through vLLM's reload and proves the norms again.
        push_in_window(engine, pusher, expected, checkpoints[SEEDS[0]])
        after = rpc(engine, "weightwire_direct")
        assert after["proven"] == NORMS and after["copied"] == state["copied"], after  # type: ignore[index]
        push_in_window(engine, pusher, expected, norm_tensors(checkpoints[SEEDS[1]]), scope="partial")
        assert rpc(engine, "weightwire_direct")["copied"] == state["copied"] + len(NORMS)  # type: ignore[index]

        # A sleep that fails released nothing: pushes are still accepted.
        assert rpc(engine, "weightwire_sleep", 1, True) is None
        push_in_window(engine, pusher, expected, checkpoints[SEEDS[2]])
