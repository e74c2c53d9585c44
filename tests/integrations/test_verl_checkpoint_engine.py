"""weightwire.integrations.verl driven through verl's own plug point (verl 0.9.1 from the package
index, in ``.venv``) into real ``weightwire serve`` worker processes (the TP=2 demo model, one
fleet for the module, on unix sockets in one directory as an engine's plugin lays them out).

What runs is what verl's ``CheckpointEngineManager.update_weights`` does for a backend other than
``naive``, minus Ray: verl's ``import_external_libs`` loads the module named in
``custom_backend_module``, ``CheckpointEngineRegistry.new("weightwire", bucket_size=...,
**engine_kwargs)`` builds the engine in each actor rank and each rollout worker, then ``prepare``
on all, the class's ``build_topology`` over their metadata (checked as the manager checks it),
``init_process_group`` with each one's share, ``send_weights`` on the actor beside
``receive_weights`` on the rollout workers (concurrently, as verl's ``ray.get`` over both groups),
``finalize``. Each worker's dump must then equal its TP shard of what the actor sent, at version
``global_steps``.

The last test runs verl's own ``CheckpointEngineManager.update_weights`` on a local Ray (CPU only):
verl's ``RayWorkerGroup`` of two actor ranks and, for the rollout replica, verl's own
``CheckpointEngineWorker`` (tests/integrations/verl_ray_workers.py says what stands in for the FSDP
engine and the GPU server adapter). One Ray session for the module.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import WorkerProcess, demo_args, load_dump, rank_env, spawn_workers
from ports import free_port
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs
from weightwire.adapters.torch.demo import DemoConfig, expected_shard, full_checkpoint
from weightwire.client import PlanError, PushError
from weightwire.core.manifest import ParallelRank

pytestmark = pytest.mark.timeout(300)

# A refused step ends on every actor rank within this (the pusher's timeout is 120 s).
STALE_STEP_ENDS_WITHIN_S = 20.0

CONFIG = DemoConfig()
HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = [ParallelRank(tp_rank=t, tp_size=2, pp_rank=0, pp_size=1) for t in range(2)]
BUCKET_BYTES = 1 << 20


class Fleet:
    def __init__(self, root: Path) -> None:
        self.socket_dir, self.dump_dir = root / "sock", root / "dump"
        self.socket_dir.mkdir(mode=0o700)
        self.processes: list[WorkerProcess] = spawn_workers(
            [
                demo_args(
                    tp=(r.tp_rank, 2),
                    dump_dir=self.dump_dir,
                    listen=f"unix:{self.socket_dir}/tp{r.tp_rank}-pp0.sock",
                )
                for r in RANKS
            ]
        )

    def version(self) -> int:
        """The version the workers hold now (each test starts past what the module pushed before)."""
        from weightwire.client import WeightPusher

        targets = [f"unix:{self.socket_dir}/tp{r.tp_rank}-pp0.sock" for r in RANKS]
        with WeightPusher(targets) as pusher:
            return max(int(s.weights_version) for s in pusher.status().values())

    def assert_holds(self, version: int, full: dict[str, torch.Tensor]) -> None:
        for rank in RANKS:
            got = load_dump(self.dump_dir, f"tp{rank.tp_rank}-pp0", version)
            want = expected_shard(full, rank, CONFIG)
            assert sorted(got) == sorted(want)
            for name, t in want.items():
                assert torch.equal(got[name], t), f"tp{rank.tp_rank}: {name} differs at version {version}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("verl"))
    try:
        yield f
    finally:
        for p in f.processes:
            p.stop()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray for the module; its worker processes import verl_ray_workers from here."""
    import ray

    saved = os.environ.get("PYTHONPATH")
    # The raylet and its workers inherit the driver's environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, saved) if p)
    try:
        for attempt in (1, 2):
            try:
                # Four logical CPUs on any machine: one bundle per actor rank and per rollout worker.
                ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
                break
            except Exception as e:
                # Ray gives its raylet a fixed 30 s to register with its GCS; on a loaded 2-core
                # host one start has missed that (the GCS's one lookup took the whole 30 s), which
                # is Ray's start-up, not what this module tests: start it once more.
                if attempt == 2 or "timed out during startup" not in str(e):
                    raise
                ray.shutdown()
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def new_engine(**engine_kwargs: object) -> CheckpointEngine:
    # What CheckpointEngineWorker and the actor worker run: the custom module first, then the registry.
    import_external_libs("weightwire.integrations.verl")
    return CheckpointEngineRegistry.new("weightwire", bucket_size=BUCKET_BYTES, **engine_kwargs)


