"""FSDP2 pushes from 1, 2 and 4 gloo ranks on a CPU: what the multi-rank lockstep adds per bucket.

One ``bench/worker.py --mode weightwire`` worker holds ``--model``; trainer ranks are real processes
of one gloo group, each holding an FSDP2 shard (``fully_shard`` per layer and at the root) of the
same parameters, and every rank runs ``pusher.push(model.state_dict(), version=v)``. In the same run:

- ``plain``: one rank pushes the same values as separately allocated plain tensors (``push(dict)``):
  the single-process path;
- ``gather``: the ranks' all-gathers of every tensor (``DTensor.full_tensor()``) with no push: the
  collective cost a gathered push cannot avoid;
- ``fsdp2 xN``: the push from N ranks (one rank takes the plain path: nothing to agree on).

The per-bucket overhead is ``(fsdp2 - plain - gather) / buckets``: what the ranks' exchanges (the
per-bucket step, the plan, the outcome and results) cost on top of moving the bytes. Each case ends
with the worker's digest checked against the pushed values.

Usage: ``python bench/fsdp_ranks_cpu.py --out DIR [--model cpu-m] [--ranks 1 2 4] [--reps 5] [--bucket-mib 4]``.
Writes ``DIR/fsdp_ranks.json`` and prints one line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402
import models  # noqa: E402

SEED = 7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sharded(preset: str) -> tuple[torch.nn.Module, list[str]]:
    from torch.distributed.fsdp import fully_shard

    shapes = models.tensor_shapes(preset)
    module = models.build_module(shapes, torch.device("cpu"))
    models.refill(list(dict(module.named_parameters()).values()), seed=SEED)
    layers = getattr(getattr(module, "model", None), "layers", None)
    if layers is not None:
        for layer in layers.children():
            fully_shard(layer)
    fully_shard(module)
    return module, [t.name for t in shapes]


def _rank_main(
    rank: int,
    world: int,
    port: int,
    address: str,
    preset: str,
    reps: int,
    first_version: int,
    plain: bool,
    out: Any,
    bucket_bytes: int,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from weightwire.client import WeightPusher

    module, names = _sharded(preset)
    sd = module.state_dict()
    if plain:  # the same values as separately allocated plain tensors: the single-process path
        sd = {n: sd[n].full_tensor().clone() for n in names}
    gather_ms: list[float] = []
    push_ms: list[float] = []
    buckets = 0
    with WeightPusher([address], timeout_s=300, bucket_size_bytes=bucket_bytes) as pusher:
        version = first_version
        for i in range(reps + 1):  # the first of each is a warm-up
            dist.barrier()
            t0 = time.perf_counter()
            for n in names:
                if not plain:
                    sd[n].full_tensor()
            dist.barrier()
            if i:
                gather_ms.append((time.perf_counter() - t0) * 1e3)
            dist.barrier()
            t0 = time.perf_counter()
            results = pusher.push(sd, version=version)
            dist.barrier()
            if i:
                push_ms.append((time.perf_counter() - t0) * 1e3)
            buckets = next(iter(results.values())).buckets
            version += 1
    digest = models.digest([sd[n] if plain else sd[n].full_tensor() for n in names])
    if rank == 0:
        out.put(
            {
                "gather_ms": gather_ms,
                "push_ms": push_ms,
                "buckets": buckets,
                "digest": digest,
                "next_version": version,
            }
        )
    dist.destroy_process_group()


def _run_ranks(
    world: int,
    address: str,
    preset: str,
    reps: int,
    first_version: int,
    bucket_bytes: int,
    plain: bool = False,
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world, port, address, preset, reps, first_version, plain, q, bucket_bytes),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes) or q.empty():
        raise RuntimeError(f"trainer ranks exited {codes}")
    return q.get()  # type: ignore[no-any-return]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="cpu-m", choices=sorted(models.PRESETS))
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--bucket-mib",
        type=float,
        default=4.0,
        help="bucket size: small buckets make the per-bucket cost visible",
    )
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    shapes = models.tensor_shapes(args.model)
    model_bytes = sum(t.nbytes for t in shapes)
    record: dict[str, Any] = {
        "environment": common.environment(),
        "model": args.model,
        "model_bytes": model_bytes,
        "tensors": len(shapes),
        "cases": {},
    }
    ok = True
    worker = common.WorkerProc(
        "fsdp-ranks",
        ["--mode", "weightwire", "--model", args.model, "--device", "cpu"],
        out_dir,
        dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        address = worker.wait_ready(240)["address"]
        bucket_bytes = int(args.bucket_mib * 2**20)
        record["bucket_bytes"] = bucket_bytes
        got = _run_ranks(1, address, args.model, args.reps, 1, bucket_bytes, plain=True)
        version, times = got["next_version"], got["push_ms"]
        plain_ms = statistics.median(times)
        ok = worker.call({"cmd": "digest"})["digest"] == got["digest"]
        record["cases"]["plain"] = {"median_ms": plain_ms, "reps": times, "digest_ok": ok}
        print(
            f"plain: {plain_ms:.2f} ms ({model_bytes / 2**20:.0f} MiB, {len(shapes)} tensors), digest {'OK' if ok else 'MISMATCH'}",
            flush=True,
        )
        for world in args.ranks:
            got = _run_ranks(world, address, args.model, args.reps, version, bucket_bytes)
            version = got["next_version"]
            digest_ok = worker.call({"cmd": "digest"})["digest"] == got["digest"]
            ok = ok and digest_ok
            push_ms, gather_ms = statistics.median(got["push_ms"]), statistics.median(got["gather_ms"])
            buckets = max(1, int(got["buckets"]))
            per_bucket = (push_ms - plain_ms - (gather_ms if world > 1 else 0.0)) / buckets
            record["cases"][f"fsdp2_x{world}"] = {
                "median_ms": push_ms,
                "gather_median_ms": gather_ms,
                "buckets": buckets,
                "reps": got["push_ms"],
                "overhead_per_bucket_ms": per_bucket,
                "over_plain": push_ms / plain_ms,
                "digest_ok": digest_ok,
            }
            print(
                f"fsdp2 x{world}: {push_ms:.2f} ms (x{push_ms / plain_ms:.2f} plain; gathers alone {gather_ms:.2f} ms; "
                f"{buckets} buckets, {per_bucket:.2f} ms per bucket beyond the bytes), digest {'OK' if digest_ok else 'MISMATCH'}",
                flush=True,
            )
    finally:
        worker.stop()
    (out_dir / "fsdp_ranks.json").write_text(json.dumps(record, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
