"""Fixed per-update cost on a CPU: repeated FULL updates of a 399-tensor model without real bytes.

Separate trainer and worker processes over host shared memory, the same wiring as ``bench_cpu.py``
(``worker.py --mode weightwire --device cpu``), but on ``qwen3-8b-names`` (Qwen3-8B's 399 names with
tiny shapes), so what is timed is the per-update, per-tensor work: client re-check and planning,
gRPC messages, the worker's checks, views and loads, the commit. Used to measure the effect of
changes to that work (BENCHMARKS.md, "Fixed per-update cost")::

    python bench/fixed_cost.py [--reps 200] [--mode inplace|packed] [--profile FILE] [--device cuda]

With ``--device cuda`` both processes use GPU 0 and the bytes go over CUDA IPC (in place: the
trainer's buffer is exported once and the worker keeps its mapping), the path of the GPU targets.

``--profile`` writes a cProfile of the trainer's pushes (the worker's side shows in its split).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import torch
from common import ms, now
from rig import PLAN_NS, RECHECK_NS, flat_buckets, instrument_trainer, make_rig, reset_counters
from weightwire.adapters.torch import DEFAULT_COPY_STREAMS
from weightwire.client.push.pusher import WeightPusher


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b-names")
    p.add_argument("--mode", choices=["inplace", "packed"], default="inplace")
    p.add_argument("--reps", type=int, default=200, help="timed updates (after 5 untimed ones)")
    p.add_argument("--profile", default="", help="write a cProfile of the timed pushes here")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: trainer and worker on GPU 0, CUDA IPC (the colocated path the GPU bench times)",
    )
    p.add_argument(
        "--rpc",
        choices=["auto", "stream"],
        default="auto",
        help="stream: send even a one-bucket update on a PushWeights stream (as to a worker older than PushUpdate)",
    )
    p.add_argument(
        "--copy-streams",
        type=int,
        default=DEFAULT_COPY_STREAMS,
        help="the worker's TorchAdapter copy_streams",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    instrument_trainer()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    rig = make_rig(args.model, device, peer=False)
    log_dir = Path(tempfile.mkdtemp(prefix="ww-fixed-"))
    proc = common.WorkerProc(
        "w",
        [
            "--mode",
            "weightwire",
            "--model",
            args.model,
            "--device",
            args.device,
            "--threads",
            "1",
            "--copy-streams",
            str(args.copy_streams),
        ],
        log_dir,
        common.child_env(threads=1),
    )
    with common.worker_group([proc]) as (w,):
        pusher = WeightPusher(
            [w.info["address"]], transport="host_shm" if args.device == "cpu" else "cuda_ipc"
        )
        if args.rpc == "stream":
            # What a worker older than PushUpdate gets: the same update on a PushWeights stream.
            for worker in pusher._workers.values():
                worker.accepts_push_update = False
        try:
            pusher.manifests()
            if args.mode == "inplace":
                if args.device == "cpu":
                    src = pusher.host_buffer(rig.size)
                    src.copy_(rig.flat)
                else:
                    src = rig.flat  # exported in place, one kept mapping on the worker
                buckets = flat_buckets(src, rig.specs, None)

                def push(v: int) -> object:
                    return pusher.push_flat(buckets, version=v)
            else:
                named = rig.named

                def push(v: int) -> object:
                    return pusher.push(named, version=v)

            for v in range(1, 6):
                push(v)
            w.call({"cmd": "stats"})
            prof = cProfile.Profile() if args.profile else None
            totals, rechecks, plans = [], [], []
            spans: dict[int, tuple[int, int]] = {}
            for v in range(6, 6 + args.reps):
                reset_counters()
                if prof is not None:
                    prof.enable()
                t0 = now()
                push(v)
                t1 = now()
                spans[v] = (t0, t1)
                totals.append(ms(t1 - t0))
                if prof is not None:
                    prof.disable()
                rechecks.append(ms(RECHECK_NS[0]))
                plans.append(ms(PLAN_NS[0]))
            stats = w.call({"cmd": "stats"})["updates"]
        finally:
            pusher.close()
    if prof is not None:
        prof.dump_stats(args.profile)
    med = common.median
    part = {
        k: med([ms(r.get(k, 0)) for r in stats])
        for k in ("begin_ns", "bucket_ns", "copy_ns", "open_ns", "commit_ns")
    }
    print(
        f"{args.model} {args.mode}: {args.reps} updates, median total {med(totals):.2f} ms "
        f"(best {min(totals):.2f}); trainer: re-check {med(rechecks):.2f}, plan {med(plans):.2f}; "
        f"worker: header {part['begin_ns']:.2f}, buckets {part['bucket_ns']:.2f} "
        f"(of which load {part['copy_ns']:.2f}, open {part['open_ns']:.2f}), commit {part['commit_ns']:.2f}"
    )
    # The same timeline as BENCHMARKS.md's "where the rest goes": both processes read CLOCK_MONOTONIC.
    hops: dict[str, list[float]] = {"pre": [], "hop1": [], "hop2": [], "post": []}
    for r in stats:
        span = spans.get(int(r.get("version", -1)))
        if span is None or "t_commit_start_ns" not in r:
            continue
        hops["pre"].append(ms(r["t_header_ns"] - span[0]))
        hops["hop1"].append(ms(r.get("t_first_bucket_ns", r["t_header_ns"]) - r["t_header_ns"]))
        hops["hop2"].append(
            ms(r["t_commit_start_ns"] - r.get("t_last_bucket_end_ns", r["t_commit_start_ns"]))
        )
        hops["post"].append(ms(span[1] - r["t_commit_end_ns"]))
    if hops["pre"]:
        print(
            "timeline (medians, ms): push() -> header at the worker {:.2f}; header -> first bucket {:.2f}; "
            "last bucket done -> commit at the worker {:.2f}; commit done -> push() returns {:.2f}".format(
                *(med(hops[k]) for k in ("pre", "hop1", "hop2", "post"))
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
