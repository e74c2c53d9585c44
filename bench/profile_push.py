"""Where the trainer's time goes in the README's push, by function (cProfile), on a CUDA machine.

One ``worker.py --mode weightwire`` process holds the model; this process pushes
``model.named_parameters()`` of the same shapes (separately allocated parameters under their
checkpoint names, as ``bench_gpu.py``'s ``ww_params`` case) with every option at its default,
warms up, then profiles ``--reps`` pushes and prints the top functions by own and cumulative time,
plus the median wall time of a push with and without the profiler. Used to find the kept path's
fixed cost (issue 37); the timings that count are ``bench_gpu.py``'s.

    python3 bench/profile_push.py --models qwen3-1.7b,qwen3-8b-names --reps 50 --out OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from bench_gpu import param_module
from rig import make_rig
from weightwire.client import WeightPusher


def profile_model(preset: str, reps: int, out: Path) -> str:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    worker = common.WorkerProc(
        f"{preset}-profile",
        ["--mode", "weightwire", "--model", preset, "--device", dev],
        out,
        common.child_env("0" if dev == "cuda" else None),
    )
    try:
        worker.wait_ready()
        rig = make_rig(preset, torch.device(dev, 0) if dev == "cuda" else torch.device("cpu"), peer=False)
        module = param_module(rig)
        pusher = WeightPusher([worker.info["address"]])
        try:
            version = 0

            def push() -> float:
                nonlocal version
                version += 1
                t0 = time.perf_counter()
                pusher.push(module.named_parameters(), version=version)
                return (time.perf_counter() - t0) * 1e3

            for _ in range(5):
                push()
            plain = [push() for _ in range(reps)]
            worker.call({"cmd": "profile_start"})
            prof = cProfile.Profile()
            prof.enable()
            profiled = [push() for _ in range(reps)]
            prof.disable()
            worker.call({"cmd": "profile_stop", "path": str(out / f"worker-profile-{preset}.txt")})
        finally:
            pusher.close()
        text = io.StringIO()
        text.write(
            f"== {preset}: {len(rig.named)} tensors, {rig.model_bytes / 2**30:.2f} GiB; push median "
            f"{statistics.median(plain):.2f} ms (profiled {statistics.median(profiled):.2f} ms), {reps} reps\n"
        )
        for key in ("tottime", "cumulative"):
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats(key).print_stats(45)
        return text.getvalue()
    finally:
        worker.send({"cmd": "quit"})
        worker.proc.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-1.7b,qwen3-8b-names")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for preset in args.models.split(","):
        text = profile_model(preset, args.reps, out)
        (out / f"profile-{preset}.txt").write_text(text)
        print(text.splitlines()[0], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
