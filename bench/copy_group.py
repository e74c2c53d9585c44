"""The worker's copy into its model, in one process: plain copies against grouped ones, by size bound.

``TorchAdapter.load`` copies parameters of at most ``group_copy_max_bytes`` in one grouped launch
(``torch._foreach_copy_``) and larger ones with one ``copy_`` each. This measures that load, for
several bounds, on the benchmark models (views into one flat buffer, as a worker gets them from a
mapped payload), next to the same bytes as one flat copy (the limit) and as a loop of ``copy_``
calls, and picks the bound that is best over all models (the smallest sum of each model's time
over its best time). Every load is checked bit for bit against the source. Run on a GPU::

    python3 bench/copy_group.py [--models qwen3-8b,qwen2.5-0.5b,qwen3-8b-names] [--out FILE]

``--device cpu`` runs the same on a CPU (a dry run of the logic; CPU copies have no launch cost
to save). Prints one table row per model and the chosen bound; ``--out`` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import models
from common import MiB
from rig import parse_size
from weightwire.adapters.torch import DEFAULT_GROUP_COPY_MAX_BYTES, TorchAdapter
from weightwire.client.inputs.plan import layout_flat, pack_into
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ParallelRank

_ALL = 1 << 62  # a bound above every tensor: everything grouped


def bound_label(n: int) -> str:
    if n == 0:
        return "each"
    if n >= _ALL:
        return "all"
    return f"{n // 1024}KiB" if n < MiB else f"{n // MiB}MiB"


def measure(
    preset: str, device: torch.device, bounds: list[int], reps: int, streams: list[int]
) -> dict[str, Any]:
    shapes = models.tensor_shapes(preset)
    module = models.build_module(shapes, device)
    src = models.random_tensors(shapes, device, seed=1)
    specs, size = layout_flat([(t.name, x) for t, x in zip(shapes, src, strict=True)])
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    pack_into(flat, specs, src)
    del src
    views = [(s.name, flat.narrow(0, s.offset_bytes, s.nbytes).view(s.dtype).view(s.shape)) for s in specs]
    params = dict(module.named_parameters())
    own = (
        DeviceRef.cuda("GPU-00000000-0000-0000-0000-000000000000")
        if device.type == "cuda"
        else DeviceRef.host()
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out: dict[str, Any] = {"model": preset, "tensors": len(specs), "bytes": sum(s.nbytes for s in specs)}
    scratch = [torch.empty_like(flat)]  # freed right after its timing (GPU memory)
    out["flat_copy_ms"] = common.median(common.time_reps(lambda: scratch[0].copy_(flat), sync, reps))
    scratch.clear()
    dsts = [params[name] for name, _ in views]
    srcs = [v for _, v in views]

    def loop() -> None:
        with torch.no_grad():
            for d, v in zip(dsts, srcs, strict=True):
                d.copy_(v)

    out["copy_loop_ms"] = common.median(common.time_reps(loop, sync, reps))
    exact = [True]

    def timed_load(**adapter_kw: Any) -> float:
        """Median time of ``TorchAdapter.load`` with these settings; then one load checked bit for bit."""
        adapter = TorchAdapter(module, rank=ParallelRank(), device=device, own_device=own, **adapter_kw)
        ms = common.median(common.time_reps(lambda: adapter.load(views), sync, reps))
        with torch.no_grad():
            for p in params.values():
                p.zero_()
        adapter.load(views)
        sync()
        exact[0] = exact[0] and all(torch.equal(params[name], v) for name, v in views)
        return ms

    out["load_ms"] = {bound_label(b): timed_load(group_copy_max_bytes=b) for b in bounds}
    # The default bound, its large copies spread over this many CUDA streams.
    by_streams = {str(n): timed_load(copy_streams=n) for n in streams}
    out["load_ms_by_streams"] = by_streams
    out["exact"] = exact[0]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-8b,qwen2.5-0.5b,qwen3-8b-names")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--bounds",
        default="0,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,all",
        help="group_copy_max_bytes values to measure (0: no grouping, all: everything grouped)",
    )
    p.add_argument(
        "--streams",
        default="1,2,3,4",
        help="copy_streams values to measure at the default bound (the large copies over that many CUDA streams)",
    )
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="", help="write the numbers here as JSON")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("copy_group: no CUDA device; use --device cpu for a dry run", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    bounds = [_ALL if b == "all" else parse_size(b) for b in args.bounds.split(",") if b]
    rows = []
    for preset in [m for m in args.models.split(",") if m]:
        row = measure(preset, device, bounds, args.reps, [int(n) for n in args.streams.split(",") if n])
        rows.append(row)
        loads = " ".join(f"{k}={v:.2f}" for k, v in row["load_ms"].items())
        loads += "; by copy streams: " + " ".join(
            f"{k}={v:.2f}" for k, v in row["load_ms_by_streams"].items()
        )
        print(
            f"{preset}: {row['tensors']} tensors, {row['bytes'] / MiB:.0f} MiB; flat copy {row['flat_copy_ms']:.2f} ms, "
            f"copy_ loop {row['copy_loop_ms']:.2f} ms; TorchAdapter.load by bound: {loads}; exact {row['exact']}",
            flush=True,
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    labels = [bound_label(b) for b in bounds]
    score = {lab: sum(r["load_ms"][lab] / min(r["load_ms"].values()) for r in rows) for lab in labels}
    best = min(labels, key=lambda lab: score[lab])
    print(
        "sum over models of load time / that model's best: "
        + " ".join(f"{k}={v:.3f}" for k, v in score.items())
    )
    print(f"best bound: {best} (default in TorchAdapter: {bound_label(DEFAULT_GROUP_COPY_MAX_BYTES)})")
    if args.out:
        env = common.environment({"bench": "copy_group", "argv": common.public_argv(sys.argv[1:])})
        Path(args.out).write_text(
            json.dumps({"env": env, "models": rows, "score": score, "best": best}, indent=1, default=str)
        )
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
