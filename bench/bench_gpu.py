"""GPU benchmark: weightwire against the physical limit and against peer approaches, in one run.

Run on a CUDA machine (one GPU; a second GPU of the same host adds the peer-GPU case)::

    python3 bench/bench_gpu.py --out DIR [--models qwen2.5-0.5b,qwen3-8b] [--budget-s 330]

This process is the trainer. Receivers are separate ``worker.py`` processes (one per approach and
model), each holding its own copy of a synthetic model shaped like a real one (``models.py``). For
each model, in order of importance (a total time budget skips what does not fit):

``limit``         in this one process: one device-to-device copy of all the model's bytes (the
                  limit), the same bytes as per-tensor copies out of a flat buffer (what a receiver
                  must do), pack + unpack through a bucket (the limit for two copies), and the copy
                  from the second GPU to the first (the peer limit)
``ww_inplace``    weightwire ``push_flat`` of a flat GPU buffer exported in place (no packing copy)
``ww_packed``     weightwire ``push`` of separate tensors packed into double-buffered buckets (packing
                  forced: such tensors on the GPU are otherwise exported where they live)
``ww_params``     the README's line with default options: ``WeightPusher([addr]).push(model.
                  named_parameters(), version=v)`` (and ``model.state_dict()``) of an ``nn.Module``
                  whose parameters are separately allocated (as a Hugging Face model's are); compare
                  with ``limit``'s per-tensor copy
``ww_fresh``      the same line when every parameter is in a new storage before each push (``new
                  storages``: clones made outside the timing, as gathers or conversions give; the
                  exporter packs them into its pool by torch.cat, or ``per-tensor copies``), and when
                  the producer writes each step's values into ``WeightPusher.tensor_buffers``
``ww_peer``       weightwire ``push_gathered`` of a buffer on GPU 1 into a worker on GPU 0
                  (``allow_peer_device_import``)
``per_tensor``    one CUDA IPC handle per tensor, pickled per tensor (OpenRLHF's
                  ``update_weight_cuda_ipc``) or all tensors in one message (SGLang's
                  ``update_weights_from_tensor``)
``ckpt_engine``   checkpoint-engine 0.4.2's receiver fed the same buckets through its ZMQ protocol,
                  the sender written like its ParameterServer (2-bucket buffer, new each update)

Every update of every case carries fresh bytes for the worker (a new random fill per case); the
worker's parameters are checked bit for bit (exact integer digests) after each case. Results go
to DIR/gpu_results.json (rewritten after every case) and DIR/bench_gpu.log; ``report.py`` turns
them into tables and plots.

``--device cpu`` runs the same orchestration on CPU with host shared memory and tiny models: a dry
run of the logic, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from weightwire.adapters.torch import DEFAULT_COPY_STREAMS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
from common import GiB, ms, now
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
from weightwire.client.inputs import plan as ww_plan
from weightwire.client.inputs.plan import TensorSpec, pack_into, plan_buckets
from weightwire.client.push.pusher import GatheredBucket, WeightPusher

# ---------------------------------------------------------------------------------------------
# Memory readings of this process
# ---------------------------------------------------------------------------------------------


def trainer_mem(devices: list[torch.device]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in devices:
        if d.type != "cuda":
            continue
        free, total = torch.cuda.mem_get_info(d)
        out[f"allocated_{d.index}"] = torch.cuda.memory_allocated(d)
        out[f"max_allocated_{d.index}"] = torch.cuda.max_memory_allocated(d)
        out[f"device_used_{d.index}"] = total - free
    return out


def reset_peak(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)


def collect() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(args.log_dir) if args.log_dir else self.out
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log = common.Log(self.out / "bench_gpu.log")
        self.t_start = time.monotonic()
        self.cuda = args.device == "cuda"
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        self.peer = self.cuda and self.gpus >= 2 and not args.no_peer
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.transport = "cuda_ipc" if self.cuda else "host_shm"
        self.versions: dict[str, int] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="wwbench-"))
        self.ckpt_error = self._probe_ckpt_engine()
        env = common.environment(
            {
                "bench": "gpu" if self.cuda else "gpu-dry-run-on-cpu",
                "argv": common.public_argv(sys.argv[1:]),
                "checkpoint_engine": self.ckpt_error or self._ckpt_version(),
            }
        )
        self.results = common.Results(self.out / "gpu_results.json", env)
        self.n_updates = 0

    # --- plumbing --------------------------------------------------------------------------

    def time_left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t_start)

    def _probe_ckpt_engine(self) -> str:
        try:
            import checkpoint_engine.worker  # noqa: F401
            import zmq  # noqa: F401
        except Exception as e:
            return f"not importable: {type(e).__name__}: {e}"
        return ""

    @staticmethod
    def _ckpt_version() -> str:
        from importlib.metadata import version

        with contextlib.suppress(Exception):
            return "checkpoint-engine " + version("checkpoint-engine")
        return "checkpoint-engine (version unknown)"

    def next_version(self, worker: str) -> int:
        self.versions[worker] = self.versions.get(worker, 0) + 1
        return self.versions[worker]

    def sync(self) -> None:
        if self.cuda:
            for i in range(self.gpus):
                torch.cuda.synchronize(i)

    def run_case(
        self, model: str, case: str, variant: str, fn: Callable[[], dict[str, Any]], need_s: float
    ) -> None:
        left = self.time_left()
        rec: dict[str, Any] = {"model": model, "case": case, "variant": variant}
        if left < need_s:
            rec["skipped"] = f"time budget: {left:.0f} s left, case needs about {need_s:.0f} s"
            self.log(f"SKIP {model} {case} {variant}: {rec['skipped']}")
            self.results.add(rec)
            return
        t0 = time.monotonic()
        try:
            rec.update(fn())
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()[-6000:]
            self.log(f"ERROR {model} {case} {variant}: {rec['error']}\n{rec['traceback']}")
        rec["case_wall_s"] = round(time.monotonic() - t0, 2)
        self.results.add(rec)
        self.log(f"done {model} {case} {variant} in {rec['case_wall_s']} s: {summary_line(rec)}")

    def workers_for(self, preset: str) -> dict[str, common.WorkerProc]:
        visible = ",".join(str(i) for i in range(self.gpus)) if self.cuda else None
        dev = "cuda" if self.cuda else "cpu"
        modes = ["weightwire", "per_tensor"] + ([] if self.ckpt_error else ["ckpt_engine"])
        if self.args.cases:
            # Start only the receivers a selected case uses (each holds a whole model).
            used = {
                "ww_inplace": "weightwire",
                "ww_packed": "weightwire",
                "ww_peer": "weightwire",
                "ww_params": "weightwire",
                "ww_fresh": "weightwire",
                "per_tensor": "per_tensor",
                "ckpt_engine": "ckpt_engine",
            }
            wanted = {used[c.split(":", 1)[0]] for c in self.args.cases if c.split(":", 1)[0] in used}
            modes = [m for m in modes if m in wanted]
        procs = {}
        for mode in modes:
            name = f"{preset}-{mode}"
            procs[mode] = common.WorkerProc(
                name,
                [
                    "--mode",
                    mode,
                    "--model",
                    preset,
                    "--device",
                    dev,
                    "--copy-streams",
                    str(self.args.copy_streams),
                ],
                self.log_dir,
                common.child_env(visible),
            )
        return procs

    # --- limits ----------------------------------------------------------------------------

    def limits(self, rig: Rig) -> dict[str, Any]:
        reps = self.args.limit_reps
        out: dict[str, Any] = {"bytes": rig.model_bytes, "reps": reps}
        views = [rig.flat.narrow(0, s.offset_bytes, s.nbytes).view(s.dtype).view(s.shape) for s in rig.specs]
        scratch = [torch.empty_like(rig.flat)]  # freed right after its timing (GPU memory)
        out["d2d_flat_ms"] = common.time_reps(lambda: scratch[0].copy_(rig.flat), self.sync, reps)
        scratch.clear()

        def per_tensor() -> None:
            for x, v in zip(rig.tensors, views, strict=True):
                x.copy_(v)

        out["d2d_per_tensor_ms"] = common.time_reps(per_tensor, self.sync, reps)
        for b in self.args.packed_buckets:
            out[f"two_copies_{common.size_label(b)}_ms"] = common.time_reps(
                self._two_copies(rig, b), self.sync, reps
            )
        if rig.flat_peer is not None:
            peer = rig.flat_peer
            out["peer_flat_ms"] = common.time_reps(lambda: rig.flat.copy_(peer), self.sync, reps)
            peer_views = [
                peer.narrow(0, s.offset_bytes, s.nbytes).view(s.dtype).view(s.shape) for s in rig.specs
            ]

            def peer_per_tensor() -> None:
                for x, v in zip(rig.tensors, peer_views, strict=True):
                    x.copy_(v)

            out["peer_per_tensor_ms"] = common.time_reps(peer_per_tensor, self.sync, reps)
        # The fresh-tensor pool's packing copy alone: one copy per tensor (small ones grouped), and
        # one torch.cat per run of back-to-back tensors, into the pool layout of these tensors.
        from weightwire.client.transports import cuda_ipc_pool as cpool

        shapes = [(x.dtype, x.shape) for x in rig.tensors]
        layout = cpool.lay_out([x.nbytes for x in rig.tensors])
        region = cpool.PoolRegion(layout, rig.device)  # freed when this returns
        pool_views = region.views(shapes)
        runs = cpool.cat_runs(layout, region.chunks, shapes)
        out["pack_grouped_ms"] = common.time_reps(
            lambda: cpool.copy_into(pool_views, rig.tensors), self.sync, reps
        )
        out["pack_cat_ms"] = common.time_reps(lambda: cpool.cat_into(runs, rig.tensors), self.sync, reps)
        out["pack_cat_runs"] = len(runs)
        # Everything above rewrote the trainer's buffers with their own bytes; keep digests honest.
        rig.refill()
        return out

    def _two_copies(self, rig: Rig, bucket_bytes: int) -> Callable[[], None]:
        """Pack each bucket into a staging buffer, then copy every tensor out of it: the two copies
        a packed transfer makes, back to back in one process, with weightwire's own bucket plan."""
        owners = {s.name: ("w",) for s in rig.specs}
        plans = plan_buckets(rig.specs, owners, bucket_bytes=bucket_bytes)
        staging = torch.empty(max(p.size_bytes for p in plans), dtype=torch.uint8, device=rig.device)
        dst = rig.tensors

        def run() -> None:
            for p in plans:
                pack_into(staging, p.specs, [rig.tensors[i] for i in p.items])
                for s, i in zip(p.specs, p.items, strict=True):
                    dst[i].copy_(staging.narrow(0, s.offset_bytes, s.nbytes).view(s.dtype).view(s.shape))

        return run

    # --- weightwire ------------------------------------------------------------------------

    def ww_case(
        self,
        rig: Rig,
        w: common.WorkerProc,
        kind: str,
        bucket_bytes: int | None,
        *,
        recheck: bool = True,
        depth: int = 2,
    ) -> dict[str, Any]:
        addr = w.info["address"]
        rig.refill()
        devices = [self.device] + ([torch.device("cuda", 1)] if kind == "peer" else [])
        w.call({"cmd": "release"})
        if kind in ("params", "params_storages", "state_dict", "params_list", "fresh", "buffers"):
            # The README's line: every option left at its default.
            pusher = WeightPusher([addr])
        else:
            pusher = WeightPusher(
                [addr],
                transport=self.transport,
                timeout_s=self.args.rpc_timeout_s,
                bucket_size_bytes=bucket_bytes or ww_plan.DEFAULT_BUCKET_BYTES,
                recheck_manifests=recheck,
                pipeline_depth=depth,
            )
        updates: list[dict[str, Any]] = []
        mem: dict[str, Any] = {}
        # Work of the trainer's own before each push, outside the timing (a fresh case's new storages).
        before: Callable[[], None] = nothing
        restore: contextlib.AbstractContextManager[Any] = (
            force_packing()
            if kind == "packed"
            else storages_every_push()
            if kind == "params_storages"
            else contextlib.nullcontext()
        )
        try:
            pusher.manifests()
            if kind in ("params", "params_storages", "state_dict", "params_list"):
                module = param_module(rig)
                # What the module's own walk costs in this process (the README's line pays it inside push).
                walk: Callable[[], Any] = (
                    (lambda: list(module.named_parameters())) if kind != "state_dict" else module.state_dict
                )
                mem["walk_ms"] = common.time_reps(walk, lambda: None, max(self.args.reps, 5))
                kept = list(module.named_parameters())

                def push(v: int) -> Any:
                    if kind == "params_list":  # a list of the parameters kept across steps
                        return pusher.push(kept, version=v)
                    tensors = module.named_parameters() if kind != "state_dict" else module.state_dict()
                    return pusher.push(tensors, version=v)
            elif kind in ("fresh", "fresh_copies"):
                # Every parameter in a new storage before each push, as a gather, a conversion or a
                # state_dict() copy hands them over (the previous step's tensors freed first, so the
                # caching allocator may give their blocks back).
                # Each step's tensors stay referenced until the next step's are made (as a trainer's
                # `sd = ...; push(sd)` keeps them past the call), so freeing them is not timed.
                pending: list[list[tuple[str, torch.Tensor]]] = []
                if kind == "fresh_copies":
                    restore = pack_by_copies()

                def before() -> None:
                    pending.clear()
                    pending.append([(n, x.clone()) for n, x in rig.named])
                    self.sync()

                def push(v: int) -> Any:
                    return pusher.push(pending[-1], version=v)
            elif kind == "buffers":
                # The producer writes each step's values into the library's buffers (tensor_buffers).
                bufs = pusher.tensor_buffers(rig.named)

                def before() -> None:
                    for n, x in rig.named:
                        bufs[n].copy_(x)
                    self.sync()

                def push(v: int) -> Any:
                    return pusher.push(bufs, version=v)
            elif kind == "inplace":
                src = rig.flat
                if not self.cuda:  # a host buffer is exported in place only from the pusher's own segment
                    src = pusher.host_buffer(rig.size)
                    src.copy_(rig.flat)
                buckets = flat_buckets(src, rig.specs, bucket_bytes)

                def push(v: int) -> Any:
                    return pusher.push_flat(buckets, version=v)
            elif kind == "packed":
                named = rig.named

                def push(v: int) -> Any:
                    return pusher.push(named, version=v)
            elif kind == "peer":
                if rig.flat_peer is None:
                    raise RuntimeError("no second GPU")
                gathered = [GatheredBucket(rig.specs, [rig.flat_peer], rig.size)]

                def push(v: int) -> Any:
                    return pusher.push_gathered(gathered, version=v, allow_peer_device_import=True)
            else:
                raise ValueError(kind)
            restore.__enter__()
            w_mem0 = w.call({"cmd": "reset_peak"})
            collect()
            self.sync()
            reset_peak(devices)
            mem0 = trainer_mem(devices)
            case_t0 = time.monotonic()
            for i in range(self.args.reps + 1):
                version = self.next_version(w.name)
                before()
                reset_counters()
                t0 = now()
                results = push(version)
                t1 = now()
                r = results[addr]
                updates.append(
                    {
                        "version": version,
                        "t0_ns": t0,
                        "t1_ns": t1,
                        "total_ms": ms(t1 - t0),
                        "stage_ms": ms(STAGE_NS[0]),
                        "recheck_ms": ms(RECHECK_NS[0]),
                        "plan_ms": ms(PLAN_NS[0]),
                        "handles_opened": r.handles_opened,
                        "bytes": r.bytes_loaded,
                        "buckets": r.buckets,
                        "transport": r.transport,
                    }
                )
                if i >= 1 and time.monotonic() - case_t0 > self.args.case_cap_s:
                    break
            self.sync()
            mem1 = trainer_mem(devices)
            mem.update(pool_stats(pusher))
            stats = w.call({"cmd": "stats"})
            w_mem1 = w.call({"cmd": "mem"})
            got = w.call({"cmd": "digest"}, timeout_s=300)["digest"]
            verified = got == rig.digest
        finally:
            restore.__exit__(None, None, None)
            pusher.close()
        collect()
        mem_closed = trainer_mem(devices)
        released = w.call({"cmd": "release"})
        collect()
        self.sync()
        mem_released = trainer_mem(devices)
        w_mem2 = w.call({"cmd": "mem"})
        by_version = {u["version"]: u for u in stats["updates"]}
        for u in updates:
            s = by_version.get(u["version"])
            if s is None:
                continue
            u.update(
                open_ms=ms(s["open_ns"]),
                copy_ms=ms(s["copy_ns"]),
                commit_ms=ms(s.get("commit_ns", 0)),
                begin_ms=ms(s.get("begin_ns", 0)),
                opens=s["opens"],
                server_loads=s["loads"],
                bucket_ms=ms(s.get("bucket_ns", 0)),
                pre_ms=ms(s["t_header_ns"] - u["t0_ns"]),
                post_ms=ms(u["t1_ns"] - s.get("t_commit_end_ns", u["t1_ns"])),
                # The stream's two hops inside the update: header -> first bucket at the worker, and
                # last bucket done -> commit at the worker (its ack to the trainer, the commit back).
                header_to_bucket_ms=ms(s.get("t_first_bucket_ns", s["t_header_ns"]) - s["t_header_ns"]),
                last_bucket_to_commit_ms=ms(s.get("t_commit_start_ns", 0) - s.get("t_last_bucket_end_ns", 0)),
            )
            u["control_ms"] = u["total_ms"] - u["open_ms"] - u["copy_ms"] - u["commit_ms"] - u["stage_ms"]
        for d in devices:
            if d.type != "cuda":
                continue
            i = d.index
            base = mem0[f"allocated_{i}"]
            mem[f"trainer_gpu{i}"] = {
                "peak_extra": mem1[f"max_allocated_{i}"] - base,
                "after_updates": mem1[f"allocated_{i}"] - base,
                "after_close": mem_closed[f"allocated_{i}"] - base,
                "after_worker_release": mem_released[f"allocated_{i}"] - base,
                "device_used_delta_after_updates": mem1[f"device_used_{i}"] - mem0[f"device_used_{i}"],
                "device_used_delta_after_release": mem_released[f"device_used_{i}"]
                - mem0[f"device_used_{i}"],
            }
        if "allocated" in w_mem0:
            mem["worker"] = {
                "peak_extra": w_mem1["max_allocated"] - w_mem0["allocated"],
                "after_updates": w_mem1["allocated"] - w_mem0["allocated"],
                "after_release": w_mem2["allocated"] - w_mem0["allocated"],
                "model_bytes": w.info["model_bytes"],
            }
        else:
            mem["worker"] = {
                "rss_kib_before": w_mem0["rss_kib"],
                "rss_kib_after": w_mem1["rss_kib"],
                "hwm_kib": w_mem1["hwm_kib"],
            }
        mem["worker_mappings_released"] = released["released"]
        return {
            "bucket_bytes": bucket_bytes,
            "bytes": rig.model_bytes,
            "updates": updates,
            "memory": mem,
            "verified": verified,
            "transport": self.transport,
            "recheck_manifests": recheck,
        }

    # --- one CUDA IPC handle per tensor, pickled -------------------------------------------

    def per_tensor_case(self, rig: Rig, w: common.WorkerProc, style: str) -> dict[str, Any]:
        from multiprocessing.connection import Listener

        from torch.multiprocessing.reductions import reduce_tensor

        rig.refill()
        devices = [self.device]
        w_mem0 = w.call({"cmd": "reset_peak"})
        collect()
        self.sync()
        reset_peak(devices)
        mem0 = trainer_mem(devices)
        updates: list[dict[str, Any]] = []
        case_t0 = time.monotonic()
        reps = self.args.reps if rig.model_bytes < 4 * GiB else self.args.slow_reps
        for i in range(reps + 1):
            self.n_updates += 1
            path = str(self.tmp / f"pt-{self.n_updates}.sock")
            authkey = os.urandom(16)
            t0 = now()
            with Listener(path, family="AF_UNIX", authkey=authkey) as listener:
                listener._listener._socket.settimeout(self.args.rpc_timeout_s)  # type: ignore[attr-defined]
                w.send(
                    {
                        "cmd": "update",
                        "addr": path,
                        "authkey": authkey.hex(),
                        "device_index": 0 if self.cuda else None,
                    }
                )
                with listener.accept() as conn:
                    if style == "per_tensor":
                        for name, x in rig.named:
                            conn.send(("tensor", [(name, reduce_tensor(x))]))
                            if not conn.poll(self.args.rpc_timeout_s):
                                raise TimeoutError(f"no ack for {name}")
                            conn.recv_bytes()
                    else:
                        conn.send(("batch", [(name, reduce_tensor(x)) for name, x in rig.named]))
                        if not conn.poll(self.args.rpc_timeout_s):
                            raise TimeoutError("no ack for the batch")
                        conn.recv_bytes()
                    conn.send(None)
                    rep = w.reply(self.args.rpc_timeout_s)
            t1 = now()
            total = ms(t1 - t0)
            updates.append(
                {
                    "total_ms": total,
                    "open_ms": ms(rep["open_ns"]),
                    "copy_ms": ms(rep["copy_ns"]),
                    "control_ms": total - ms(rep["open_ns"]) - ms(rep["copy_ns"]),
                    "handles_opened": rep["handles_opened"],
                    "distinct_memory_handles": rep["distinct_memory_handles"],
                    "messages": rep["messages"],
                }
            )
            if i >= 1 and time.monotonic() - case_t0 > self.args.case_cap_s:
                break
        self.sync()
        mem1 = trainer_mem(devices)
        w_mem1 = w.call({"cmd": "mem"})
        got = w.call({"cmd": "digest"}, timeout_s=300)["digest"]
        collect()
        mem2 = trainer_mem(devices)
        mem: dict[str, Any] = {}
        if self.cuda:
            base = mem0["allocated_0"]
            mem["trainer_gpu0"] = {
                "peak_extra": mem1["max_allocated_0"] - base,
                "after_updates": mem2["allocated_0"] - base,
            }
            mem["worker"] = {
                "peak_extra": w_mem1["max_allocated"] - w_mem0["allocated"],
                "after_updates": w_mem1["allocated"] - w_mem0["allocated"],
            }
        return {
            "style": style,
            "bytes": rig.model_bytes,
            "updates": updates,
            "memory": mem,
            "verified": got == rig.digest,
        }

    # --- checkpoint-engine's receiver ------------------------------------------------------

    def ckpt_case(self, rig: Rig, w: common.WorkerProc, bucket_bytes: int | None) -> dict[str, Any]:
        import zmq

        rig.refill()
        devices = [self.device]
        ctx = zmq.Context.instance()
        owners = {s.name: ("w",) for s in rig.specs}
        plans = plan_buckets(rig.specs, owners, bucket_bytes=bucket_bytes) if bucket_bytes else []
        if plans and bucket_bytes:
            # Like checkpoint-engine: a bucket is at least the largest tensor, at most the model.
            bucket_bytes = min(max(bucket_bytes, max(p.size_bytes for p in plans)), rig.size)
            plans = plan_buckets(rig.specs, owners, bucket_bytes=bucket_bytes)
        w_mem0 = w.call({"cmd": "reset_peak"})
        collect()
        self.sync()
        reset_peak(devices)
        mem0 = trainer_mem(devices)
        updates: list[dict[str, Any]] = []
        case_t0 = time.monotonic()

        def meta(s: TensorSpec, base: int) -> dict[str, Any]:
            return {
                "name": s.name,
                "shape": torch.Size(s.shape),
                "dtype": s.dtype,
                "offset": base + s.offset_bytes,
            }

        def expect_ok(sock: Any) -> None:
            resp = sock.recv()
            if resp != b"":
                raise RuntimeError(f"checkpoint-engine receiver failed: {resp[:2000]!r}")

        for i in range(self.args.reps + 1):
            self.n_updates += 1
            addr = f"ipc://@wwbench-ckpt-{os.getpid()}-{self.n_updates}"
            stage_ns = 0
            t0 = now()
            if bucket_bytes:
                # As checkpoint-engine's ParameterServer: a 2-bucket buffer allocated and shared per update.
                buffer = torch.empty(2 * bucket_bytes, dtype=torch.uint8, device=self.device)
            else:
                buffer = rig.flat
            handle = share_for_pickle(buffer)
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.RCVTIMEO, int(self.args.rpc_timeout_s * 1000))
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr)
            try:
                w.send({"cmd": "update", "addr": addr, "device_index": 0})
                sock.send_pyobj(handle)
                if bucket_bytes:
                    for k, p in enumerate(plans):
                        base = (k % 2) * bucket_bytes
                        ts = now()
                        pack_into(
                            buffer.narrow(0, base, p.size_bytes), p.specs, [rig.tensors[j] for j in p.items]
                        )
                        self.sync()
                        stage_ns += now() - ts
                        expect_ok(sock)
                        sock.send_pyobj([meta(s, base) for s in p.specs])
                else:
                    expect_ok(sock)
                    sock.send_pyobj([meta(s, 0) for s in rig.specs])
                expect_ok(sock)
                t_loaded = now()  # the last bucket is loaded; what follows is release and post hook
                sock.send_pyobj(None)  # release the buffer
                expect_ok(sock)
                sock.send_pyobj(None)  # post hook, done
                expect_ok(sock)
                t_acked = now()
            finally:
                sock.close()
            rep = w.reply(self.args.rpc_timeout_s)
            del handle
            if bucket_bytes:
                del buffer
                collect()
                if self.cuda:
                    torch.cuda.empty_cache()
            t1 = now()
            total = ms(t1 - t0)
            updates.append(
                {
                    "total_ms": total,
                    "open_ms": ms(rep["open_ns"]),
                    "copy_ms": ms(rep["copy_ns"]),
                    "stage_ms": ms(stage_ns),
                    "control_ms": total - ms(rep["open_ns"]) - ms(rep["copy_ns"]) - ms(stage_ns),
                    "handles_opened": rep["handles_opened"],
                    "buckets": rep["buckets"],
                    "until_last_ack_ms": ms(t_acked - t0),
                    "receiver_ms": ms(rep["receiver_ns"]),
                    "until_loaded_ms": ms(t_loaded - t0),
                }
            )
            if i >= 1 and time.monotonic() - case_t0 > self.args.case_cap_s:
                break
        self.sync()
        mem1 = trainer_mem(devices)
        w_mem1 = w.call({"cmd": "mem"})
        got = w.call({"cmd": "digest"}, timeout_s=300)["digest"]
        mem: dict[str, Any] = {}
        if self.cuda:
            base = mem0["allocated_0"]
            mem["trainer_gpu0"] = {
                "peak_extra": mem1["max_allocated_0"] - base,
                "after_updates": mem1["allocated_0"] - base,
            }
            mem["worker"] = {
                "peak_extra": w_mem1["max_allocated"] - w_mem0["allocated"],
                "after_updates": w_mem1["allocated"] - w_mem0["allocated"],
            }
        return {
            "bucket_bytes": bucket_bytes,
            "bytes": rig.model_bytes,
            "updates": updates,
            "memory": mem,
            "verified": got == rig.digest,
        }

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> int:
        instrument_trainer()
        a = self.args
        self.log(
            f"start: models {a.models}, budget {a.budget_s} s, device {a.device}, GPUs {self.gpus}, peer {self.peer}"
        )
        if self.ckpt_error:
            self.log(f"checkpoint-engine: {self.ckpt_error}")
        procs = {m: self.workers_for(m) for m in a.models}  # all start at once; they load in parallel
        all_procs = [p for d in procs.values() for p in d.values()]
        try:
            with common.worker_group(all_procs, timeout_s=a.start_timeout_s):
                self.log(
                    "workers ready: " + ", ".join(f"{p.name} pid {p.info.get('pid')}" for p in all_procs)
                )
                for m in a.models:
                    self.run_model(m, procs[m])
        finally:
            self.log("workers stopped; results in gpu_results.json")
        return 0

    def run_model(self, preset: str, procs: dict[str, common.WorkerProc]) -> None:
        self.log(f"{preset}: building the trainer's tensors")
        rig = make_rig(preset, self.device, self.peer)
        try:
            for case, variant, fn, need_s in self.plan_cases(rig, procs):
                self.run_case(preset, case, variant, fn, need_s)
        finally:
            rig.release()
            collect()
            if self.cuda:
                torch.cuda.empty_cache()

    def plan_cases(
        self, rig: Rig, procs: dict[str, common.WorkerProc]
    ) -> list[tuple[str, str, Callable[[], dict[str, Any]], float]]:
        """Every case for one model, most important first (the budget cuts from the end)."""
        a = self.args
        need = 30.0 if rig.model_bytes >= 4 * GiB else 8.0
        # A receiver is missing only when --cases selects none of its cases (they are dropped below).
        ww = cast(common.WorkerProc, procs.get("weightwire"))
        pt = cast(common.WorkerProc, procs.get("per_tensor"))
        ce = procs.get("ckpt_engine")
        main_b = a.packed_buckets[min(1, len(a.packed_buckets) - 1)]
        label = common.size_label
        cases: list[tuple[str, str, Callable[[], dict[str, Any]], float]] = [
            ("limit", "one process", lambda: self.limits(rig), need),
            ("ww_inplace", "whole", lambda: self.ww_case(rig, ww, "inplace", None), need),
            ("ww_packed", label(main_b), lambda: self.ww_case(rig, ww, "packed", main_b), need),
            ("ww_params", "named_parameters", lambda: self.ww_case(rig, ww, "params", None), need),
            ("ww_params", "state_dict", lambda: self.ww_case(rig, ww, "state_dict", None), need),
            ("ww_params", "kept list", lambda: self.ww_case(rig, ww, "params_list", None), need),
            (
                "ww_params",
                "storages sent",
                lambda: self.ww_case(rig, ww, "params_storages", None),
                need,
            ),
            ("ww_fresh", "new storages", lambda: self.ww_case(rig, ww, "fresh", None), need),
            (
                "ww_fresh",
                "new storages, per-tensor copies",
                lambda: self.ww_case(rig, ww, "fresh_copies", None),
                need,
            ),
            ("ww_fresh", "tensor_buffers", lambda: self.ww_case(rig, ww, "buffers", None), need),
            ("per_tensor", "per_tensor", lambda: self.per_tensor_case(rig, pt, "per_tensor"), 3 * need),
        ]
        if ce is not None:
            cases.append(("ckpt_engine", label(main_b), lambda: self.ckpt_case(rig, ce, main_b), need))
        if self.peer:
            cases.append(("ww_peer", "whole", lambda: self.ww_case(rig, ww, "peer", None), need))
        cases += [
            ("ww_packed", label(b), lambda b=b: self.ww_case(rig, ww, "packed", b), need)
            for b in a.packed_buckets
            if b != main_b
        ]
        # WeightPusher(pipeline_depth=d): d staging buffers, so packing waits for an ack less often.
        cases += [
            (
                "ww_packed",
                f"{label(b)}, depth {d}",
                lambda b=b, d=d: self.ww_case(rig, ww, "packed", b, depth=d),
                need,
            )
            for d in a.packed_depths
            if d != 2
            for b in a.packed_buckets
        ]
        cases += [
            ("ww_inplace", label(b), lambda b=b: self.ww_case(rig, ww, "inplace", b), need)
            for b in a.inplace_buckets
        ]
        cases.append(("per_tensor", "batch", lambda: self.per_tensor_case(rig, pt, "batch"), 2 * need))
        if ce is not None:
            cases.append(("ckpt_engine", "in-place", lambda: self.ckpt_case(rig, ce, None), need))
            cases += [
                ("ckpt_engine", label(b), lambda b=b: self.ckpt_case(rig, ce, b), need)
                for b in [*a.packed_buckets, a.ckpt_default_bucket]
                if b != main_b
            ]
        if a.cases:
            cases = [c for c in cases if selected(a.cases, c[0], c[1])]
        return cases


