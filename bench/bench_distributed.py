"""A model's push over a transfer group (gloo) against bare torch.distributed between the same
processes, and scaling over 1..N workers.

    .venv/bin/python bench/bench_distributed.py [--model cpu-m] [--workers 1,2,4,8] [--reps 3] [--out DIR]

For each worker count N: N worker processes (this script with ``--role worker``), each a real
weightwire worker (``weightwire.server.serve`` over a ``TorchAdapter`` holding the model; N
data-parallel replicas of TP1, so every worker owns every tensor) that also joins a bare
``ProcessGroupGloo`` of its own. This process is the trainer and measures, per case, the wall time
of moving the model into every worker:

``ww_broadcast``    ``WeightPusher.push`` over a transfer group, one broadcast per bucket (default)
``ww_p2p``          the same with ``broadcast=False``: point-to-point sends to each worker
``limit_broadcast`` bare ``broadcast`` of the same buckets (same sizes, already flat) on the bare group
``limit_p2p``       bare ``send``/``recv`` of the same buckets to each worker

The limits move the same bytes between the same processes with nothing else: no gRPC, no packing
of tensors into buckets, no copy into the model, no acks. The ratio ``limit time / weightwire time``
is the share of the limit's throughput weightwire reaches (goal >= 0.9). Results go to
``DIR/distributed_results.json`` and a table on stdout. CPU only; NCCL runs are a later issue.

Every trainer rank a source (issue 27):

    .venv/bin/python bench/bench_distributed.py --sources 1,2,4 [--slice-engine 2,2] [--reps 7] [--predict] [--out DIR]

For each source count M: M trainer processes holding FSDP2 ``Shard(0)`` shards of the model and the
workers of a TP x DP engine (``--slice-engine tp,dp``; TorchAdapter parameters, the bench model's
TP rules) in one gloo group; per repetition, between two barriers, ``plan``: the transfer plan
carried out (``core.transports.transfer_group_slices``: each source packs its regions per
destination, each worker receives exactly its slices into its parameters), against ``bare``: the
same messages (sizes and order: ``send_sequence``) between the same processes, packed once
beforehand with the bytes they carry, received and not unpacked. M = 1 is the single-source plan.
Ratio = bare / plan (goal >= 0.9). Results go to ``DIR/slices_results.json``.

With ``--predict`` each group also measures its loopback as one port (trainer rank 0 to the first
worker: one message of ``--bucket-mb``, then a stream of small ones), describes the run as a fleet
(every process a node with one NIC of that rate and per-message cost) in
``DIR/topology-M-sources.json`` (``weightwire plan`` reads it) and adds the planner's prediction
(``core.transports.transfer_plan_fleet``) to each row, next to what was measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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


# --------------------------------------------------------------------------------------------
# The worker process
# --------------------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace) -> int:
    from weightwire.adapters.torch import TorchAdapter
    from weightwire.core.devices import DeviceRef
    from weightwire.core.manifest import ParallelRank
    from weightwire.server import serve

    torch.set_num_threads(1)
    shapes = models.tensor_shapes(args.model)
    rank = ParallelRank(dp_rank=args.dp_rank, dp_size=args.dp_size)
    module = models.build_module(shapes, torch.device("cpu"))
    adapter = TorchAdapter(
        module, rank=rank, device=torch.device("cpu"), own_device=DeviceRef.host(), tp_rules=models.TP_RULES
    )
    server = serve(adapter, own_device=DeviceRef.host(), group_host=HOST)
    bare: Any = None
    print(json.dumps({"ready": server.address}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict[str, Any] = {"ok": True}
        if op == "bare_join":
            store = torch.distributed.TCPStore(HOST, cmd["port"], None, False, datetime.timedelta(seconds=60))
            opts = torch.distributed.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = datetime.timedelta(seconds=120)
            opts._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=HOST, lazy_init=False)]
            bare = torch.distributed.ProcessGroupGloo(
                torch.distributed.PrefixStore(cmd["prefix"], store), cmd["rank"], cmd["world"], opts
            )
        elif op == "bare_receive":
            # Receive every bucket in order into two alternating buffers (as weightwire's worker
            # stages), then tell the trainer with a one-byte send.
            sizes = cmd["sizes"]
            buffers = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(2)]
            for i, n in enumerate(sizes):
                view = buffers[i % 2][:n]
                if cmd["mode"] == "p2p":
                    bare.recv([view], 0, i).wait()
                else:
                    opts = torch.distributed.BroadcastOptions()
                    opts.rootRank = 0
                    bare.broadcast([view], opts).wait()
            bare.send([torch.ones(1, dtype=torch.uint8)], 0, 1 << 20).wait()
        elif op == "stats":
            with open("/proc/self/status") as f:
                out["rss_kib"] = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
            out["status"] = str(server.service.get_status().transfer_group).replace("\n", " ")
        elif op == "quit":
            print(json.dumps(out), flush=True)
            break
        print(json.dumps(out), flush=True)
    server.stop(0)
    return 0


class WorkerProc:
    def __init__(self, model: str, dp_rank: int, dp_size: int) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--role",
                "worker",
                "--model",
                model,
                "--dp-rank",
                str(dp_rank),
                "--dp-size",
                str(dp_size),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **_QUIET},
        )
        self.address = self.answer()["ready"]

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench worker exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        try:
            self.send(op="quit")
            self.proc.wait(30)
        except Exception:
            self.proc.kill()


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------


class BareGroup:
    """The limit: a plain ProcessGroupGloo of this process (rank 0) and the workers."""

    def __init__(self, workers: list[WorkerProc], tag: str) -> None:
        from weightwire.core.transports.transfer_group_store import StoreServer

        self.workers = workers
        self.server = StoreServer(HOST, 0, timeout_s=60)
        for i, w in enumerate(workers, start=1):
            w.send(op="bare_join", port=self.server.port, prefix=tag, rank=i, world=len(workers) + 1)
        opts = torch.distributed.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = datetime.timedelta(seconds=120)
        opts._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=HOST, lazy_init=False)]
        self.pg = torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore(tag, self.server.store), 0, len(workers) + 1, opts
        )
        for w in workers:
            w.answer()

    def move(self, buckets: list[torch.Tensor], mode: str) -> float:
        """Wall time of moving every bucket to every worker, until each confirmed."""
        sizes = [b.numel() for b in buckets]
        for w in self.workers:
            w.send(op="bare_receive", sizes=sizes, mode=mode)
        t0 = time.perf_counter()
        works = []
        for i, b in enumerate(buckets):
            if mode == "p2p":
                works += [self.pg.send([b], r, i) for r in range(1, len(self.workers) + 1)]
            else:
                opts = torch.distributed.BroadcastOptions()
                opts.rootRank = 0
                works.append(self.pg.broadcast([b], opts))
        for w in works:
            w.wait()
        done = [torch.zeros(1, dtype=torch.uint8) for _ in self.workers]
        for r, d in enumerate(done, start=1):
            self.pg.recv([d], r, 1 << 20).wait()
        elapsed = time.perf_counter() - t0
        for w in self.workers:
            w.answer()
        return elapsed


def bucket_buffers(tensors: list[torch.Tensor], names: list[str], bucket_bytes: int) -> list[torch.Tensor]:
    """The same buckets the pusher plans (same sizes), packed once, for the limits."""
    from weightwire.client.inputs import plan as planning

    specs = [planning.TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in zip(names, tensors, strict=True)]
    owners = {n: ("w",) for n in names}
    plans = planning.plan_buckets(specs, owners, bucket_bytes=bucket_bytes)
    out = []
    for p in plans:
        buf = torch.empty(p.size_bytes, dtype=torch.uint8)
        planning.pack_into(buf, p.specs, [tensors[i] for i in p.items])
        out.append(buf)
    return out


def run_trainer(args: argparse.Namespace) -> int:
    from weightwire.client import WeightPusher
    from weightwire.client.transports.transfer_group import TransferGroupOptions

    shapes = models.tensor_shapes(args.model)
    names = [t.name for t in shapes]
    tensors = models.random_tensors(shapes, torch.device("cpu"), seed=1)
    total = models.model_bytes(args.model)
    buckets = bucket_buffers(tensors, names, args.bucket_mb << 20)
    counts = [int(x) for x in args.workers.split(",")]
    rows: list[dict[str, Any]] = []
    version = 0
    for n in counts:
        workers = [WorkerProc(args.model, i, n) for i in range(n)]
        try:
            bare = BareGroup(workers, f"bare-{n}")
            pushers = {
                mode: WeightPusher(
                    [w.address for w in workers],
                    timeout_s=120,
                    bucket_size_bytes=args.bucket_mb << 20,
                    transfer_group=TransferGroupOptions(host=HOST, broadcast=(mode == "broadcast")),
                )
                for mode in ("broadcast", "p2p")
            }
            times: dict[str, list[float]] = {
                k: [] for k in ("ww_broadcast", "ww_p2p", "limit_broadcast", "limit_p2p")
            }
            # Warm-up (forms each group, allocates staging), then interleaved repetitions.
            for mode, pusher in pushers.items():
                version += 1
                pusher.push(list(zip(names, tensors, strict=True)), version=version)
                bare.move(buckets, mode)
            for rep in range(args.reps):
                models.refill(tensors, seed=100 + rep)
                for mode, pusher in pushers.items():
                    version += 1
                    t0 = time.perf_counter()
                    results = pusher.push(list(zip(names, tensors, strict=True)), version=version)
                    times[f"ww_{mode}"].append(time.perf_counter() - t0)
                    assert all(r.bytes_received == total for r in results.values()), (
                        "every worker receives the whole model"
                    )
                    times[f"limit_{mode}"].append(bare.move(buckets, mode))
            stats = []
            for w in workers:
                w.send(op="stats")
                stats.append(w.answer())
            for p in pushers.values():
                p.close()
        finally:
            for w in workers:
                w.stop()
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {
            "workers": n,
            "model_bytes": total,
            "bytes_moved": total * n,
            **{f"{k}_s": round(v, 4) for k, v in med.items()},
            **{f"{k}_all_s": [round(x, 4) for x in v] for k, v in times.items()},
            "ratio_broadcast": round(med["limit_broadcast"] / med["ww_broadcast"], 3),
            "ratio_p2p": round(med["limit_p2p"] / med["ww_p2p"], 3),
            "worker_rss_mib": [round(s["rss_kib"] / 1024) for s in stats],
            "worker_group_status": stats[0]["status"],
        }
        rows.append(row)
        print(
            f"{n} worker(s): weightwire broadcast {med['ww_broadcast']:.3f} s vs bare broadcast {med['limit_broadcast']:.3f} s "
            f"(ratio {row['ratio_broadcast']}); p2p {med['ww_p2p']:.3f} s vs bare send/recv {med['limit_p2p']:.3f} s "
            f"(ratio {row['ratio_p2p']}); {total * n / med['ww_broadcast'] / 2**30:.2f} GiB/s delivered by broadcast",
            flush=True,
        )
    out = {
        "model": args.model,
        "model_bytes": total,
        "tensors": len(shapes),
        "bucket_mb": args.bucket_mb,
        "reps": args.reps,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "distributed_results.json"), "w") as f:
            json.dump(out, f, indent=2)
    return 0


# --------------------------------------------------------------------------------------------
# Every trainer rank a source
# --------------------------------------------------------------------------------------------


def run_slice_member(args: argparse.Namespace) -> int:
    from weightwire.adapters.torch import TorchAdapter
    from weightwire.core import dtypes
    from weightwire.core.devices import DeviceRef
    from weightwire.core.manifest import ParallelRank
    from weightwire.core.transports.transfer_group_slices import (
        GroupRanks,
        messages,
        receive_slices,
        send_sequence,
        send_slices,
    )
    from weightwire.core.transports.transfer_plan import Shard, TensorSpec, plan_transfers

    torch.set_num_threads(1)
    sources = int(args.sources)
    tp, dp = (int(x) for x in args.slice_engine.split(","))
    shapes = models.tensor_shapes(args.model)
    ranks_of = {}
    manifests = {}
    for d in range(dp):
        for t in range(tp):
            rank = ParallelRank(tp_rank=t, tp_size=tp, dp_rank=d, dp_size=dp)
            # The manifest only: parameters on the meta device take no memory.
            meta = TorchAdapter(
                models.build_module(shapes, torch.device("meta"), tp_rank=t, tp_size=tp),
                rank=rank,
                device=torch.device("meta"),
                own_device=DeviceRef.host(),
                tp_rules=models.TP_RULES,
            )
            manifests[meta.worker_id] = meta.manifest()
            ranks_of[meta.worker_id] = rank
    specs = [
        TensorSpec.dtensor(t.name, tuple(t.shape), dtypes.from_torch(t.dtype), (sources,), [Shard(0)])
        for t in shapes
    ]
    plan = plan_transfers(specs, manifests)
    group = GroupRanks.of_plan(sources, list(manifests))
    limit = args.bucket_mb << 20

    store = torch.distributed.TCPStore(HOST, args.store_port, None, False, datetime.timedelta(seconds=60))
    opts = torch.distributed.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=300)
    opts._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=HOST, lazy_init=False)]
    pg = torch.distributed.ProcessGroupGloo(
        torch.distributed.PrefixStore(args.group, store), args.rank, group.world_size, opts
    )
    flag = torch.zeros(1)
    staging: dict[Any, torch.Tensor] = {}

    def barrier() -> None:
        pg.allreduce([flag]).wait()

    if args.rank < sources:
        tensors = models.random_tensors(shapes, torch.device("cpu"), seed=1)
        local = {
            s.name: t[tuple(slice(a, b) for a, b in s.holdings[args.rank])].clone()
            for s, t in zip(specs, tensors, strict=True)
            if args.rank in s.holdings
        }
        holdings = {s.name: s.holdings[args.rank] for s in specs if args.rank in s.holdings}
        del tensors
        # The same messages in the same order, each packed once beforehand with the bytes it
        # carries (a buffer never written reads the kernel's one zero page, always in cache, which
        # no real send does); the same message to several workers is one buffer, as in the plan.
        packed: dict[tuple[Any, ...], torch.Tensor] = {}
        bare = [
            (group.of_worker(w), packed.setdefault(tuple(m), pack_message(m, local, holdings)))
            for w, _, _, m in send_sequence(plan, group, args.rank, limit)
        ]

        def plan_step() -> int:
            return send_slices(
                pg,
                plan,
                group,
                args.rank,
                local,
                holdings,
                timeout_s=300,
                max_message_bytes=limit,
                staging=staging,
            )

        def bare_step() -> int:
            works = [pg.send([b], dst, 0) for dst, b in bare]
            for w in works:
                w.wait()
            return sum(b.numel() for _, b in bare)
    else:
        worker = group.workers[args.rank - sources]
        me = ranks_of[worker]
        module = models.build_module(shapes, torch.device("cpu"), tp_rank=me.tp_rank, tp_size=me.tp_size)
        adapter = TorchAdapter(
            module, rank=me, device=torch.device("cpu"), own_device=DeviceRef.host(), tp_rules=models.TP_RULES
        )
        params = adapter.state()
        owned = manifests[worker].tensors
        bare = [
            (src, torch.empty(sum(t.nbytes for t in m), dtype=torch.uint8))
            for src in range(sources)
            for m in messages(plan, src, worker, limit)
        ]

        def plan_step() -> int:
            with torch.no_grad():
                got = receive_slices(
                    pg,
                    plan,
                    group,
                    worker,
                    params,
                    owned,
                    timeout_s=300,
                    max_message_bytes=limit,
                    staging=staging,
                )
            assert got == manifests[worker].kept_bytes
            return got

        def bare_step() -> int:
            works = [pg.recv([b], src, 0) for src, b in bare]
            for w in works:
                w.wait()
            return sum(b.numel() for _, b in bare)

    times: dict[str, list[float]] = {"plan": [], "bare": []}
    moved = 0
    for rep in range(args.reps + 1):  # the first round warms both up
        for name, step in (("plan", plan_step), ("bare", bare_step)):
            barrier()
            t0 = time.perf_counter()
            moved = step()
            barrier()
            if rep:
                times[name].append(time.perf_counter() - t0)
    result: dict[str, Any] = {"rank": args.rank, "times": times, "bytes": moved}
    if args.probe:
        result["probe"] = probe_loopback(pg, barrier, args.rank, sources, limit)
    print(json.dumps(result), flush=True)
    return 0


def probe_loopback(pg: Any, barrier: Any, rank: int, sender_to: int, nbytes: int) -> dict[str, float]:
    """The loopback as one port, in the same group and run: trainer rank 0 sends group rank
    ``sender_to`` (the first worker) one message of ``nbytes`` (real bytes), then a stream of small
    ones, while every other member waits at a barrier. The receiver's medians: bytes per second of
    the big message, microseconds per small message (all posted, then waited)."""
    big = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    small = [torch.ones(4, dtype=torch.uint8) for _ in range(256)]
    seconds: dict[str, list[float]] = {"big": [], "small": []}
    for rep in range(4):
        for kind in ("big", "small"):
            bufs = [big] if kind == "big" else small
            barrier()
            t0 = time.perf_counter()
            if rank == 0:
                works = [pg.send([b], sender_to, 0) for b in bufs]
            elif rank == sender_to:
                works = [pg.recv([b], 0, 0) for b in bufs]
            else:
                works = []
            for w in works:
                w.wait()
            if rep:
                seconds[kind].append(time.perf_counter() - t0)
            barrier()
    return {
        "bytes_per_s": nbytes / statistics.median(seconds["big"]),
        "message_us": statistics.median(seconds["small"]) / len(small) * 1e6,
    }


def model_config(preset: str) -> dict[str, Any]:
    """The bench model as a Hugging Face config (what ``weightwire plan`` reads)."""
    s = models.PRESETS[preset]
    return {
        "model_type": "qwen3" if s.qk_norm else "qwen2",
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab,
        "tie_word_embeddings": s.tied_embeddings,
        "attention_bias": s.qkv_bias,
    }


def predict_run(args: argparse.Namespace, sources: int, probe: dict[str, float]) -> dict[str, Any]:
    """This run as a fleet description (every process a node of one NIC at the loopback's
    measured rate and per-message cost) and the planner's prediction for it
    (``core.transports.transfer_plan_fleet``, what ``weightwire plan`` runs)."""
    from weightwire.core.model_shapes import model_shapes
    from weightwire.core.transports.transfer_plan_fleet import fleet_from, plan_fleet, predict

    tp, dp = (int(x) for x in args.slice_engine.split(","))
    description = {
        "name": f"bench_distributed --sources {sources}: {sources} -> TP{tp} x DP{dp} on loopback gloo",
        "measured": "network: this run's loopback probe (one big message, a stream of small ones)",
        "model": model_config(args.model),
        "trainer": {"gpus": sources, "gpus_per_node": 1, "layout": "fsdp"},
        "engine": {"tp": tp, "pp": 1, "dp": dp, "ep": 1, "gpus_per_node": 1, "dtype": "bf16"},
        "network": {
            "nic_gbit_per_s": round(probe["bytes_per_s"] * 8 / 1e9, 3),
            "nics_per_node": 1,
            "nvlink_gbyte_per_s": 450,
            "message_latency_us": round(probe["message_us"], 1),
            "bucket_mib": args.bucket_mb,
        },
    }
    fleet = fleet_from(description, model_shapes(description["model"]))
    pred = predict(plan_fleet(fleet))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"topology-{sources}-sources.json"), "w") as f:
            json.dump(description, f, indent=1)
    return {
        "predicted_s": round(pred.seconds, 4),
        "bottleneck": str(pred.bottleneck),
        "bottleneck_bytes": pred.port_bytes.get(pred.bottleneck, 0),
        "bottleneck_messages": pred.port_messages.get(pred.bottleneck, 0),
        "total_bytes": pred.total_bytes,
        "network": description["network"],
    }


def pack_message(
    message: list[Any], local: dict[str, torch.Tensor], holdings: dict[str, Any]
) -> torch.Tensor:
    """One message of the plan as one flat buffer: its regions' bytes back to back, in order."""
    parts = []
    for t in message:
        region = local[t.tensor][
            tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(t.box, holdings[t.tensor], strict=True))
        ]
        parts.append(region.contiguous().view(-1).view(torch.uint8))
    return torch.cat(parts)


