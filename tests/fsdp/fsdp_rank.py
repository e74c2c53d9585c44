"""One trainer rank of the FSDP2 tests (tests/fsdp): torch.distributed with gloo on the CPU, the demo
model wrapped with FSDP2 ``fully_shard`` (each rank holds a shard of every parameter as a DTensor),
pushing with ``WeightPusher.push(...)`` the way a training loop would: every rank runs the same line.

Started by ``tests/fsdp/fsdp_ranks.py`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)
as ``fsdp_rank.py SCENARIOS.json OUT_DIR``. Runs the scenarios in order and rewrites
``OUT_DIR/rank<R>.json`` after each one (so a rank that dies leaves what it did): per scenario
``{"ok": true, "results": {...}}`` or ``{"ok": false, "error": {...}}``, plus memory readings where
asked. A scenario is a JSON object:

  name, kind ("push" | "gather_checks" | "raise_version" | "flat_dtensor")
  endpoints, routing ("own_device" | "gathered"), sender_rank, version, seed, bucket_size_bytes, timeout_s
  source: "state_dict" (default) | "named_parameters" | "full_tensors" (every DTensor gathered whole first,
          pushed as plain tensors with group=: the control for the memory test)
  config: DemoConfig fields (hidden_size, ...; dtype "float32"), cast_to: a dtype name
  stand_in_gpu: label this rank's shared memory as stand-in GPU "stand-in-gpu-<rank>" (workers of
          tests/fsdp/labelled_worker.py on that label take it as their own device)
  version_by_rank: {rank: version}   a rank pushing another version (the ranks disagree)
  skip_ranks: [rank]                 ranks that do not call push (on a group of its own)
  die_rank, die_after_buckets        that rank exits (code 17) once that many of its buckets were acked
  measure_memory                     peak RSS growth over the push (``/proc/self/clear_refs``)

``flat_dtensor``: a DTensor given to ``push_flat`` and to ``export_payload`` (both take local buffers).
``raise_version`` (rank 0 only): a PARTIAL update of one tensor to ``endpoint`` at ``version``, from an
ordinary single-process pusher, so that worker refuses a later, lower version (STALE_VERSION).
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from weightwire.adapters.torch.demo import DemoConfig, build_demo_model
from weightwire.client import PushError, PushProgress, WeightPusher, WeightwireError
from weightwire.client.transports.exporter import HostShmExporter
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ParallelRank

DIED_EXIT_CODE = 17


class StandInGpuExporter(HostShmExporter):
    """Host shared memory labelled as stand-in GPU ``label`` instead of this machine's boot id: on a
    CPU machine, the stand-in for a trainer rank's own GPU (the workers on that label import it)."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = DeviceRef.host(label)


def stand_in_label(rank: int) -> str:
    return f"stand-in-gpu-{rank}"


def config_of(spec: dict[str, Any] | None) -> DemoConfig:
    spec = dict(spec or {})
    if "dtype" in spec:
        spec["dtype"] = getattr(torch, spec["dtype"])
    return DemoConfig(**spec)


def fsdp_model(config: DemoConfig, seed: int) -> torch.nn.Module:
    """The whole demo model holding ``full_checkpoint(config, seed)``, sharded with FSDP2 per layer."""
    model = build_demo_model(config, ParallelRank(), "cpu", seed)
    for layer in model.model.layers.children():
        fully_shard(layer)
    fully_shard(model)
    return model