def param_module(rig: Rig) -> torch.nn.Module:
    """An ``nn.Module`` whose parameters are the rig's separately allocated tensors under their
    checkpoint names (nested submodules, as a Hugging Face model's ``named_parameters()`` gives)."""
    root = torch.nn.Module()
    for name, x in rig.named:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = getattr(mod, part, None)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        mod.register_parameter(leaf, torch.nn.Parameter(x, requires_grad=False))
    return root


def nothing() -> None:
    pass


def pool_stats(pusher: WeightPusher) -> dict[str, int]:
    """Bench only: the CUDA IPC exporters' fresh-tensor pool (bytes held now, tensors packed)."""
    from weightwire.client.transports.cuda_ipc import CudaIpcExporter

    out = {"pool_bytes": 0, "tensors_packed": 0}
    for e in pusher._staging._exporters.values():
        if isinstance(e, CudaIpcExporter):
            out["tensors_packed"] += e.tensors_packed
            out["pool_bytes"] += sum(
                c.nbytes for _, x in e._pooled.values() if x.region is not None for c in x.region.chunks
            )
    return out


@contextlib.contextmanager
def pack_by_copies() -> Any:
    """Bench only: the fresh-tensor pool packs by one copy per tensor (small ones grouped) instead of
    one ``torch.cat`` per run of back-to-back tensors (``cuda_ipc_pool.PACK_WITH_CAT``)."""
    from weightwire.client.transports import cuda_ipc_pool

    original = cuda_ipc_pool.PACK_WITH_CAT
    cuda_ipc_pool.PACK_WITH_CAT = False
    try:
        yield
    finally:
        cuda_ipc_pool.PACK_WITH_CAT = original


