"""A receiving process for the benchmarks: one engine worker holding a synthetic model.

Started by ``bench_gpu.py`` and ``bench_cpu.py`` (never by the product). Three receivers, chosen by
``--mode``, all loading into the same kind of model (``models.build_module``: parameters named by
checkpoint names, this worker's TP slice of each):

``weightwire``   a real weightwire worker: ``weightwire.server.serve`` over a ``TorchAdapter``,
                 instrumented from outside (wrapped methods) to time each update's handle opens,
                 device copies and commit on a clock shared with the trainer (CLOCK_MONOTONIC).
``per_tensor``   the common peer approach: one CUDA IPC handle per tensor, each sent pickled
                 (``torch.multiprocessing.reductions.reduce_tensor``) over a local socket and
                 rebuilt here, one message and ack per tensor (OpenRLHF) or all tensors in one
                 message (SGLang's ``update_weights_from_tensor``). Pickle is part of the approach
                 being measured; weightwire never unpickles anything.
``ckpt_engine``  checkpoint-engine's own receiver, ``checkpoint_engine.worker.update_weights_from_ipc``.

Control is line-based: the first stdout line is ``{"ready": ...}`` (JSON); then each JSON command
on stdin gets one JSON line back. Commands: ``mem``, ``reset_peak``, ``stats``, ``digest``,
``release``, ``update`` (per_tensor/ckpt_engine: run one update), ``quit``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from weightwire.adapters.torch import DEFAULT_COPY_STREAMS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models

now = time.perf_counter_ns  # CLOCK_MONOTONIC on Linux: comparable across processes of one host


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Receiver:
    """What every mode shares: the model, memory readings, digests."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.device == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.shapes = models.tensor_shapes(args.model)
        self.module = models.build_module(
            self.shapes, self.device, tp_rank=args.tp_rank, tp_size=args.tp_size
        )
        self.params: dict[str, torch.Tensor] = dict(self.module.named_parameters())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.model_bytes = sum(p.numel() * p.element_size() for p in self.params.values())

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def ready_info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "tensors": len(self.params),
            "model_bytes": self.model_bytes,
            "device": str(self.device),
        }

    def mem(self) -> dict[str, int]:
        out = {"rss_kib": proc_status_kib("VmRSS"), "hwm_kib": proc_status_kib("VmHWM")}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            out.update(
                allocated=torch.cuda.memory_allocated(self.device),
                max_allocated=torch.cuda.max_memory_allocated(self.device),
                reserved=torch.cuda.memory_reserved(self.device),
                device_free=free,
                device_total=total,
            )
        return out

    def reset_peak(self) -> dict[str, int]:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self.mem()

    def digest(self) -> list[int]:
        return models.digest([self.params[t.name] for t in self.shapes])

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        name = cmd.get("cmd")
        if name == "mem":
            return self.mem()
        if name == "reset_peak":
            return self.reset_peak()
        if name == "digest":
            return {"digest": self.digest()}
        return self.handle_mode(cmd)

    def handle_mode(self, cmd: dict[str, Any]) -> dict[str, Any]:
        raise ValueError(f"unknown command {cmd!r}")

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# weightwire
# ---------------------------------------------------------------------------------------------