def wire(actors: list[CheckpointEngine], rollouts: list[CheckpointEngine]) -> None:
    """CheckpointEngineManager.build_process_group without Ray."""
    metadata = [e.prepare() for e in actors + rollouts]
    cls = CheckpointEngineRegistry.get("weightwire")
    actor_kwargs, rollout_kwargs = cls.build_topology(len(actors), len(rollouts), metadata)
    for group, kwargs in ((actors, actor_kwargs), (rollouts, rollout_kwargs)):
        for values in kwargs.values():
            assert len(values) == len(group)
        for i, engine in enumerate(group):
            engine.init_process_group(**{k: v[i] for k, v in kwargs.items()})


def update(
    actors: list[CheckpointEngine], rollouts: list[CheckpointEngine], weights: dict, step: int
) -> list:
    """The manager's step 5 and 6: every sender and receiver at once, then finalize on all."""

    async def receive(engine: CheckpointEngine) -> list:
        return [item async for item in engine.receive_weights(global_steps=step)]

    async def run() -> list:
        sends = [a.send_weights(iter(weights.items()), global_steps=step) for a in actors]
        return await asyncio.gather(*sends, *[receive(r) for r in rollouts])

    results = asyncio.run(run())
    for e in actors + rollouts:
        e.finalize()
    return results


@pytest.mark.parametrize("layout", ["colocated", "disaggregated"])
def test_verl_updates_reach_every_worker_as_global_steps(fleet: Fleet, layout: str) -> None:
    first = 0 if layout == "colocated" else 10
    kwargs = {"layout": layout, "socket_dir": str(fleet.socket_dir), "group_host": "127.0.0.1"}
    actor = new_engine(**kwargs)
    rollouts = [new_engine(**kwargs) for _ in RANKS]  # one rollout worker per engine GPU (rank)
    try:
        wire([actor], rollouts)
        # The rollout workers found the two engine workers (one device here: the host), and the actor
        # got both.
        assert sorted(actor.targets) == sorted(f"unix:{fleet.socket_dir}/tp{t}-pp0.sock" for t in range(2))
        if layout == "colocated":
            # verl's sync before step 1: the engine serves the checkpoint it started from.
            results = update([actor], rollouts, full_checkpoint(CONFIG, seed=0), 0)
            assert results[0]["weightwire/workers"] == 0
        for step in (first + 1, first + 2):
            weights = full_checkpoint(CONFIG, seed=step)
            results = update([actor], rollouts, weights, step)
            assert results[0]["weightwire/workers"] == 2
            # Disaggregated: every byte over the transfer group; colocated: memory handles only.
            assert (results[0]["weightwire/group_bytes"] > 0) == (layout == "disaggregated")
            assert results[1:] == [[], []]  # nothing passes through verl's rollout processes
            fleet.assert_holds(step, weights)

        # A stale step is refused by every worker, with its reason, and nothing changes.
        with pytest.raises(PushError) as stale:
            update([actor], rollouts[:0], full_checkpoint(CONFIG, seed=99), first + 1)
        # The worker at fault first; over a transfer group the other may be cancelled before it
        # refused for itself.
        reasons = [e.reason for e in stale.value.failures.values()]
        assert reasons[0] == "STALE_VERSION" and set(reasons) <= {"STALE_VERSION", "CANCELLED"}, reasons
        # An actor of another model: refused before anything is sent.
        other = dict(full_checkpoint(CONFIG, seed=5))
        other["model.norm.weight"] = torch.ones(CONFIG.hidden_size + 8, dtype=CONFIG.dtype)
        with pytest.raises(PlanError) as mismatch:
            update([actor], rollouts[:0], other, first + 3)
        assert mismatch.value.reason == "SHAPE_MISMATCH"
        fleet.assert_holds(first + 2, full_checkpoint(CONFIG, seed=first + 2))
    finally:
        for e in [actor, *rollouts]:
            e.close()


def test_colocated_actor_without_a_worker_on_its_device_is_refused(fleet: Fleet) -> None:
    actor, rollout = new_engine(), new_engine(socket_dir=str(fleet.socket_dir))
    metadata = [{**actor.prepare(), "device": "cuda:00000000-0000-0000-0000-000000000000"}, rollout.prepare()]
    actor_kwargs, _ = CheckpointEngineRegistry.get("weightwire").build_topology(1, 1, metadata)
    with pytest.raises(ValueError, match="no weightwire worker on actor rank 0's device"):
        actor.init_process_group(**{k: v[0] for k, v in actor_kwargs.items()})
    assert os.path.isdir(fleet.socket_dir)


