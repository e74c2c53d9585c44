"""CPU benchmark: weightwire's host shared-memory path against memcpy, and scaling over workers.

Runs on any machine (``make bench-cpu``)::

    python bench/bench_cpu.py [--out DIR] [--quick] [--budget-s 300]

This process is the trainer; each worker is a ``worker.py --mode weightwire --device cpu`` process
(a real weightwire worker serving a synthetic Qwen-style model, ``models.py``) on a Unix socket.

``shm``       one worker, for each model size: memcpy of the model's bytes in this process (one flat
              copy; per-tensor copies out of a flat buffer; pack + unpack through 64 MiB buckets),
              then weightwire in place (``push_flat`` of a buffer from ``host_buffer``: the worker
              copies once out of the trainer's segment) and packed (``push``: the trainer packs into
              double-buffered segments, the worker copies out).
``scaling``   one trainer to 1, 2, 4, 8, 16 workers, every worker a full replica (a DP group: bytes
              copied grow with the workers), for two model sizes; and TP-sharded (each of N workers
              loads 1/N of the matrices: bytes copied stay constant) where the budget allows.

Every update is checked: each worker's parameters equal the trainer's bytes (exact digests) after
each case. Results: DIR/cpu_results.json and DIR/bench_cpu.log; ``report.py`` makes tables and plots.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import models
from common import ms, now
from rig import (
    PLAN_NS,
    RECHECK_NS,
    STAGE_NS,
    Rig,
    flat_buckets,
    instrument_trainer,
    make_rig,
    parse_size,
    reset_counters,
)
from weightwire.adapters.torch import shard_tensor
from weightwire.client.inputs.plan import pack_into, plan_buckets
from weightwire.client.push.pusher import WeightPusher
from weightwire.core.manifest import ParallelRank


class CpuBench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(args.log_dir) if args.log_dir else self.out
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log = common.Log(self.out / "bench_cpu.log")
        self.t_start = time.monotonic()
        self.results = common.Results(
            self.out / "cpu_results.json",
            common.environment({"bench": "cpu", "argv": common.public_argv(sys.argv[1:])}),
        )
        self.version = 0
        self.device = torch.device("cpu")

    def time_left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t_start)

    def record(self, rec: dict[str, Any], fn: Callable[[], dict[str, Any]], need_s: float) -> None:
        label = (
            f"{rec.get('model')} {rec.get('case')} {rec.get('variant', '')} workers={rec.get('workers', 1)}"
        )
        if self.time_left() < need_s:
            rec["skipped"] = f"time budget: {self.time_left():.0f} s left, needs about {need_s:.0f} s"
            self.log(f"SKIP {label}")
            self.results.add(rec)
            return
        t0 = time.monotonic()
        try:
            rec.update(fn())
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()[-6000:]
            self.log(f"ERROR {label}: {rec['error']}\n{rec['traceback']}")
        rec["case_wall_s"] = round(time.monotonic() - t0, 2)
        self.results.add(rec)
        if "updates" in rec:
            warm = rec["updates"][1:] or rec["updates"]
            self.log(
                f"done {label}: total {common.median([u['total_ms'] for u in warm]):.1f} ms "
                f"(cold {rec['updates'][0]['total_ms']:.1f}), verified={rec.get('verified')}"
            )
        elif "error" not in rec:
            self.log(
                f"done {label}: "
                + ", ".join(f"{k}={common.median(v):.1f}" for k, v in rec.items() if k.endswith("_ms"))
            )

    # --- workers ---------------------------------------------------------------------------

    def start_workers(self, preset: str, n: int, tp: bool) -> list[common.WorkerProc]:
        procs = []
        for i in range(n):
            rank = (
                ["--tp-rank", str(i), "--tp-size", str(n)]
                if tp
                else ["--dp-rank", str(i), "--dp-size", str(n)]
            )
            name = f"{preset}-{'tp' if tp else 'dp'}{i}of{n}"
            args = ["--mode", "weightwire", "--model", preset, "--device", "cpu", "--worker-id", name, *rank]
            if self.args.worker_threads:
                args += ["--threads", str(self.args.worker_threads)]
            procs.append(
                common.WorkerProc(
                    name, args, self.log_dir, common.child_env(threads=self.args.worker_threads)
                )
            )
        return procs

    # --- cases -----------------------------------------------------------------------------

    def limits(self, rig: Rig) -> dict[str, Any]:
        reps = self.args.limit_reps
        views = [rig.flat.narrow(0, s.offset_bytes, s.nbytes).view(s.dtype).view(s.shape) for s in rig.specs]
        scratch = [torch.empty_like(rig.flat)]
        out: dict[str, Any] = {"bytes": rig.model_bytes, "threads": torch.get_num_threads()}
        out["memcpy_flat_ms"] = common.time_reps(lambda: scratch[0].copy_(rig.flat), lambda: None, reps)
        scratch.clear()

        def per_tensor() -> None:
            for x, v in zip(rig.tensors, views, strict=True):
                x.copy_(v)

        out["memcpy_per_tensor_ms"] = common.time_reps(per_tensor, lambda: None, reps)
        owners = {s.name: ("w",) for s in rig.specs}
        plans = plan_buckets(rig.specs, owners, bucket_bytes=self.args.bucket)
        staging = torch.empty(max(p.size_bytes for p in plans), dtype=torch.uint8)

        def two_copies() -> None:
            for p in plans:
                pack_into(staging, p.specs, [rig.tensors[i] for i in p.items])
                for s, i in zip(p.specs, p.items, strict=True):
                    rig.tensors[i].copy_(
                        staging.narrow(0, s.offset_bytes, s.nbytes).view(s.dtype).view(s.shape)
                    )

        out["two_copies_ms"] = common.time_reps(two_copies, lambda: None, reps)
        rig.refill()
        return out

    def push_case(self, rig: Rig, workers: list[common.WorkerProc], kind: str, tp: bool) -> dict[str, Any]:
        addrs = [w.info["address"] for w in workers]
        rig.refill()
        for w in workers:
            w.call({"cmd": "release"})
        pusher = WeightPusher(
            addrs, transport="host_shm", bucket_size_bytes=self.args.bucket, timeout_s=self.args.rpc_timeout_s
        )
        updates: list[dict[str, Any]] = []
        try:
            pusher.manifests()
            if kind == "inplace":
                src = pusher.host_buffer(rig.size)
                src.copy_(rig.flat)
                buckets = flat_buckets(src, rig.specs, None)

                def push(v: int) -> Any:
                    return pusher.push_flat(buckets, version=v)
            else:
                named = rig.named

                def push(v: int) -> Any:
                    return pusher.push(named, version=v)

            hwm0 = [w.call({"cmd": "mem"})["hwm_kib"] for w in workers]
            t_case = time.monotonic()
            for i in range(self.args.reps + 1):
                self.version += 1
                reset_counters()
                t0 = now()
                results = push(self.version)
                t1 = now()
                updates.append(
                    {
                        "version": self.version,
                        "total_ms": ms(t1 - t0),
                        "stage_ms": ms(STAGE_NS[0]),
                        "recheck_ms": ms(RECHECK_NS[0]),
                        "plan_ms": ms(PLAN_NS[0]),
                        "bytes": sum(r.bytes_loaded for r in results.values()),
                        "handles_opened": sum(r.handles_opened for r in results.values()),
                        "buckets": max(r.buckets for r in results.values()),
                        "server_max_ms": max(r.server_duration_s for r in results.values()) * 1e3,
                    }
                )
                if i >= 1 and time.monotonic() - t_case > self.args.case_cap_s:
                    break
        finally:
            pusher.close()
        per_worker = [w.call({"cmd": "stats"})["updates"] for w in workers]
        for u in updates:
            recs = [next((r for r in stats if r["version"] == u["version"]), None) for stats in per_worker]
            recs = [r for r in recs if r is not None]
            if recs:
                u["open_ms"] = max(ms(r["open_ns"]) for r in recs)
                u["copy_ms"] = max(ms(r["copy_ns"]) for r in recs)
                u["copy_sum_ms"] = sum(ms(r["copy_ns"]) for r in recs)
                u["commit_ms"] = max(ms(r.get("commit_ns", 0)) for r in recs)
                u["bucket_ms"] = max(ms(r.get("bucket_ns", 0)) for r in recs)
                u["control_ms"] = u["total_ms"] - u["open_ms"] - u["copy_ms"] - u["commit_ms"] - u["stage_ms"]
        verified = all(
            w.call({"cmd": "digest"}, timeout_s=300)["digest"]
            == self.expected_digest(rig, i, len(workers), tp)
            for i, w in enumerate(workers)
        )
        hwm1 = [w.call({"cmd": "mem"})["hwm_kib"] for w in workers]
        return {
            "updates": updates,
            "verified": verified,
            "bytes_model": rig.model_bytes,
            "worker_hwm_growth_kib": max(b - a for a, b in zip(hwm0, hwm1, strict=True)),
        }

    def expected_digest(self, rig: Rig, rank: int, n: int, tp: bool) -> list[int]:
        if not tp:
            return rig.digest
        pr = ParallelRank(tp_rank=rank, tp_size=n)
        return models.digest(
            [
                shard_tensor(t.name, x, pr, models.TP_RULES)
                for t, x in zip(rig.shapes, rig.tensors, strict=True)
            ]
        )

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> int:
        instrument_trainer()
        a = self.args
        self.log(
            f"start: shm models {a.models}, scaling models {a.scaling_models} over {a.workers} workers, "
            f"budget {a.budget_s} s, {os.cpu_count()} CPUs"
        )
        # 1. host shared memory against memcpy, one worker per model size
        for preset in a.models:
            if self.time_left() < 15:
                self.log(f"SKIP {preset}: {self.time_left():.0f} s left")
                self.results.add({"model": preset, "case": "shm", "skipped": "time budget"})
                continue
            rig = make_rig(preset, self.device, peer=False)
            procs = self.start_workers(preset, 1, tp=False)
            with common.worker_group(procs):
                self.record(
                    {"model": preset, "case": "limit", "workers": 1}, lambda rig=rig: self.limits(rig), 5
                )
                for kind in ("inplace", "packed"):
                    self.record(
                        {"model": preset, "case": f"ww_{kind}", "workers": 1, "bench": "shm"},
                        lambda kind=kind, rig=rig, procs=procs: self.push_case(rig, procs, kind, tp=False),
                        10,
                    )
        # 2. scaling over replicated workers (DP), then TP-sharded
        for preset in a.scaling_models:
            nmax = max(a.workers)
            if self.time_left() < 30 + 3 * nmax:
                self.log(f"SKIP scaling {preset}: {self.time_left():.0f} s left")
                self.results.add({"model": preset, "case": "scaling", "skipped": "time budget"})
                continue
            rig = make_rig(preset, self.device, peer=False)
            procs = self.start_workers(preset, nmax, tp=False)
            with common.worker_group(procs):
                for n in a.workers:
                    for kind in ("inplace", "packed"):
                        self.record(
                            {
                                "model": preset,
                                "case": f"ww_{kind}",
                                "workers": n,
                                "bench": "scaling",
                                "layout": "dp",
                            },
                            lambda n=n, kind=kind, rig=rig, procs=procs: self.push_case(
                                rig, procs[:n], kind, tp=False
                            ),
                            10,
                        )
        if a.tp:
            preset = a.scaling_models[-1]
            rig = make_rig(preset, self.device, peer=False)
            for n in a.workers:
                if n == 1:
                    continue
                if self.time_left() < 20 + 3 * n:
                    self.log(f"SKIP tp{n}: {self.time_left():.0f} s left")
                    continue
                procs = self.start_workers(preset, n, tp=True)
                with common.worker_group(procs):
                    self.record(
                        {
                            "model": preset,
                            "case": "ww_inplace",
                            "workers": n,
                            "bench": "scaling",
                            "layout": "tp",
                        },
                        lambda n=n, procs=procs, rig=rig: self.push_case(rig, procs, "inplace", tp=True),
                        10,
                    )
        self.log(f"done in {time.monotonic() - self.t_start:.0f} s; results in cpu_results.json")
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="weightwire CPU benchmark (see the module docstring)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cpu-run"))
    p.add_argument("--models", default="cpu-s,cpu-m,cpu-l", help="model sizes for shm-vs-memcpy (one worker)")
    p.add_argument(
        "--scaling-models", default="cpu-s,cpu-m", help="model sizes for the worker scaling series"
    )
    p.add_argument("--workers", default="1,2,4,8,16")
    p.add_argument("--no-tp", dest="tp", action="store_false", help="skip the TP-sharded scaling series")
    p.add_argument("--quick", action="store_true", help="smaller: cpu-s/cpu-m, 1,4,16 workers, no TP, 2 reps")
    p.add_argument("--bucket", default="64MiB", help="bucket size of packed pushes")
    p.add_argument("--reps", type=int, default=3, help="warm updates per case (after one cold update)")
    p.add_argument("--limit-reps", type=int, default=5)
    p.add_argument(
        "--worker-threads", type=int, default=0, help="torch threads per worker (0: torch's default)"
    )
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--case-cap-s", type=float, default=20.0)
    p.add_argument("--log-dir", default="", help="where worker logs go (default: the results folder)")
    p.add_argument("--rpc-timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.scaling_models, args.workers, args.tp, args.reps = (
            "cpu-s,cpu-m",
            "cpu-s",
            "1,4,16",
            False,
            2,
        )
    args.models = [m for m in args.models.split(",") if m]
    args.scaling_models = [m for m in args.scaling_models.split(",") if m]
    args.workers = sorted({int(x) for x in args.workers.split(",") if x})
    args.bucket = parse_size(args.bucket)
    return CpuBench(args).run()


if __name__ == "__main__":
    sys.exit(main())