class WeightwireReceiver(Receiver):
    """A real weightwire worker, timed from outside by wrapping its adapter, importers and commit."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        from weightwire.adapters.torch import TorchAdapter
        from weightwire.core.devices import DeviceRef, cuda_device_uuid
        from weightwire.core.manifest import ParallelRank
        from weightwire.server import serve
        from weightwire.server.worker import service as service_mod

        own = (
            DeviceRef.cuda(cuda_device_uuid(self.device.index))
            if self.device.type == "cuda"
            else DeviceRef.host()
        )
        rank = ParallelRank(
            tp_rank=args.tp_rank, tp_size=args.tp_size, dp_rank=args.dp_rank, dp_size=args.dp_size
        )
        self.adapter = TorchAdapter(
            self.module,
            rank=rank,
            device=self.device,
            own_device=own,
            tp_rules=models.TP_RULES,
            engine="bench",
            worker_id=args.worker_id or None,
            copy_streams=args.copy_streams,
        )
        self.server = serve(self.adapter, own_device=own)
        self.service = self.server.service
        self._lock = threading.Lock()
        self._current: dict[str, Any] | None = None
        self._done: list[dict[str, Any]] = []
        self._instrument(service_mod)

    def _instrument(self, service_mod: Any) -> None:
        svc, adapter = self.service, self.adapter
        begin, prepare = svc.begin_update, adapter.prepare_load

        def timed_begin(header: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = now()
            with self._lock:
                self._current = {
                    "version": int(header.version),
                    "t_header_ns": t0,
                    "open_ns": 0,
                    "opens": 0,
                    "copy_ns": 0,
                    "loads": 0,
                    "tensors": 0,
                }
            update = begin(header, *args, **kwargs)
            with self._lock:
                if self._current is not None:
                    self._current["begin_ns"] = now() - t0
            return update

        def record_copy(took: int, tensors: int) -> None:
            with self._lock:
                if self._current is not None:
                    self._current["copy_ns"] += took
                    self._current["loads"] += 1
                    self._current["tensors"] += tensors

        # TorchAdapter.load is prepare_load(views)(); the worker also keeps prepared loads and runs
        # them for later buckets of the same layout. Timed: the checks and slicing (when they run)
        # plus the copies and the device synchronisation, per load.
        def timed_prepare(views: Sequence[tuple[str, torch.Tensor]]) -> Callable[[], None]:
            t0 = now()
            run = prepare(views)
            prepared_ns = now() - t0

            first = True

            def timed_run() -> None:
                nonlocal first
                t1 = now()
                run()
                took = now() - t1
                record_copy(took + (prepared_ns if first else 0), len(views))
                first = False

            return timed_run

        svc.begin_update = timed_begin  # type: ignore[method-assign]
        adapter.prepare_load = timed_prepare  # type: ignore[method-assign]
        for imp in svc.importers.values():
            self._wrap_open(imp)

        commit = service_mod.Update.commit
        receiver = self

        def timed_commit(update: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = now()
            result = commit(update, msg, *args, **kwargs)
            t1 = now()
            with receiver._lock:
                rec = receiver._current
                if rec is not None and rec["version"] == update.version:
                    rec.update(
                        commit_ns=t1 - t0,
                        t_commit_start_ns=t0,
                        t_commit_end_ns=t1,
                        handles_opened=int(result.handles_opened),
                        bytes_loaded=int(result.bytes_loaded),
                        server_duration_ns=int(result.duration_ns),
                        buckets=int(result.bucket_count),
                    )
                    receiver._done.append(rec)
                    receiver._current = None
            return result

        service_mod.Update.commit = timed_commit

        bucket = service_mod.Update._bucket

        def timed_bucket(update: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
            # Everything the worker does for one bucket: checks, selection, open, views, load.
            t0 = now()
            try:
                return bucket(update, msg, *args, **kwargs)
            finally:
                t1 = now()
                with receiver._lock:
                    rec = receiver._current
                    if rec is not None:
                        rec["bucket_ns"] = rec.get("bucket_ns", 0) + t1 - t0
                        rec.setdefault("t_first_bucket_ns", t0)
                        rec["t_last_bucket_end_ns"] = t1

        service_mod.Update._bucket = timed_bucket

    def _wrap_open(self, imp: Any) -> None:
        orig: Callable[..., Any] = imp.open

        def timed_open(payload: Any, ctx: Any) -> Any:
            t0 = now()
            mapping, opened = orig(payload, ctx)
            took = now() - t0
            with self._lock:
                if self._current is not None:
                    self._current["open_ns"] += took
                    self._current["opens"] += int(bool(opened))
            return mapping, opened

        imp.open = timed_open

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "address": self.server.address}

    def handle_mode(self, cmd: dict[str, Any]) -> dict[str, Any]:
        name = cmd.get("cmd")
        if name == "stats":
            with self._lock:
                done, self._done = self._done, []
            return {"updates": done, "open_mappings": self.service.open_mappings()}
        if name == "release":
            before = self.service.open_mappings()
            for imp in self.service.importers.values():
                imp.release()
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()
            return {"released": before, "open_mappings": self.service.open_mappings()}
        raise ValueError(f"unknown command {cmd!r}")

    def close(self) -> None:
        self.server.stop(grace=1.0)


# ---------------------------------------------------------------------------------------------
# The peer approach: one CUDA IPC handle per tensor, pickled per tensor
# ---------------------------------------------------------------------------------------------


def rebuild_shared(
    handle: tuple[Callable[..., torch.Tensor], tuple[Any, ...]], device_index: int | None
) -> torch.Tensor:
    """Rebuild a tensor from ``reduce_tensor``'s output, on this process's index of its GPU (the
    same substitution OpenRLHF and checkpoint-engine make: CUDA_VISIBLE_DEVICES differs per process)."""
    fn, args = handle
    if device_index is not None and fn.__name__ == "rebuild_cuda_tensor":
        largs = list(args)
        largs[6] = device_index  # storage_device
        args = tuple(largs)
    return fn(*args)


class PerTensorReceiver(Receiver):
    def handle_mode(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd.get("cmd") != "update":
            raise ValueError(f"unknown command {cmd!r}")
        from multiprocessing.connection import Client

        device_index = cmd.get("device_index")
        open_ns = copy_ns = 0
        rebuilt = 0
        messages = 0
        distinct: set[bytes] = set()
        t_first = t_last = 0
        with Client(cmd["addr"], family="AF_UNIX", authkey=bytes.fromhex(cmd["authkey"])) as conn:
            while True:
                msg = conn.recv()  # unpickles: part of the approach being measured
                if msg is None:
                    break
                messages += 1
                _kind, items = msg
                if t_first == 0:
                    t_first = now()
                t0 = now()
                tensors = [(name, rebuild_shared(h, device_index)) for name, h in items]
                t1 = now()
                for (name, t), (_, h) in zip(tensors, items, strict=True):
                    self.params[name].copy_(t)
                    args = h[1]
                    if len(args) > 7 and isinstance(args[7], bytes):
                        distinct.add(args[7])
                self.sync()
                t2 = now()
                rebuilt += len(tensors)
                del tensors
                open_ns += t1 - t0
                copy_ns += t2 - t1
                conn.send(b"")
                t_last = now()
        return {
            "open_ns": open_ns,
            "copy_ns": copy_ns,
            "handles_opened": rebuilt,
            "distinct_memory_handles": len(distinct),
            "messages": messages,
            "t_first_ns": t_first,
            "t_last_ns": t_last,
        }


# ---------------------------------------------------------------------------------------------
# checkpoint-engine's receiver
# ---------------------------------------------------------------------------------------------


class _CpuDeviceModule:
    """Lets checkpoint-engine's receiver run without a GPU (protocol dry runs on CPU only)."""

    def synchronize(self) -> None:
        pass

    def ipc_collect(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass


class _CpuDeviceManager:
    def __init__(self) -> None:
        self.device_type = "cpu"
        self.device_module = _CpuDeviceModule()


class CkptEngineReceiver(Receiver):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        import zmq
        from checkpoint_engine import worker as ce_worker

        self.ce = ce_worker
        self.zmq_ctx = zmq.Context()
        self._open_ns = 0
        self._opens = 0
        orig_rebuild = ce_worker._rebuild_ipc

        def timed_rebuild(handle: Any, device_id: int | None = None) -> torch.Tensor:
            t0 = now()
            if self.device.type == "cpu":
                out = handle[0](*handle[1])  # a CPU share: no device index to substitute
            else:
                out = orig_rebuild(handle, device_id)
            self._open_ns += now() - t0
            self._opens += 1
            return out

        ce_worker._rebuild_ipc = timed_rebuild
        if self.device.type == "cpu":
            ce_worker.DeviceManager = _CpuDeviceManager

    def handle_mode(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd.get("cmd") != "update":
            raise ValueError(f"unknown command {cmd!r}")
        self._open_ns = 0
        self._opens = 0
        stats = {"copy_ns": 0, "buckets": 0, "tensors": 0}

        def run(weights: list[tuple[str, torch.Tensor]]) -> None:
            t0 = now()
            for name, t in weights:
                self.params[name].copy_(t)
            self.sync()
            stats["copy_ns"] += now() - t0
            stats["buckets"] += 1
            stats["tensors"] += len(weights)

        t0 = now()
        self.ce.update_weights_from_ipc(self.zmq_ctx, cmd["addr"], cmd.get("device_index") or 0, run=run)
        return {**stats, "open_ns": self._open_ns, "handles_opened": self._opens, "receiver_ns": now() - t0}


MODES: dict[str, type[Receiver]] = {
    "weightwire": WeightwireReceiver,
    "per_tensor": PerTensorReceiver,
    "ckpt_engine": CkptEngineReceiver,
}


def profile_command(cmd: dict[str, Any]) -> dict[str, Any]:
    """Profile every thread of this process (yappi, CPU clock) between ``profile_start`` and
    ``profile_stop``, which writes the top functions to ``cmd["path"]`` (``profile_push.py``)."""
    try:
        import yappi
    except ImportError:
        return {"error": "yappi is not installed"}
    if cmd["cmd"] == "profile_start":
        yappi.set_clock_type(cmd.get("clock", "cpu"))
        yappi.clear_stats()
        yappi.start(builtins=True)
        return {"ok": True}
    yappi.stop()
    stats = yappi.get_func_stats()
    with open(cmd["path"], "w", encoding="utf-8") as f:
        for key in ("tsub", "ttot"):
            f.write(f"== sorted by {key} ({yappi.get_clock_type()} clock)\n")
            stats.sort(key, "desc")
            for s in list(stats)[:60]:
                f.write(f"{s.ncall:>8} {s.tsub:10.4f} {s.ttot:10.4f}  {s.module}:{s.lineno}({s.name})\n")
        f.write("== threads\n")
        for t in yappi.get_thread_stats():
            f.write(f"{t.name} {t.id} {t.ttot:.4f} {t.sched_count}\n")
    return {"ok": True}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=sorted(MODES), required=True)
    p.add_argument("--model", required=True, choices=sorted(models.PRESETS))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--worker-id", default="")
    p.add_argument(
        "--copy-streams",
        type=int,
        default=DEFAULT_COPY_STREAMS,
        help="TorchAdapter copy_streams (the weightwire mode)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode == "per_tensor" and args.device == "cpu":
        torch.multiprocessing.set_sharing_strategy("file_system")
    receiver = MODES[args.mode](args)
    out = sys.stdout
    out.write(json.dumps({"ready": True, **receiver.ready_info()}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            cmd = json.loads(line)
            if cmd.get("cmd") == "quit":
                break
            if cmd.get("cmd") in ("profile_start", "profile_stop"):
                out.write(json.dumps(profile_command(cmd)) + "\n")
                out.flush()
                continue
            try:
                reply = receiver.handle(cmd)
            except Exception as e:  # report, keep serving: the orchestrator decides what to do
                reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        with contextlib.suppress(Exception):
            receiver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