@contextlib.contextmanager
def force_packing() -> Any:
    """Bench only: ``push`` packs GPU tensors into staging buffers even for workers that read them
    where they live (what the packed cases measure)."""
    from weightwire.client.update import jobs

    original = jobs.exports_in_place
    jobs.exports_in_place = lambda *a, **k: False  # type: ignore[assignment]
    try:
        yield
    finally:
        jobs.exports_in_place = original


@contextlib.contextmanager
def storages_every_push() -> Any:
    """Bench only: a push of kept parameters sends the worker its storage set whole every update,
    never by name (``CudaIpcHandle.storage_set_id``), for the comparison in the same run."""
    from weightwire.client.update.payload_refs import StorageSetRefs

    original = StorageSetRefs.payloads
    StorageSetRefs.payloads = lambda self, worker, payloads: payloads  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        StorageSetRefs.payloads = original  # type: ignore[method-assign]


def share_for_pickle(buffer: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """``reduce_tensor(buffer)`` in a form plain ``pickle`` (ZMQ's ``send_pyobj``) carries as a share.

    CUDA handles are plain bytes already. A CPU storage (dry runs only) is pickled by value by plain
    pickle, so it is wrapped to reduce through torch's file_system sharing instead.
    """
    from torch.multiprocessing.reductions import reduce_storage, reduce_tensor

    fn, args = reduce_tensor(buffer)
    if buffer.device.type == "cuda":
        return fn, args
    return fn, (args[0], _SharedStorage(reduce_storage(args[1])), *args[2:])


class _SharedStorage:
    def __init__(self, reduced: tuple[Any, ...]) -> None:
        self.reduced = reduced

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduced


def selected(patterns: list[str], case: str, variant: str) -> bool:
    """``--cases``: ``case`` selects every variant of it, ``case:variant`` one variant."""
    return any(p == case or p == f"{case}:{variant}" for p in patterns)


def summary_line(rec: dict[str, Any]) -> str:
    if "error" in rec or "skipped" in rec:
        return rec.get("error") or rec.get("skipped", "")
    if rec["case"] == "limit":
        return ", ".join(f"{k}={common.median(v):.2f}" for k, v in rec.items() if k.endswith("_ms"))
    ups = rec.get("updates", [])
    if not ups:
        return "no updates"
    warm = ups[1:] or ups
    keys = ("total_ms", "open_ms", "copy_ms", "stage_ms", "control_ms")
    parts = [f"cold {ups[0]['total_ms']:.2f} ms"] + [
        f"{k}={common.median([u.get(k, 0.0) for u in warm]):.2f}" for k in keys
    ]
    parts.append(f"handles={[u.get('handles_opened') for u in ups]}")
    parts.append(f"verified={rec.get('verified')}")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="weightwire GPU benchmark (see the module docstring)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu-run"))
    p.add_argument("--models", default="qwen3-8b-names,qwen2.5-0.5b,qwen3-8b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--budget-s", type=float, default=330.0, help="stop starting cases after this many seconds"
    )
    p.add_argument("--case-cap-s", type=float, default=25.0, help="stop a case's repetitions after this long")
    p.add_argument("--reps", type=int, default=5, help="warm updates per case (after one cold update)")
    p.add_argument(
        "--slow-reps", type=int, default=2, help="warm updates of the per-tensor baseline on large models"
    )
    p.add_argument("--limit-reps", type=int, default=5)
    p.add_argument("--packed-buckets", default="64MiB,256MiB,1GiB")
    p.add_argument(
        "--packed-depths",
        default="2",
        help="staging buffers per packed case (pipeline_depth), comma-separated",
    )
    p.add_argument(
        "--inplace-buckets",
        default="256MiB",
        help="in-place runs cut into views of this size (besides whole)",
    )
    p.add_argument(
        "--ckpt-default-bucket",
        default="8GiB",
        help="checkpoint-engine's default bucket (PS_MAX_BUCKET_SIZE_GB)",
    )
    p.add_argument("--log-dir", default="", help="where worker logs go (default: the results folder)")
    p.add_argument("--rpc-timeout-s", type=float, default=120.0)
    p.add_argument("--start-timeout-s", type=float, default=240.0)
    p.add_argument("--no-peer", action="store_true")
    p.add_argument(
        "--copy-streams",
        type=int,
        default=DEFAULT_COPY_STREAMS,
        help="the workers' TorchAdapter copy_streams",
    )
    p.add_argument(
        "--cases",
        default="",
        help="only these cases, comma-separated: CASE or CASE:VARIANT "
        "(e.g. limit,ww_inplace:whole,ww_packed:1GiB); default all",
    )
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.cases = [c for c in args.cases.split(",") if c]
    args.packed_buckets = [parse_size(x) for x in args.packed_buckets.split(",") if x]
    args.inplace_buckets = [parse_size(x) for x in args.inplace_buckets.split(",") if x]
    args.packed_depths = [int(x) for x in args.packed_depths.split(",") if x]
    args.ckpt_default_bucket = parse_size(args.ckpt_default_bucket)
    if args.device == "cpu":
        # Dry runs share CPU tensors through files (the per-tensor baseline pickles them).
        torch.multiprocessing.set_sharing_strategy("file_system")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; use --device cpu for a dry run", file=sys.stderr)
        return 2
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
