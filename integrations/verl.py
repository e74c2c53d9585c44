"""The ``weightwire`` checkpoint engine for verl (0.9): trainer ranks push into the engine's workers.

verl moves weights from its actor (trainer) ranks to its rollout replicas through a checkpoint
engine chosen by ``actor_rollout_ref.rollout.checkpoint_engine.backend``; a backend outside verl
registers itself with ``@CheckpointEngineRegistry.register(name)`` from the module named in
``checkpoint_engine.custom_backend_module``. Importing this module registers ``weightwire``::

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightwire
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightwire.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightwire.socket_dir=/run/weightwire/engine0

verl's ``CheckpointEngineManager`` runs, per weight update: ``prepare()`` on every actor rank and
every rollout worker, ``build_topology`` over what they returned, ``init_process_group(**kwargs)``
on each, ``send_weights`` on the actor ranks alongside ``receive_weights`` on the rollout workers,
``finalize()``. Here the bytes never pass through verl's rollout processes: each rollout worker
(one per GPU of a replica, beside that GPU's engine worker) reports the weightwire workers it fronts
(those whose manifest names its own device); ``build_topology`` hands each actor rank its workers,
and the actor ranks push with ``WeightPusher`` straight into them, as weights version =
``global_steps``. ``receive_weights`` yields nothing and returns once its workers hold that version,
so verl resumes generation only on the new weights. Layouts (``engine_kwargs.weightwire.layout``):

- ``colocated``: actor rank i and the engine share GPU i; rank i pushes to the workers on its own
  device only (CUDA IPC, ``only_own_device``), every worker's device checked against the handle's.
- ``disaggregated``: the actor ranks and the engine are on different machines; every actor rank is
  a source of one transfer group with all the workers (``push(..., group=WORLD)`` over
  ``TransferGroupOptions``: each worker receives exactly the slices its manifest keeps). With one
  actor rank, that rank sends everything over the group.

Every refusal (a worker of another model, a stale version, a device or shard mismatch) is a
``PushError`` / ``PlanError`` raised from ``send_weights``, which fails verl's update step.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from weightwire.client import PushError, TransferGroupOptions, WeightPusher
from weightwire.core.devices import device_ref_of

logger = logging.getLogger(__name__)

BACKEND = "weightwire"
LAYOUTS = ("colocated", "disaggregated")


def _own_device() -> str:
    """This process's device as weightwire labels it (CUDA UUID, or the host's boot id)."""
    if torch.cuda.is_available():
        return str(device_ref_of(torch.device("cuda", torch.cuda.current_device())))
    return str(device_ref_of(torch.device("cpu")))


@CheckpointEngineRegistry.register(BACKEND)
class WeightwireCheckpointEngine(CheckpointEngine):
    """verl ``CheckpointEngine`` over weightwire; see the module docstring.

    ``bucket_size`` comes from verl (``update_weights_bucket_megabytes``); the rest from
    ``engine_kwargs.weightwire``: ``socket_dir`` or ``workers`` (the engine's weightwire workers, as
    a rollout worker on the engine's machine reaches them), ``layout``, ``group_host`` /
    ``group_port`` (disaggregated: the address of each actor rank's transfer-group sockets and the
    store port of rank 0), ``transport``, ``timeout_s``, ``token``, ``cast_to`` (a dtype name, e.g.
    ``"bfloat16"``), ``wait_s`` (how long ``receive_weights`` waits for its workers' version).
    """

    def __init__(
        self,
        bucket_size: int,
        *,
        socket_dir: str | None = None,
        workers: Sequence[str] | None = None,
        layout: str = "colocated",
        group_host: str | None = None,
        group_port: int = 0,
        transport: str = "auto",
        timeout_s: float = 120.0,
        token: str | None = None,
        cast_to: str | None = None,
        wait_s: float = 300.0,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if socket_dir is not None and workers is not None:
            raise ValueError("pass socket_dir or workers, not both")
        self.bucket_size = int(bucket_size)
        self.socket_dir = socket_dir
        self.workers = list(workers) if workers is not None else None
        self.layout = layout
        self.group_host = group_host
        self.group_port = int(group_port)
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.token = token
        self.cast_to = getattr(torch, cast_to) if cast_to else None
        self.wait_s = float(wait_s)
        self.role: str | None = None
        self.rank = 0
        self.world_size = 1
        self.targets: list[str] = []
        self._pusher: WeightPusher | None = None

    # -- verl's CheckpointEngine ----------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """What this process can tell the topology: its host and device, and the weightwire workers
        on its device that it reaches (none on a trainer machine without the engine's sockets)."""
        device = _own_device()
        return {"host": socket.gethostname(), "device": device, "workers": self._local_workers(device)}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor ranks first, then rollout workers (verl's order of ``metadata``). Each rollout
        worker fronts the workers of its device; the actor ranks get every one of them, each with
        the device it is on, and pick theirs by layout in ``init_process_group``."""
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(
                f"{len(metadata)} metadata entries for {actor_wg_world_size} actor ranks and {rollout_world_size} rollout workers"
            )
        actors, rollouts = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        fronted: dict[str, str] = {}
        for entry in rollouts:
            for address in entry["workers"]:
                fronted.setdefault(address, entry["device"])
        if not fronted:
            raise ValueError(
                "no rollout worker reached a weightwire worker: start the engine with the weightwire backend "
                "(vLLM) or plugin (SGLang) and give engine_kwargs.weightwire.socket_dir or workers"
            )
        every = [[address, device] for address, device in fronted.items()]
        actor_kwargs: dict[str, list[Any]] = {
            "role": ["actor"] * actor_wg_world_size,
            "rank": list(range(actor_wg_world_size)),
            "world_size": [actor_wg_world_size] * actor_wg_world_size,
            "device": [a["device"] for a in actors],
            "workers": [every] * actor_wg_world_size,
        }
        rollout_kwargs: dict[str, list[Any]] = {
            "role": ["rollout"] * rollout_world_size,
            "rank": list(range(rollout_world_size)),
            "world_size": [rollout_world_size] * rollout_world_size,
            "device": [r["device"] for r in rollouts],
            "workers": [[[address, r["device"]] for address in r["workers"]] for r in rollouts],
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(  # type: ignore[override]  # verl passes build_topology's keys by name
        self, *, role: str, rank: int, world_size: int, device: str, workers: list[list[str]], **_: Any
    ) -> None:
        self.role, self.rank, self.world_size = role, int(rank), int(world_size)
        if role == "actor" and self.layout == "colocated":
            targets = [address for address, on in workers if on == device]
            if not targets:
                raise ValueError(
                    f"colocated layout: no weightwire worker on actor rank {rank}'s device {device} "
                    f"(workers: {workers}); use layout=disaggregated if the engine is elsewhere"
                )
        else:
            targets = [address for address, _ in workers]
        if targets != self.targets and self._pusher is not None:
            self._pusher.close()
            self._pusher = None
        self.targets = targets

    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None
    ) -> dict[str, Any]:
        """Push ``weights`` (full tensors, as verl's ``get_per_tensor_param`` yields them) as version
        ``global_steps``; raises ``PlanError`` / ``PushError`` naming each refusing worker."""
        if self.role != "actor":
            raise RuntimeError("send_weights runs on actor ranks, after init_process_group")
        if global_steps is None:
            raise ValueError("the weightwire checkpoint engine needs global_steps: it is the weights version")
        items = [(name, tensor) async for name, tensor in _as_async(weights)]
        pusher = self._pusher_for_targets()
        if global_steps == 0 and {int(s.weights_version) for s in pusher.status().values()} == {0}:
            # The sync before the first step: the engine still serves the checkpoint it started from
            # (version 0, nothing pushed), the one the actor loaded; 0 is not a newer version.
            return {"weightwire/sync_s": 0.0, "weightwire/workers": 0, "weightwire/group_bytes": 0}
        started = time.perf_counter()
        options: dict[str, Any] = {"version": int(global_steps), "cast_to": self.cast_to}
        if self.layout == "colocated":
            results = pusher.push(items, only_own_device=True, **options)
        elif self.world_size > 1:
            import torch.distributed as dist

            results = pusher.push(items, group=dist.group.WORLD, **options)
        else:
            results = pusher.push(items, **options)
        return {
            "weightwire/sync_s": time.perf_counter() - started,
            "weightwire/workers": len(results),
            # Bytes the workers received over a transfer group (0 through memory handles).
            "weightwire/group_bytes": sum(int(r.bytes_received) for r in results.values()),
        }

    async def receive_weights(  # type: ignore[override]  # an async generator, as verl's callers iterate it
        self, global_steps: int | None = None
    ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Nothing to hand verl's server adapter (the workers loaded the weights themselves); returns
        once every worker of this rollout process holds ``global_steps``."""
        if global_steps is not None and self.targets:
            self._wait_for_version(int(global_steps))
        return
        yield

    def finalize(self) -> None:
        # The pusher (and a transfer group) stays across steps: verl rebuilds the topology every
        # update, and the workers are the same ones unless a replica was added or removed.
        return None

    def close(self) -> None:
        if self._pusher is not None:
            self._pusher.close()
            self._pusher = None

    # -- helpers ---------------------------------------------------------------------------------

    def _local_workers(self, device: str) -> list[str]:
        endpoints = self.workers
        if endpoints is None and self.socket_dir is not None:
            from weightwire.adapters.discovery import DiscoveryError, discover

            try:
                endpoints = discover(self.socket_dir)
            except DiscoveryError:
                endpoints = []  # a trainer machine: the engine's sockets are not here
        if not endpoints:
            return []
        with WeightPusher(endpoints, token=self.token, timeout_s=self.timeout_s) as pusher:
            manifests = pusher.manifests()
        return [address for address, m in manifests.items() if str(m.device) == device]

    def _pusher_for_targets(self) -> WeightPusher:
        if self._pusher is None:
            group = None
            if self.layout == "disaggregated":
                group = TransferGroupOptions(
                    host=self.group_host or socket.gethostname(), port=self.group_port
                )
            self._pusher = WeightPusher(
                self.targets,
                token=self.token,
                timeout_s=self.timeout_s,
                bucket_size_bytes=self.bucket_size,
                transport=self.transport,
                transfer_group=group,
            )
        return self._pusher

    def _wait_for_version(self, version: int) -> None:
        with WeightPusher(self.targets, token=self.token, timeout_s=self.timeout_s) as pusher:
            deadline = time.monotonic() + self.wait_s
            while True:
                versions = {a: int(s.weights_version) for a, s in pusher.status().items()}
                if min(versions.values()) >= version:
                    return
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"weightwire workers did not reach weights version {version}: {versions}"
                    )
                time.sleep(0.05)


async def _as_async(weights: Any) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


__all__ = ["BACKEND", "PushError", "WeightwireCheckpointEngine"]
