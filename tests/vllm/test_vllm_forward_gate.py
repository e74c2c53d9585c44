"""The forward gate of a vLLM worker, on a real torch module and real threads: a forward pass that
starts while an update writes waits for the write to end, and a write waits for a running forward
(refusing after its timeout) — the order of events is checked, never how long anything took."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import wait_until
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from weightwire.adapters.vllm.forward_gate import ForwardGate


class Model(torch.nn.Module):
    """A forward that can be held open, and a real vLLM LogitsProcessor next to it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.logits_processor = LogitsProcessor(4)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.ran = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.release.wait(timeout=60)
        self.ran += 1
        return self.linear(x)


@pytest.fixture
def model() -> Model:
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vLLM's layers read it when built
        return Model()


def test_a_forward_that_starts_during_a_write_waits_for_it(model: Model) -> None:
    gate = ForwardGate()
    remove = gate.install(model)
    model.release.set()
    assert gate.begin_write(timeout_s=10)
    forward = threading.Thread(target=model, args=(torch.ones(1, 4),))
    forward.start()
    assert wait_until(lambda: gate.forwards_waited == 1)
    assert model.ran == 0 and not model.entered.is_set()  # held at the gate, before its body
    gate.end_write()
    forward.join(timeout=60)
    assert model.ran == 1
    remove()


def test_a_write_waits_for_a_running_forward_and_gives_up_after_its_timeout(model: Model) -> None:
    gate = ForwardGate()
    remove = gate.install(model)
    forward = threading.Thread(target=model, args=(torch.ones(1, 4),))
    forward.start()
    assert model.entered.wait(timeout=60)
    assert not gate.begin_write(timeout_s=0.05)  # the forward is held open: the write must not start
    assert not gate.writing
    model.release.set()
    forward.join(timeout=60)
    assert gate.begin_write(timeout_s=10)
    gate.end_write()
    remove()


def test_a_forward_that_raises_leaves_the_gate(model: Model) -> None:
    gate = ForwardGate()
    remove = gate.install(model)
    assert model.logits_processor._forward_pre_hooks and model.logits_processor._forward_hooks
    model.release.set()
    with pytest.raises(RuntimeError):
        model(torch.ones(1, 5))  # wrong width: Linear raises inside the forward
    assert gate.begin_write(timeout_s=10)  # the failed forward is not counted as running
    gate.end_write()
    remove()
    assert (
        not model._forward_pre_hooks
        and not model._forward_hooks
        and not model.logits_processor._forward_hooks
    )
