"""An SGLang or vLLM worker's slices staged on the host until the commit (over gloo): each bucket's
bytes are copied from the receiving process's shared segment into host tensors of the kept shapes.
Into tensors allocated for the update (as before ``server/transports/host_staging.py``) against
the tensors ``HostStaging`` keeps from the update before, same run, alternating.

    .venv/bin/python bench/bench_host_staging.py [--model cpu-l] [--tp 2] [--reps 7] [--out DIR]

Per repetition, one worker's TP shard of ``--model`` (``bench/models.py``) as one update:

``fresh``   ``torch.empty`` of every kept shape, then the copy from the segment (what the update
            paid before: the new pages' first touch inside the copy);
``kept``    ``HostStaging.take`` of every kept shape (the buffers the previous repetition dropped),
            then the same copy;
``memcpy``  one ``copy_`` of the shard's bytes between two buffers touched before: the limit.

Single-threaded (``torch.set_num_threads(1)``), as the worker's landing runs. Results:
``DIR/host_staging.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from weightwire.server.transports.host_staging import HostStaging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="cpu-l")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)

    shapes = [(t.name, models.shard_shape(t, 0, args.tp), t.dtype) for t in models.tensor_shapes(args.model)]
    sizes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, s, d in shapes]
    total = sum(sizes)
    segment = torch.randint(0, 255, (total,), dtype=torch.uint8).share_memory_()
    limit_dst = torch.empty(total, dtype=torch.uint8)
    limit_dst.copy_(segment)

    def land(take) -> float:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        staged = {}
        at = 0
        for (name, shape, dtype), n in zip(shapes, sizes, strict=True):
            dst = take(name, shape, dtype)
            dst.view(torch.uint8).view(-1).copy_(segment[at : at + n])
            staged[name] = dst
            at += n
        took = time.perf_counter() - t0
        del staged
        return took

    staging = HostStaging()
    land(staging.take)  # the first update fills the pool
    fresh: list[float] = []
    kept: list[float] = []
    memcpy: list[float] = []
    for _ in range(args.reps):
        fresh.append(land(lambda _n, shape, dtype: torch.empty(shape, dtype=dtype)))
        kept.append(land(staging.take))
        t0 = time.perf_counter()
        limit_dst.copy_(segment)
        memcpy.append(time.perf_counter() - t0)

    med = {k: statistics.median(v) for k, v in (("fresh", fresh), ("kept", kept), ("memcpy", memcpy))}
    res = {
        "model": args.model,
        "tp": args.tp,
        "tensors": len(shapes),
        "bytes": total,
        "reps": args.reps,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "seconds": {"fresh": fresh, "kept": kept, "memcpy": memcpy},
        "median_s": med,
    }
    mib = total / 2**20
    print(f"{args.model} TP shard 0/{args.tp}: {len(shapes)} tensors, {mib:.0f} MiB, medians of {args.reps}")
    for k in ("fresh", "kept", "memcpy"):
        print(
            f"  {k:7s} {med[k] * 1e3:8.1f} ms  {mib / 1024 / med[k]:6.2f} GiB/s  x memcpy {med[k] / med['memcpy']:.2f}"
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_staging.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
