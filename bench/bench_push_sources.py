"""The user's call with every trainer rank a source, end to end: ``pusher.push(fsdp_model.state_dict())``
from M FSDP2 ranks over a transfer group, against bare torch.distributed moving the same bytes
between the same processes, same run (issue 27).

    .venv/bin/python bench/bench_push_sources.py [--model cpu-m] [--sources 1,2,4] [--engine 2,1] [--reps 5]
        [--bucket-mib N] [--out DIR]

Processes: ``tp x dp`` workers (this script with ``--role worker``: ``weightwire.server.serve`` over a
``TorchAdapter`` holding its TP slice of the bench model, ``bench/models.py``) and, per source count
M, M trainer ranks (``--role trainer``: a gloo world of their own, the bench model sharded with
FSDP2 ``fully_shard``, one ``WeightPusher(transfer_group=...)`` each). Per repetition, between
barriers of the trainer ranks:

``push``  the whole update as a training loop calls it: planning, the ranks' agreement, the gRPC
          header, bucket, acks and commit, every rank sending its slices, every worker receiving
          into its parameters (M = 1: the single-process push over the group, whole tensors by
          broadcast to the TP ranks, the path before every rank was a source).
``bare``  the bytes the plan moves between each trainer rank and each worker, as one message per
          pair over a bare ``ProcessGroupGloo`` of the same processes, received into buffers made
          beforehand: no gRPC, no planning, no placing into tensors, no acks.

``--bucket-mib``: the pushers' bucket size (their default, 64 MiB, unless given), which splits each
worker's part of the update into buckets; each case records the buckets each worker acked.

Ratio = bare / push (>= 0.9 is the target for M >= 2). Results go to ``DIR/push_sources.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models

HOST = "127.0.0.1"
_QUIET = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
_DONE_TAG = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _bare_group(port: int, rank: int, world: int, *, serve: bool) -> Any:
    store = torch.distributed.TCPStore(HOST, port, None, serve, datetime.timedelta(seconds=60))
    opts = torch.distributed.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=120)
    opts._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=HOST, lazy_init=False)]
    return store, torch.distributed.ProcessGroupGloo(
        torch.distributed.PrefixStore("bare", store), rank, world, opts
    )


# --------------------------------------------------------------------------------------------
# A worker: a real weightwire worker that also takes part in the bare transfers
# --------------------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace) -> int:
    from weightwire.adapters.torch import TorchAdapter
    from weightwire.core.devices import DeviceRef
    from weightwire.core.manifest import ParallelRank
    from weightwire.server import serve

    torch.set_num_threads(1)
    rank = ParallelRank(
        tp_rank=args.tp_rank, tp_size=args.tp_size, dp_rank=args.dp_rank, dp_size=args.dp_size
    )
    module = models.build_module(
        models.tensor_shapes(args.model), torch.device("cpu"), tp_rank=args.tp_rank, tp_size=args.tp_size
    )
    adapter = TorchAdapter(
        module, rank=rank, device=torch.device("cpu"), own_device=DeviceRef.host(), tp_rules=models.TP_RULES
    )
    server = serve(adapter, own_device=DeviceRef.host(), group_host=HOST)
    print(json.dumps({"ready": server.address}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        # bare: receive from every source its bytes (one message each, posted together), reps times
        _, pg = _bare_group(cmd["port"], cmd["rank"], cmd["world"], serve=False)
        sizes = cmd["sizes"]
        buffers = [torch.empty(max(n, 1), dtype=torch.uint8) for n in sizes]
        for _ in range(cmd["reps"] + 1):
            works = [pg.recv([buffers[s][:n]], s, 0) for s, n in enumerate(sizes) if n]
            for w in works:
                w.wait()
            pg.send([torch.ones(1, dtype=torch.uint8)], 0, _DONE_TAG).wait()
        print(json.dumps({"ok": True}), flush=True)
    server.stop(0)
    return 0


# --------------------------------------------------------------------------------------------
# A trainer rank
# --------------------------------------------------------------------------------------------


def run_trainer(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from weightwire.client import TransferGroupOptions, WeightPusher
    from weightwire.client.ranks.rank_holdings import holdings_of
    from weightwire.core.transports.transfer_plan import plan_transfers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    me, world = dist.get_rank(), dist.get_world_size()
    shapes = models.tensor_shapes(args.model)
    module = models.build_module(shapes, torch.device("cpu"))
    for t, x in zip(shapes, models.random_tensors(shapes, torch.device("cpu"), seed=1), strict=True):
        module.get_parameter(t.name).data.copy_(x)
    if world > 1:
        fully_shard(module)
    workers = args.workers.split(",")
    pusher = WeightPusher(
        workers,
        transfer_group=TransferGroupOptions(host=HOST),
        timeout_s=300,
        bucket_size_bytes=args.bucket_mib << 20 if args.bucket_mib else None,
    )
    state = module.state_dict()
    times = []
    for rep in range(args.reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        results = pusher.push(state, version=args.version_base + rep)
        dist.barrier()
        if rep:
            times.append(time.perf_counter() - t0)
    received = {a: r.bytes_received for a, r in results.items()}
    buckets = {a: r.buckets for a, r in results.items()}
    # The bytes the update moved between each trainer rank and each worker, from the same planner.
    manifests = pusher.manifests()
    if world > 1:
        held = holdings_of(list(state.items()), dist.group.WORLD)
        plan = plan_transfers(held, manifests)
        pairs = {a: [0] * world for a in workers}
        for t in plan.transfers:
            for d in t.destinations:
                pairs[d][t.source] += t.nbytes
    else:
        pairs = {a: [received[a]] for a in workers}
    pusher.close()
    if me == 0:
        print(
            json.dumps({"push_s": times, "received": received, "pairs": pairs, "buckets": buckets}),
            flush=True,
        )
    # bare: the same pair bytes between the same processes
    line = sys.stdin.readline()
    cmd = json.loads(line)
    store, pg = _bare_group(cmd["port"], me, world + len(workers), serve=me == 0)
    # Written buffers: a never-written one (``torch.empty``) reads the kernel's one zero page, always
    # in cache, where the push reads the model's bytes from memory.
    sources = [
        (world + i, torch.full((max(pairs[a][me], 1),), 0x5A, dtype=torch.uint8), pairs[a][me])
        for i, a in enumerate(workers)
    ]
    bare = []
    done = torch.empty(1, dtype=torch.uint8)
    for rep in range(args.reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        works = [pg.send([buf[:n]], dst, 0) for dst, buf, n in sources if n]
        for w in works:
            w.wait()
        if me == 0:
            for i in range(len(workers)):
                pg.recv([done], world + i, _DONE_TAG).wait()
        dist.barrier()
        if rep:
            bare.append(time.perf_counter() - t0)
    if me == 0:
        print(json.dumps({"bare_s": bare}), flush=True)
    del store
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _answer(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"process {proc.args} ended early")
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]


def _send(proc: subprocess.Popen[str], cmd: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()


def run(args: argparse.Namespace) -> dict[str, Any]:
    me = os.path.abspath(__file__)
    tp, dp = (int(x) for x in args.engine.split(","))
    workers = []
    for d in range(dp):
        for t in range(tp):
            cmd = [sys.executable, me, "--role", "worker", "--model", args.model]
            cmd += ["--tp-rank", str(t), "--tp-size", str(tp), "--dp-rank", str(d), "--dp-size", str(dp)]
            workers.append(
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env={**os.environ, **_QUIET},
                )
            )
    addresses = [_answer(w)["ready"] for w in workers]
    cases = []
    try:
        for m in [int(x) for x in args.sources.split(",")]:
            master = _free_port()
            ranks = [
                subprocess.Popen(
                    [
                        sys.executable,
                        me,
                        "--role",
                        "trainer",
                        "--model",
                        args.model,
                        "--reps",
                        str(args.reps),
                        "--workers",
                        ",".join(addresses),
                        "--version-base",
                        str(1 + len(cases) * (args.reps + 1)),
                        "--bucket-mib",
                        str(args.bucket_mib),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env={
                        **os.environ,
                        **_QUIET,
                        "RANK": str(r),
                        "WORLD_SIZE": str(m),
                        "MASTER_ADDR": HOST,
                        "MASTER_PORT": str(master),
                    },
                )
                for r in range(m)
            ]
            pushed = _answer(ranks[0])
            port = _free_port()
            for r in ranks:
                _send(r, {"port": port})
            for i, w in enumerate(workers):
                sizes = pushed["pairs"][addresses[i]]
                _send(
                    w,
                    {
                        "port": port,
                        "rank": m + i,
                        "world": m + len(workers),
                        "sizes": sizes,
                        "reps": args.reps,
                    },
                )
            bare = _answer(ranks[0])
            for w in workers:
                _answer(w)
            for r in ranks:
                r.wait(timeout=120)
            push_ms = statistics.median(pushed["push_s"]) * 1e3
            bare_ms = statistics.median(bare["bare_s"]) * 1e3
            moved = sum(pushed["received"].values())
            case = {
                "sources": m,
                "push_ms": round(push_ms, 2),
                "bare_ms": round(bare_ms, 2),
                "ratio": round(bare_ms / push_ms, 3),
                "bytes_moved": moved,
                "buckets_per_worker": [pushed["buckets"][a] for a in addresses],
                "push_all_ms": [round(x * 1e3, 2) for x in pushed["push_s"]],
                "bare_all_ms": [round(x * 1e3, 2) for x in bare["bare_s"]],
            }
            cases.append(case)
            print(
                f"M={m}: push {push_ms:8.1f} ms  bare {bare_ms:8.1f} ms  ratio {case['ratio']:.2f}  "
                f"({moved / 2**20:.1f} MiB into {len(workers)} workers, buckets per worker "
                f"{case['buckets_per_worker']})",
                flush=True,
            )
    finally:
        for w in workers:
            if w.poll() is None:
                _send(w, {"op": "quit"})
        for w in workers:
            w.wait(timeout=60)
    return {
        "model": args.model,
        "model_bytes": models.model_bytes(args.model),
        "engine": {"tp": tp, "dp": dp},
        "reps": args.reps,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "command": "bench/bench_push_sources.py " + " ".join(sys.argv[1:]),
        "cases": cases,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["run", "worker", "trainer"], default="run")
    ap.add_argument("--model", default="cpu-m")
    ap.add_argument("--sources", default="1,2,4")
    ap.add_argument("--engine", default="2,1", help="tp,dp of the engine")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--workers", default="")
    ap.add_argument("--version-base", type=int, default=1)
    ap.add_argument("--bucket-mib", type=int, default=0, help="the pushers' bucket size (0: their default)")
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--dp-size", type=int, default=1)
    args = ap.parse_args()
    if args.role == "worker":
        return run_worker(args)
    if args.role == "trainer":
        return run_trainer(args)
    out = run(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "push_sources.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