def memory_kib() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def reset_peak_rss() -> None:
    """Give freed heap back and make the peak RSS (VmHWM) start again from the current RSS."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def error_json(e: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(e).__name__, "text": str(e)[:4000]}
    if isinstance(e, WeightwireError):
        out.update(reason=e.reason, code=e.code, message=e.message, metadata=e.metadata)
    if isinstance(e, PushError):
        out["failures"] = {
            a: {"reason": err.reason, "code": err.code, "message": err.message}
            for a, err in e.failures.items()
        }
        out["results"] = sorted(e.results)
    return out


def run_push(rank: int, world: int, sc: dict[str, Any]) -> dict[str, Any]:
    config = config_of(sc.get("config"))
    version = int(sc.get("version_by_rank", {}).get(str(rank), sc["version"]))
    seed = int(sc.get("seed", sc["version"]))
    model = fsdp_model(config, seed)
    dist.barrier()  # the push starts together: a slow model build is not a rank that fails to take part
    group = None
    if sc.get("skip_ranks"):
        # The ranks' agreement runs on a group of its own, so the default group stays usable.
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
        if rank in sc["skip_ranks"]:
            return {"ok": True, "skipped": True}
    pusher = WeightPusher(
        sc["endpoints"],
        transport=sc.get("transport", "auto"),
        bucket_size_bytes=int(sc.get("bucket_size_bytes", 1 << 16)),
        timeout_s=float(sc.get("timeout_s", 120)),
    )
    if sc.get("stand_in_gpu"):
        # Test-only: the pusher's host shared-memory exporter, labelled as this rank's stand-in GPU.
        pusher._staging._exporters["host_shm"] = StandInGpuExporter(stand_in_label(rank))
    acked = 0

    def progress(p: PushProgress) -> None:
        nonlocal acked
        acked += 1
        if sc.get("die_rank") == rank and acked >= int(sc.get("die_after_buckets", 1)):
            os._exit(DIED_EXIT_CODE)  # a rank that dies mid-push: no cleanup, like a crash

    source = sc.get("source", "state_dict")
    if source == "named_parameters":
        tensors: Any = model.named_parameters()
    elif source == "full_tensors":
        tensors = None
    else:
        tensors = model.state_dict()
    record: dict[str, Any] = {"version": version}
    if sc.get("measure_memory"):
        reset_peak_rss()
        record["before_kib"] = memory_kib()["VmRSS"]
    try:
        if tensors is None:
            # The control: every DTensor's full value at once, as plain tensors (what the per-bucket
            # gather avoids), pushed with group= so the ranks still push together.
            full = {n: t.full_tensor() for n, t in model.state_dict().items()}
            results = pusher.push(
                full, version=version, group=dist.group.WORLD, routing=sc.get("routing", "own_device")
            )
        else:
            results = pusher.push(
                tensors,
                version=version,
                routing=sc.get("routing", "own_device"),
                sender_rank=int(sc.get("sender_rank", 0)),
                cast_to=getattr(torch, sc["cast_to"]) if sc.get("cast_to") else None,
                group=group,
                progress=progress,
            )
        record.update(ok=True, results={a: dataclasses.asdict(r) for a, r in results.items()})
    except (PushError, WeightwireError) as e:
        record.update(ok=False, error=error_json(e))
    finally:
        if sc.get("measure_memory"):
            record["peak_kib"] = memory_kib()["VmHWM"]
        pusher.close()
    return record


def run_raise_version(rank: int, sc: dict[str, Any]) -> dict[str, Any]:
    if rank != 0:
        return {"ok": True}
    with WeightPusher([sc["endpoint"]], transport="inline") as pusher:
        owned = pusher.manifests()[sc["endpoint"]].tensors
        name = next(iter(sorted(owned)))
        shape = tuple(owned[name].shape)
        pusher.push({name: torch.zeros(shape)}, version=int(sc["version"]), scope="partial")
    return {"ok": True, "tensor": name}


def run_flat_dtensor(sc: dict[str, Any]) -> dict[str, Any]:
    from weightwire.client import FlatBucket, TensorSpec

    model = fsdp_model(config_of(sc.get("config")), 1)
    shard = model.state_dict()["model.norm.weight"]
    out: dict[str, Any] = {}
    with WeightPusher(sc["endpoints"]) as pusher:
        for what, call in (
            (
                "push_flat",
                lambda: pusher.push_flat(
                    [FlatBucket(shard, [TensorSpec("model.norm.weight", shard.dtype, tuple(shard.shape))])],
                    version=int(sc["version"]),
                    scope="partial",
                ),
            ),
            ("export_payload", lambda: pusher.export_payload(shard)),
        ):
            try:
                call()
                out[what] = {"ok": True}
            except WeightwireError as e:
                out[what] = {"ok": False, "error": error_json(e)}
    return {"ok": True, "cases": out}


def run_gather_checks(rank: int, world: int) -> dict[str, Any]:
    """``FullTensorWriter`` against DTensors laid out by torch itself, for the layouts it handles
    (even and uneven Shard(0), Shard(1), Replicate, empty shards, a dtype conversion) and one it hands
    to DTensor's own redistribution (Partial)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from weightwire.client.inputs.dtensor_gather import FullTensorWriter

    mesh = init_device_mesh("cpu", (world,))
    writer = FullTensorWriter(timeout_s=30)
    gen = torch.Generator().manual_seed(7)
    cases = [
        ("even_shard0", (4 * world, 3), [Shard(0)], torch.float32),
        ("uneven_shard0", (2 * world + 1, 5), [Shard(0)], torch.float32),
        ("fewer_rows_than_ranks", (world - 1, 2), [Shard(0)], torch.float32),
        ("shard1", (3, 2 * world + 1), [Shard(1)], torch.float32),
        ("replicate", (6, 2), [Replicate()], torch.float32),
        ("cast_to_bf16", (4 * world, 3), [Shard(0)], torch.bfloat16),
    ]
    out: dict[str, Any] = {}
    for name, shape, placements, dst_dtype in cases:
        full = torch.randn(shape, generator=gen)
        dt = distribute_tensor(full, mesh, placements)
        dst = torch.full(shape, float("nan"), dtype=dst_dtype)
        writer.write(name, dt, dst)
        out[name] = bool(torch.equal(dst, full.to(dst_dtype)))
    # A DTensor with a pending sum: DTensor's own redistribution reduces it.
    local = torch.full((3, 2), float(rank + 1))
    partial = DTensor.from_local(local, mesh, [Partial()])
    dst = torch.empty((3, 2))
    writer.write("partial", partial, dst)
    out["partial"] = bool(torch.equal(dst, torch.full((3, 2), float(sum(range(1, world + 1))))))
    # A rank that only takes part (dst None) still lets the others gather.
    dt = distribute_tensor(torch.arange(4.0 * world).reshape(world, 4), mesh, [Shard(0)])
    dst = torch.empty((world, 4)) if rank == 0 else None
    writer.write("only_rank0_writes", dt, dst)
    out["only_rank0_writes"] = dst is None or bool(
        torch.equal(dst, torch.arange(4.0 * world).reshape(world, 4))
    )
    return {"ok": all(out.values()), "cases": out}


def main() -> int:
    scenarios_path, out_dir = sys.argv[1], sys.argv[2]
    with open(scenarios_path, encoding="utf-8") as f:
        scenarios = json.load(f)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    out_path = os.path.join(out_dir, f"rank{rank}.json")
    done: dict[str, Any] = {}
    for sc in scenarios:
        if sc["kind"] == "gather_checks":
            done[sc["name"]] = run_gather_checks(rank, world)
        elif sc["kind"] == "flat_dtensor":
            done[sc["name"]] = run_flat_dtensor(sc)
        elif sc["kind"] == "raise_version":
            done[sc["name"]] = run_raise_version(rank, sc)
        else:
            done[sc["name"]] = run_push(rank, world, sc)
        tmp = f"{out_path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(done, f)
        os.replace(tmp, out_path)
        if not sc.get("skip_ranks") and not any(
            r.get("error", {}).get("reason") == "TRAINER_RANK_LOST" for r in done.values()
        ):
            dist.barrier()  # the next scenario starts together (its model build is collective-free anyway)
    if any(r.get("error", {}).get("reason") == "TRAINER_RANK_LOST" for r in done.values()):
        os._exit(0)  # the group lost a rank: tearing it down could wait on the dead peer
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
