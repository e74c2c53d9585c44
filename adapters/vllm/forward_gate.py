"""Keep one vLLM worker's forward passes and weightwire's writes into its model apart.

The worker service writes parameters from its gRPC thread; vLLM runs every forward pass on the
worker's main thread. A forward that ran while a layer was being reloaded would read a half-written
weight, or a parameter that vLLM's layerwise reload has moved to the meta device (and fail). The
trainer is asked to pause generation around an update (the adapter refuses pushes outside vLLM's
``start_weight_update`` / ``finish_weight_update``), and this gate makes the rule hold inside each
worker even when that was not done: a forward waits while an update writes, an update waits for a
running forward to end.

The gate is entered by forward pre-hooks and left by forward hooks (``always_call=True``, so a
forward that raised leaves it too) on the model and on each of its ``LogitsProcessor`` modules
(vLLM computes logits outside ``model.forward``). Pre-hooks may nest (the logits processor runs
inside a hooked model on some runners): a writer only waits for the count to drop to zero and only
then closes the gate, so a nested entry never waits for a writer that waits for it.

Created by ``weightwire.adapters.vllm.adapter``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch


class ForwardGate:
    """Forwards (any number at once) and one writer exclude each other."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._forwards = 0
        self._writing = False
        self.forwards_waited = 0
        """How many forward passes had to wait for a write (a paused engine never makes one wait)."""

    def install(self, model: torch.nn.Module) -> Callable[[], None]:
        """Hook the model and its logits processors; returns a function that removes the hooks."""
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        targets = [model, *(m for m in model.modules() if isinstance(m, LogitsProcessor))]
        handles: list[Any] = []
        for module in targets:
            handles.append(module.register_forward_pre_hook(self._enter_hook))
            handles.append(module.register_forward_hook(self._exit_hook, always_call=True))

        def remove() -> None:
            for handle in handles:
                handle.remove()

        return remove

    def _enter_hook(self, module: torch.nn.Module, args: Any) -> None:
        with self._cond:
            if self._writing:
                self.forwards_waited += 1
            while self._writing:
                self._cond.wait()
            self._forwards += 1

    def _exit_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        with self._cond:
            self._forwards -= 1
            if self._forwards == 0:
                self._cond.notify_all()

    def begin_write(self, timeout_s: float) -> bool:
        """Wait until no forward runs, then close the gate. False if a forward ran past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._forwards > 0 or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self._writing = True
        return True

    def end_write(self) -> None:
        with self._cond:
            self._writing = False
            self._cond.notify_all()

    @property
    def writing(self) -> bool:
        return self._writing
