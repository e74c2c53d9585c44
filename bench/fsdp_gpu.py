"""FSDP2 weights pushed from one trainer rank into a colocated worker, and what the gather costs.

Two parts, one process group of one rank (NCCL on a GPU, gloo with ``--device cpu``):

1. validation: a real ``weightwire serve --model demo`` worker on the same device; the demo model
   sharded with ``fully_shard``; ``push(model.state_dict())`` (own-device routing) and
   ``push(model.named_parameters(), routing="gathered")``: transport, the device the worker imported
   from, and the worker's dumped parameters bit for bit against the demo checkpoint.
2. benchmark: a ``bench/worker.py --mode weightwire`` worker holding ``--model`` (Qwen3-8B shapes by
   default); the same parameters pushed as FSDP2 DTensors (``push(fsdp.state_dict())``: the
   per-bucket gather into the staging buffer, the ranks' exchanges, the commit gate) and as
   already-gathered plain tensors (``push({name: dtensor.to_local()})``: the ordinary single-process
   path; with one rank the local shard is the whole tensor), interleaved, each checked against the
   worker's digest, with the peak device memory each adds.

Usage: ``python3 bench/fsdp_gpu.py --out DIR [--device cuda|cpu] [--model qwen3-8b] [--reps 15]``.
Writes ``DIR/fsdp.json`` and prints one summary line per part.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402
import models  # noqa: E402

LISTENING = "weightwire-serve listening "


def init_one_rank(device: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


def fsdp(module: torch.nn.Module, layers: torch.nn.Module | None) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    if layers is not None:
        for layer in layers.children():
            fully_shard(layer)
    fully_shard(module)
    return module


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# 1. validation
# ---------------------------------------------------------------------------------------------


def start_serve(device: str, dump_dir: str) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable,
        "-m",
        "weightwire.client.cli.main",
        "serve",
        "--model",
        "demo",
        "--device",
        device,
        "--dump-dir",
        dump_dir,
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(LISTENING):
        proc.kill()
        raise RuntimeError(f"weightwire serve did not start: {line!r}")
    return proc, line[len(LISTENING) :].strip()


def validate(device: str, out: dict[str, Any]) -> bool:
    from safetensors.torch import load_file
    from weightwire.adapters.torch.demo import DemoConfig, build_demo_model, expected_shard, full_checkpoint
    from weightwire.client import WeightPusher
    from weightwire.core.devices import device_ref_of
    from weightwire.core.manifest import ParallelRank

    config = DemoConfig()
    own = str(device_ref_of(torch.device(device, 0) if device == "cuda" else "cpu"))
    checks: dict[str, Any] = {"trainer_device": own}
    ok = True
    with tempfile.TemporaryDirectory() as dump_dir:
        proc, address = start_serve(device, dump_dir)
        try:
            with WeightPusher([address]) as pusher:
                for version, source, routing in (
                    (1, "state_dict", "own_device"),
                    (2, "named_parameters", "gathered"),
                ):
                    model = build_demo_model(config, ParallelRank(), device, seed=version)
                    fsdp(model, model.model.layers)
                    tensors = model.state_dict() if source == "state_dict" else model.named_parameters()
                    result = next(iter(pusher.push(tensors, version=version, routing=routing).values()))
                    got = load_file(os.path.join(dump_dir, f"{result.worker_id}-v{version}.safetensors"))
                    want = expected_shard(full_checkpoint(config, version), ParallelRank(), config)
                    exact = sorted(got) == sorted(want) and all(
                        torch.equal(got[n], t) for n, t in want.items()
                    )
                    case = {
                        "source": source,
                        "routing": routing,
                        "version": result.version,
                        "transport": result.transport,
                        "source_devices": list(result.source_devices),
                        "tensors_loaded": result.tensors_loaded,
                        "bit_exact": exact,
                    }
                    checks[f"v{version}"] = case
                    ok = ok and exact and result.version == version and list(result.source_devices) == [own]
                    ok = ok and result.transport == ("cuda_ipc" if device == "cuda" else "host_shm")
        finally:
            proc.terminate()
            proc.wait(30)
    checks["ok"] = ok
    out["validation"] = checks
    print(f"validation: {'OK' if ok else 'FAILED'} {json.dumps(checks)}", flush=True)
    return ok


# ---------------------------------------------------------------------------------------------
# 2. benchmark
# ---------------------------------------------------------------------------------------------


def benchmark(device: str, preset: str, reps: int, out: dict[str, Any], log_dir: Path) -> bool:
    from weightwire.client import WeightPusher

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = common.WorkerProc(
        "fsdp-bench", ["--mode", "weightwire", "--model", preset, "--device", device], log_dir, env
    )
    ok = True
    try:
        info = proc.wait_ready(240)
        shapes = models.tensor_shapes(preset)
        dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
        module = models.build_module(shapes, dev)
        models.refill(list(dict(module.named_parameters()).values()), seed=1)
        fsdp(module, getattr(getattr(module, "model", None), "layers", None))
        sd = module.state_dict()
        names = [t.name for t in shapes]
        # Already-gathered tensors: with one rank each DTensor's local shard is the whole tensor.
        plain = {n: sd[n].to_local() for n in names}
        model_bytes = sum(t.nbytes for t in shapes)
        times: dict[str, list[float]] = {"fsdp2_state_dict": [], "plain_tensors": []}
        peak: dict[str, int] = {}
        version = 1
        with WeightPusher([info["address"]], timeout_s=120) as pusher:

            def one(variant: str) -> None:
                nonlocal version
                sync(device)
                t0 = time.perf_counter()
                if variant == "fsdp2_state_dict":
                    pusher.push(sd, version=version)
                else:
                    pusher.push(plain, version=version)
                sync(device)
                times[variant].append((time.perf_counter() - t0) * 1e3)
                version += 1

            for variant in times:  # warm-up: staging buffers, IPC handles, NCCL communicators
                for _ in range(2):
                    one(variant)
                times[variant].clear()
            for variant in times:
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    one(variant)
                    peak[variant] = torch.cuda.max_memory_allocated() - before
                else:
                    one(variant)
                times[variant].clear()
            for _ in range(reps):
                for variant in times:
                    one(variant)
            # Where the difference goes: the one-rank conversion push() runs on the DTensors (to_local
            # of each, checked whole), timed alone in this process.
            from weightwire.client.inputs.dtensor_gather import named_items, single_rank_items

            conversions: list[float] = []
            for _ in range(max(reps, 5)):
                t0 = time.perf_counter()
                single_rank_items(named_items(sd), None)
                conversions.append((time.perf_counter() - t0) * 1e3)
            # The last push was plain tensors of the same values: the worker must hold them exactly.
            want = models.digest([plain[n] for n in names])
            got = proc.call({"cmd": "digest"})["digest"]
            ok = want == got
        summary = {
            v: {
                "median_ms": statistics.median(ts),
                "min_ms": min(ts),
                "reps": len(ts),
                "peak_device_bytes_added": peak.get(v),
            }
            for v, ts in times.items()
        }
        ratio = summary["fsdp2_state_dict"]["median_ms"] / summary["plain_tensors"]["median_ms"]
        out["benchmark"] = {
            "model": preset,
            "tensors": len(shapes),
            "model_bytes": model_bytes,
            "bucket_bytes": 64 * 1024 * 1024,
            "worker_digest_matches": ok,
            "variants": summary,
            "fsdp2_over_plain": ratio,
            "single_rank_items_ms": statistics.median(conversions),
        }
        print(
            f"benchmark {preset} ({model_bytes / 2**30:.2f} GiB, {len(shapes)} tensors): "
            f"fsdp2 {summary['fsdp2_state_dict']['median_ms']:.2f} ms, plain {summary['plain_tensors']['median_ms']:.2f} ms "
            f"(x{ratio:.3f}; the one-rank conversion alone {statistics.median(conversions):.2f} ms); digest {'OK' if ok else 'MISMATCH'}; peak device bytes added {peak}",
            flush=True,
        )
    finally:
        proc.stop()
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--model", default="qwen3-8b", choices=sorted(models.PRESETS))
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--skip-benchmark", action="store_true")
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    init_one_rank(args.device)
    out: dict[str, Any] = {"torch": torch.__version__, "device": args.device}
    if args.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    ok = validate(args.device, out)
    if not args.skip_benchmark:
        ok = benchmark(args.device, args.model, args.reps, out, out_dir) and ok
    (out_dir / "fsdp.json").write_text(json.dumps(out, indent=2, default=str))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
