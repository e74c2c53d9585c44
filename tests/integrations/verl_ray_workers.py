"""The two Ray worker classes verl's ``CheckpointEngineManager`` drives, for the CPU test of the
``weightwire`` checkpoint engine (tests/integrations/test_verl_checkpoint_engine.py). Ray's worker
processes import this module by name (the test puts this folder on their ``PYTHONPATH``).

They follow verl's own checkpoint-engine harness (``tests/checkpoint_engine/test_utils.py`` in the
verl repository, Apache-2.0: ``TrainingWorkerTest``, ``MockServerAdapter``, ``MockReplica``,
``CheckpointEngineWorkerTest``), which verl does not install; written here against verl 0.9.1's
calls (the manager calls ``update_weights(global_steps=, mode=)`` on the actor group):

- ``ActorRank``: a verl ``Worker`` holding a checkpoint engine built as verl's actor worker builds it
  (``import_external_libs(custom_backend_module)``, then the registry with the config's
  ``engine_kwargs[backend]``). Its weights are the demo model's deterministic checkpoint of the step
  (``full_checkpoint(seed=global_steps)``) in place of an FSDP engine's ``get_per_tensor_param()``:
  verl's FSDP engine needs CUDA.
- ``RolloutSide``: verl's own ``CheckpointEngineWorker`` (its ``__init__``, ``update_weights`` and
  ``execute_checkpoint_engine`` unchanged) with ``DrainingServerAdapter`` in place of verl's vLLM /
  SGLang server adapter, which needs an engine verl launched on a GPU. With weightwire the weights
  reach the engine's workers straight from the actor ranks, so the adapter only iterates what
  ``receive_weights`` yields and records it (nothing, as the test asserts).
- ``LocalReplica``: a ``RolloutReplica`` over a slice of the rollout worker group with no HTTP
  servers (verl's ``MockReplica``): the manager's abort / release / resume calls reach no server.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayWorkerGroup
from verl.utils.distributed import initialize_global_process_group_ray
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig, RolloutConfig
from verl.workers.rollout import BaseRollout, RolloutReplica
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint


class ActorRank(Worker):
    def __init__(self, checkpoint_engine_config: CheckpointEngineConfig) -> None:
        super().__init__()
        # The actor ranks' own world (FSDP's, in verl), which every-rank-a-source pushes use.
        initialize_global_process_group_ray(backend="gloo")
        config = checkpoint_engine_config
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend,
            bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}),
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        weights = full_checkpoint(DemoConfig(), seed=int(global_steps or 0))
        metrics = await self.checkpoint_engine.send_weights(iter(weights.items()), global_steps=global_steps)
        return metrics or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class DrainingServerAdapter(BaseRollout):
    def __init__(self, config: RolloutConfig, model_config: Any = None) -> None:
        super().__init__(config, model_config, device_mesh=None)
        self.replica_rank, self.is_leader_rank = 0, True
        self.received: list[list[str]] = []

    async def update_weights(
        self, weights: AsyncGenerator[tuple[str, torch.Tensor], None], **kwargs: Any
    ) -> None:
        self.received.append([name async for name, _ in weights])

    async def resume(self, tags: list[str]) -> None:
        raise NotImplementedError("no engine memory to resume on CPU")

    async def release(self) -> None:
        raise NotImplementedError("no engine memory to release on CPU")


class RolloutSide(CheckpointEngineWorker):
    def __init__(self, rollout_config: RolloutConfig) -> None:
        super().__init__(rollout_config, None, DrainingServerAdapter(rollout_config))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self) -> list[list[str]]:
        adapter = self.server_adapter
        assert isinstance(adapter, DrainingServerAdapter)
        return adapter.received


class LocalReplica(RolloutReplica):
    async def init_hybrid(self, worker_group: RayWorkerGroup) -> None:
        self.workers = worker_group.workers[
            self.world_size * self.replica_rank : self.world_size * (self.replica_rank + 1)
        ]

    def get_ray_class_with_init_args(self) -> Any:
        raise NotImplementedError

    async def launch_servers(self) -> None:
        raise NotImplementedError