def test_disaggregated_every_actor_rank_a_source(fleet: Fleet) -> None:
    """Two actor ranks (processes of one gloo world): every rank sends its part over one transfer
    group, each worker receives its slices; the weights and version land as from one sender."""
    world, store_port, master_port = 2, free_port(), free_port()
    kwargs = {"layout": "disaggregated", "group_host": "127.0.0.1", "group_port": store_port}
    actors = [new_engine(**kwargs) for _ in range(world)]
    rollouts = [new_engine(socket_dir=str(fleet.socket_dir), **kwargs) for _ in RANKS]
    metadata = [e.prepare() for e in actors + rollouts]
    actor_kwargs, rollout_kwargs = CheckpointEngineRegistry.get("weightwire").build_topology(
        world, 2, metadata
    )
    for i, r in enumerate(rollouts):
        r.init_process_group(**{k: v[i] for k, v in rollout_kwargs.items()})
    steps = [21, 22]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "verl_actor_rank.py"),
                json.dumps(
                    {
                        "engine": kwargs,
                        "topology": {k: v[rank] for k, v in actor_kwargs.items()},
                        "steps": steps,
                    }
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **rank_env(rank, world, master_port), "TORCH_CPP_LOG_LEVEL": "ERROR"},
        )
        for rank in range(world)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    lines = [[json.loads(x) for x in out.splitlines() if x.startswith("{")] for out, _ in outs]
    for rank_lines in lines:
        assert [x["step"] for x in rank_lines] == steps
        assert all(x["weightwire/workers"] == 2 and x["weightwire/group_bytes"] > 0 for x in rank_lines)
    for r in rollouts:
        assert asyncio.run(_drain(r, steps[-1])) == []
    fleet.assert_holds(steps[-1], full_checkpoint(CONFIG, seed=steps[-1]))


def test_verl_checkpoint_engine_manager_updates_over_ray(fleet: Fleet, local_ray: None) -> None:
    """verl's CheckpointEngineManager.update_weights, as its trainer calls it each step: two actor
    ranks (verl RayWorkerGroup, one gloo world) every one a source of one transfer group, one rollout
    replica of TP=2 whose two CheckpointEngineWorkers front the two weightwire workers."""
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import split_resource_pool
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig
    from verl_ray_workers import ActorRank, LocalReplica, RolloutSide

    config = CheckpointEngineConfig(
        backend="weightwire",
        custom_backend_module="weightwire.integrations.verl",
        update_weights_bucket_megabytes=1,
        engine_kwargs={
            "weightwire": {
                "layout": "disaggregated",
                "socket_dir": str(fleet.socket_dir),
                "group_host": "127.0.0.1",
                "group_port": free_port(),
            }
        },
    )
    rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=2, checkpoint_engine=config)
    started = time.perf_counter()
    pool = RayResourcePool(process_on_nodes=[4], use_gpu=False, max_colocate_count=1)
    actor_pool, rollout_pool = split_resource_pool(pool, [2, 2])
    actors = RayWorkerGroup(
        resource_pool=actor_pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(ActorRank), checkpoint_engine_config=config),
        device_name="cpu",
    )
    rollout = RayWorkerGroup(
        resource_pool=rollout_pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(RolloutSide), rollout_config=rollout_config),
        device_name="cpu",
    )
    replica = LocalReplica(replica_rank=0, config=rollout_config, model_config=None, gpus_per_node=2)
    asyncio.run(replica.init_hybrid(rollout))
    manager = CheckpointEngineManager(config, actors, [replica])
    print(f"\nverl worker groups up in {time.perf_counter() - started:.1f} s")

    base = fleet.version()
    for step in (base + 1, base + 2):
        started = time.perf_counter()
        metrics = manager.update_weights(global_steps=step)
        took = time.perf_counter() - started
        assert metrics["weightwire/workers"] == 2 and metrics["weightwire/group_bytes"] > 0, metrics
        fleet.assert_holds(step, full_checkpoint(CONFIG, seed=step))
        print(f"\nverl update_weights step {step}: {took:.3f} s, push {metrics['weightwire/sync_s']:.3f} s")
    # Each rollout worker's server adapter was handed both updates, and no tensor passed through it.
    assert rollout.received() == [[[], []], [[], []]]

    # A stale step fails the manager's call with the workers' reason; the weights stay. (Ray hands the
    # driver weightwire's PushError as text: its exceptions do not unpickle, ray's
    # UnserializableException carries their message and stack.)
    # Both actor ranks end with it within seconds, not at the pusher's timeout (120 s): the workers
    # refuse at the header and never join the plan's comparison the second rank's sends begin with.
    started = time.perf_counter()
    with pytest.raises(ray.exceptions.RayError, match="STALE_VERSION"):
        manager.update_weights(global_steps=base + 1)
    took = time.perf_counter() - started
    print(f"verl update_weights of a stale step failed in {took:.1f} s")
    assert took < STALE_STEP_ENDS_WITHIN_S, f"the stale step took {took:.1f} s"
    fleet.assert_holds(base + 2, full_checkpoint(CONFIG, seed=base + 2))


async def _drain(engine: CheckpointEngine, step: int) -> list:
    return [item async for item in engine.receive_weights(global_steps=step)]