def run_sources(args: argparse.Namespace) -> int:
    import uuid

    tp, dp = (int(x) for x in args.slice_engine.split(","))
    rows = []
    for m in (int(x) for x in args.sources.split(",")):
        store = torch.distributed.TCPStore(
            HOST, 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
        )
        group = uuid.uuid4().hex
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--role",
                    "slice-member",
                    "--model",
                    args.model,
                    "--store-port",
                    str(store.port),
                    "--group",
                    group,
                    "--sources",
                    str(m),
                    "--slice-engine",
                    args.slice_engine,
                    "--rank",
                    str(r),
                    "--reps",
                    str(args.reps),
                    "--bucket-mb",
                    str(args.bucket_mb),
                    *(["--probe"] if args.predict else []),
                ],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, **_QUIET},
            )
            for r in range(m + tp * dp)
        ]
        outs = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a member failed with {m} sources")
        # The update ends when its last member ends: per repetition, the slowest member's time.
        per_rep = {
            k: [max(o["times"][k][i] for o in outs) for i in range(args.reps)] for k in ("plan", "bare")
        }
        med = {k: statistics.median(v) for k, v in per_rep.items()}
        received = sum(o["bytes"] for o in outs[m:])
        row = {
            "sources": m,
            "workers": tp * dp,
            "engine": f"TP{tp} x DP{dp}",
            "bytes_received": received,
            "plan_s": round(med["plan"], 4),
            "bare_s": round(med["bare"], 4),
            "ratio": round(med["bare"] / med["plan"], 3),
            "plan_all_s": [round(x, 4) for x in per_rep["plan"]],
            "bare_all_s": [round(x, 4) for x in per_rep["bare"]],
            "sent_per_source": [o["bytes"] for o in outs[:m]],
        }
        if args.predict:
            probe = outs[m]["probe"]
            row["loopback_probe"] = {
                "gbyte_per_s": round(probe["bytes_per_s"] / 1e9, 3),
                "message_us": round(probe["message_us"], 1),
            }
            row["planner"] = predict_run(args, m, probe)
            row["planner"]["measured_over_predicted"] = round(med["plan"] / row["planner"]["predicted_s"], 2)
        rows.append(row)
        print(
            f"{m} source(s) -> TP{tp} x DP{dp}: plan {med['plan']:.3f} s vs bare {med['bare']:.3f} s "
            f"(ratio {row['ratio']}); {received / med['plan'] / 2**30:.2f} GiB/s received",
            flush=True,
        )
    out = {
        "model": args.model,
        "model_bytes": models.model_bytes(args.model),
        "bucket_mb": args.bucket_mb,
        "reps": args.reps,
        "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "rows": rows,
    }
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "slices_results.json"), "w") as f:
            json.dump(out, f, indent=2)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=["trainer", "worker", "slice-member"], default="trainer")
    p.add_argument("--model", default="cpu-m", choices=sorted(models.PRESETS))
    p.add_argument("--workers", default="1,2,4,8", help="worker counts, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--out", default="")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument(
        "--sources", default="", help="every trainer rank a source: source counts, comma-separated"
    )
    p.add_argument("--slice-engine", default="2,2", help="tp,dp of the engine the sources push to")
    p.add_argument("--store-port", type=int, default=0)
    p.add_argument("--group", default="")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument(
        "--predict",
        action="store_true",
        help="with --sources: also probe the loopback (one big message, a stream of small ones) in each "
        "group and have the planner (weightwire plan) predict the run from it; writes DIR/topology-M-sources.json",
    )
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.update(_QUIET)
    if args.role == "worker":
        return run_worker(args)
    if args.role == "slice-member":
        return run_slice_member(args)
    return run_sources(args) if args.sources else run_trainer(args)


if __name__ == "__main__":
    raise SystemExit(main())
