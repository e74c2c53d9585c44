"""Test-only worker extension: vLLM's CPU worker cannot sleep (its ``sleep`` / ``wake_up`` release
nothing and override the GPU worker's), so these run the backend's own wrappers of ``Worker.sleep`` /
``Worker.wake_up`` around a stand-in for the memory release, in the worker process
(``LLM.collective_rpc("weightwire_sleep", args=(level,))``)."""

from __future__ import annotations

from typing import Any

from vllm_direct_probe import DirectProbe


class SleepProbe(DirectProbe):
    """Mixed into each vLLM worker (vLLM's worker-extension mechanism)."""

    def weightwire_sleep(self, level: int, fail: bool = False) -> int | None:
        from weightwire.adapters.vllm.backend import _wrap_sleep

        def release(worker: Any, level: int) -> None:
            if fail:
                raise RuntimeError("the stand-in release failed")

        try:
            _wrap_sleep(release)(self, level)
        except RuntimeError:
            pass
        return self.weight_transfer_engine.adapter.asleep_level  # type: ignore[no-any-return]

    def weightwire_wake_up(self, tags: list[str] | None) -> int | None:
        from weightwire.adapters.vllm.backend import _wrap_wake_up

        _wrap_wake_up(lambda worker, tags: None)(self, tags)
        return self.weight_transfer_engine.adapter.asleep_level  # type: ignore[no-any-return]

    def weightwire_sleep_hooked(self) -> bool:
        from vllm.v1.worker.gpu_worker import Worker

        return all(getattr(getattr(Worker, n), "_weightwire_sleep_hook", False) for n in ("sleep", "wake_up"))
