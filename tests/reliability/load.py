"""Load: one trainer pushing FULL updates to N CPU worker processes, over and over, for a bounded
time, with every update verified; reports updates per second and the workers' memory growth.

Run as a script from the repository root::

    .venv/bin/python -m tests.reliability.load --workers 16 --seconds 30

``test_load.py`` runs it under pytest (a short run in CI, the 16-worker run marked ``slow``).

Every update is checked three ways: each worker's UpdateResult (version, every owned tensor loaded,
bytes), the worker's own CRC-32 check of every bucket (``verify_checksums``), and the bytes the
worker then holds, read back from the safetensors dump it writes after each commit and compared
bit for bit with the checkpoint of that version. Workers are demo engines of TP=2 x PP=2 (times
data-parallel replicas when N > 4), each a separate `weightwire serve` process on a private Unix
socket; the trainer is this process. Memory is read from /proc/<pid>/status (VmRSS after a warm-up
update and at the end; VmHWM, the peak).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import time

import torch
from weightwire.adapters.torch.demo import DemoConfig, expected_shard, full_checkpoint
from weightwire.client import WeightPusher
from weightwire.core.manifest import ParallelRank
from weightwire.v1 import weight_transfer_pb2 as pb

from . import helpers
from .common import proc_memory_kib, segments_of, serve_args

BUCKET_BYTES = 256 * 1024  # several buckets per update, so the staging pipeline is exercised


@dataclasses.dataclass
class LoadReport:
    workers: int
    layout: str
    seconds: float
    updates: int
    updates_per_s: float
    push_only_updates_per_s: float
    mean_push_ms: float
    max_push_ms: float
    bytes_per_update: int
    verified_dumps: int
    rss_start_kib: dict[str, int]
    rss_end_kib: dict[str, int]
    hwm_end_kib: dict[str, int]
    max_rss_growth_kib: int
    max_hwm_growth_kib: int
    trainer_rss_growth_kib: int
    segments_left: int

    def summary(self) -> str:
        return (
            f"{self.workers} workers ({self.layout}), {self.seconds:.1f} s: {self.updates} FULL updates, "
            f"{self.updates_per_s:.2f} updates/s with verification ({self.push_only_updates_per_s:.2f}/s push only; "
            f"mean {self.mean_push_ms:.1f} ms, max {self.max_push_ms:.1f} ms per push), "
            f"{self.bytes_per_update / 1e6:.2f} MB loaded per update over all workers, {self.verified_dumps} worker dumps "
            f"compared bit for bit; worker RSS growth max {self.max_rss_growth_kib / 1024:.1f} MiB, "
            f"peak (VmHWM) growth max {self.max_hwm_growth_kib / 1024:.1f} MiB; trainer RSS growth "
            f"{self.trainer_rss_growth_kib / 1024:.1f} MiB; segments left {self.segments_left}"
        )


def layout_for(n: int) -> list[ParallelRank]:
    """TP=2 x PP=2 engines, one per 4 workers (as data-parallel replicas); smaller counts shrink it."""
    if n % 4 == 0:
        tp, pp, dp = 2, 2, n // 4
    elif n % 2 == 0:
        tp, pp, dp = 2, 1, n // 2
    else:
        tp, pp, dp = 1, 1, n
    return [
        ParallelRank(tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, dp_rank=d, dp_size=dp)
        for d in range(dp)
        for p in range(pp)
        for t in range(tp)
    ]


def _rank_args(rank: ParallelRank) -> list[str]:
    return ["--dp-rank", str(rank.dp_rank), "--dp-size", str(rank.dp_size)] if rank.dp_size > 1 else []


def run_load(
    workers: int, seconds: float, *, bucket_bytes: int = BUCKET_BYTES, root: pathlib.Path | None = None
) -> LoadReport:
    """Start the workers, push for ``seconds``, verify every update, stop everything; raise
    AssertionError on the first wrong result, status or byte."""
    own_root = root is None
    root = pathlib.Path(tempfile.mkdtemp(prefix="weightwire-load-")) if root is None else root
    dump_dir = root / "dumps"
    config = DemoConfig()
    ranks = layout_for(workers)
    arg_lists = [
        serve_args(
            tp=(r.tp_rank, r.tp_size), pp=(r.pp_rank, r.pp_size), dump_dir=dump_dir, extra=_rank_args(r)
        )
        for r in ranks
    ]
    segments_before = segments_of([os.getpid()])
    procs = helpers.spawn_workers(arg_lists, timeout=300.0)
    try:
        addresses = [w.address for w in procs]
        pids = {w.address: w.proc.pid for w in procs}
        with WeightPusher(addresses, bucket_size_bytes=bucket_bytes, transport="host_shm") as pusher:
            manifests = pusher.manifests()
            n_owned = {a: len(m.tensors) for a, m in manifests.items()}
            bytes_owned = {a: m.total_bytes for a, m in manifests.items()}

            def push_and_verify(version: int) -> tuple[float, int]:
                full = full_checkpoint(config, seed=version)
                t0 = time.perf_counter()
                results = pusher.push(
                    full, version=version, verify_checksums=True, update_id=f"load-{version}"
                )
                push_s = time.perf_counter() - t0
                assert sorted(results) == sorted(addresses), results.keys()
                for a, r in results.items():
                    if (r.version, r.tensors_loaded, r.bytes_loaded) != (version, n_owned[a], bytes_owned[a]):
                        raise AssertionError(f"{a}: result {r} for version {version}")
                checked = 0
                for m in manifests.values():
                    path = dump_dir / f"{m.worker_id}-v{version}.safetensors"
                    held = helpers.load_dump(dump_dir, m.worker_id, version)
                    want = expected_shard(full, m.rank, config)
                    if sorted(held) != sorted(want) or not all(
                        torch.equal(held[k], v) for k, v in want.items()
                    ):
                        raise AssertionError(f"{m.worker_id} does not hold the weights of version {version}")
                    path.unlink()
                    checked += 1
                return push_s, checked

            version = 1
            push_and_verify(version)  # warm-up: connections, staging segments, first mappings
            rss_start = {a: proc_memory_kib(pids[a])["VmRSS"] for a in addresses}
            hwm_start = {a: proc_memory_kib(pids[a])["VmHWM"] for a in addresses}
            trainer_start = proc_memory_kib(os.getpid())["VmRSS"]
            push_times: list[float] = []
            verified = 0
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                version += 1
                push_s, checked = push_and_verify(version)
                push_times.append(push_s)
                verified += checked
            elapsed = time.perf_counter() - start
            trainer_end = proc_memory_kib(os.getpid())["VmRSS"]
            statuses = pusher.status()
        for a, st in statuses.items():
            if (st.weights_version, st.state, st.open_mappings) != (version, pb.WORKER_STATE_CONSISTENT, 0):
                raise AssertionError(f"{a}: status after the run: {st}")
        mem_end = {a: proc_memory_kib(pids[a]) for a in addresses}
    finally:
        for w in procs:  # signal all first: they shut down in parallel
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in procs:
            w.stop()
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    segments_left = len(segments_of([os.getpid()]) - segments_before)
    rss_end = {a: m["VmRSS"] for a, m in mem_end.items()}
    hwm_end = {a: m["VmHWM"] for a, m in mem_end.items()}
    shape = ranks[0]
    return LoadReport(
        workers=workers,
        layout=f"TP={shape.tp_size} x PP={shape.pp_size} x DP={shape.dp_size}",
        seconds=elapsed,
        updates=len(push_times),
        updates_per_s=len(push_times) / elapsed if elapsed else 0.0,
        push_only_updates_per_s=len(push_times) / sum(push_times) if push_times else 0.0,
        mean_push_ms=1e3 * sum(push_times) / len(push_times) if push_times else 0.0,
        max_push_ms=1e3 * max(push_times, default=0.0),
        bytes_per_update=sum(bytes_owned.values()),
        verified_dumps=verified,
        rss_start_kib=rss_start,
        rss_end_kib=rss_end,
        hwm_end_kib=hwm_end,
        max_rss_growth_kib=max(rss_end[a] - rss_start[a] for a in rss_start),
        max_hwm_growth_kib=max(hwm_end[a] - hwm_start[a] for a in hwm_start),
        trainer_rss_growth_kib=trainer_end - trainer_start,
        segments_left=segments_left,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.reliability.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES)
    p.add_argument("--json", type=pathlib.Path, default=None, help="also write the report as JSON here")
    args = p.parse_args(argv)
    if args.workers < 1 or args.seconds <= 0:
        p.error("--workers must be >= 1 and --seconds > 0")
    report = run_load(args.workers, args.seconds, bucket_bytes=args.bucket_bytes)
    print(report.summary())
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=2))
    return 0 if report.segments_left == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
