"""weightwire against vLLM's own weight-reload path, in one real vLLM engine (CPU).

Run with the Python of the vLLM environment (``make install-vllm``)::

    .venv-vllm/bin/python bench/vllm_engine.py [--sizes 0.125,0.5] [--tp 1] [--reps 3] [--out DIR]

For each model size (a Qwen2-shaped float32 checkpoint of about that many GiB), one ``vllm.LLM``
(vllm-cpu, eager, ``weight_transfer_config={"backend": "weightwire"}``; TP ``--tp``) is started,
and in that same engine, repetition after repetition, these replace every weight:

``weightwire``      ``update_window``: vLLM's ``start_weight_update``, ``WeightPusher.push`` of the
                    full checkpoint over host shared memory from this process into the worker(s),
                    ``finish_weight_update(weight_version=...)`` and ``reset_prefix_cache``
``in place``        the same with the trainer's weights already in one host shared-memory buffer
                    (``WeightPusher.host_buffer``, ``push_flat``): no packing copy, the worker reads
                    them where they are (a trainer whose parameters live in that buffer)
``reload``          vLLM's ``reload_weights(weights_path=...)`` in every worker (``collective_rpc``)
                    from the same checkpoint as a safetensors directory in the page cache (tmpfs),
                    then ``reset_prefix_cache``: vLLM's own in-place reload, the path its weight
                    transfer offers on a machine without GPUs
``save+reload``     what a trainer does to use it: write the checkpoint (safetensors, tmpfs), then
                    ``reload``
``memcpy``          one in-process copy of the checkpoint's bytes: the copy limit on this machine

Both engine paths load through vLLM's layerwise reload, so the difference is how the bytes get
there. Each update is checked: after each method the engine's greedy tokens equal those it gave on
that checkpoint before (two checkpoints alternate, so every update changes the weights). Results:
DIR/vllm_engine.json (medians, ratios and every sample) and the printed table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
from vllm_cpu import CpuEngine, ModelSpec, checkpoint, save_checkpoint  # noqa: E402

GiB = 2**30


def spec_for(size_gib: float) -> ModelSpec:
    """A Qwen2 of about ``size_gib`` GiB in float32: hidden 1024, vocabulary 8192, layers as needed."""
    base = {"vocab": 8192, "hidden": 1024, "intermediate": 2816, "heads": 16, "kv_heads": 4, "head_dim": 64}
    one, two = nbytes(ModelSpec(**base, layers=1)), nbytes(ModelSpec(**base, layers=2))
    per_layer = two - one
    layers = max(1, round((size_gib * GiB - (one - per_layer)) / per_layer))
    return ModelSpec(**base, layers=layers)


def nbytes(spec: ModelSpec) -> int:
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    q = spec.heads * spec.head_dim
    layer = h * q + q + 2 * (h * kv + kv) + q * h + 3 * h * spec.intermediate + 2 * h
    return 4 * (2 * spec.vocab * h + h + spec.layers * layer)


class Bench:
    def __init__(self, engine: CpuEngine) -> None:
        from weightwire.adapters.vllm import worker_endpoints
        from weightwire.client import WeightPusher

        self.engine = engine
        self.pusher = WeightPusher(worker_endpoints(engine.llm), transport="host_shm", timeout_s=600)
        self.version = 0

    def weightwire(self, weights: dict[str, torch.Tensor]) -> float:
        from weightwire.adapters.vllm import update_window

        self.version += 1
        t0 = time.perf_counter()
        with update_window(self.engine.llm, self.version):
            self.pusher.push(weights, version=self.version)
        return time.perf_counter() - t0

    def flat(self, weights: dict[str, torch.Tensor]) -> list[Any]:
        """The checkpoint in one host shared-memory buffer, as a trainer keeping its weights there has it."""
        from weightwire.client import FlatBucket, layout_flat, pack_into

        items = list(weights.items())
        specs, size = layout_flat(items)
        buffer = self.pusher.host_buffer(size)
        pack_into(buffer, specs, [t for _, t in items])
        return [FlatBucket(buffer, specs)]

    def in_place(self, flat: list[Any]) -> float:
        from weightwire.adapters.vllm import update_window

        self.version += 1
        t0 = time.perf_counter()
        with update_window(self.engine.llm, self.version):
            self.pusher.push_flat(flat, version=self.version)
        return time.perf_counter() - t0

    def reload(self, path: Path) -> float:
        t0 = time.perf_counter()
        self.engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        self.engine.llm.reset_prefix_cache()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pusher.close()


def save_s(spec: ModelSpec, weights: dict[str, torch.Tensor], path: Path) -> float:
    t0 = time.perf_counter()
    save_checkpoint(spec, weights, path)
    return time.perf_counter() - t0


def memcpy_s(weights: dict[str, torch.Tensor]) -> float:
    dst = {k: torch.zeros_like(v) for k, v in weights.items()}  # touched: no page faults in the timed copy
    t0 = time.perf_counter()
    for k, v in weights.items():
        dst[k].copy_(v)
    return time.perf_counter() - t0


def check(got: list[list[int]], want: list[list[int]], method: str) -> None:
    if got != want:
        raise RuntimeError(f"after {method} the engine's tokens are {got}, expected {want}")


def run_size(size_gib: float, tp: int, reps: int, work: Path) -> dict[str, Any]:
    spec = spec_for(size_gib)
    a, b = checkpoint(spec, 1), checkpoint(spec, 2)
    total = sum(t.numel() * t.element_size() for t in a.values())
    if abs(total - nbytes(spec)) > 0:
        raise RuntimeError(f"size model is off: {total} bytes built, {nbytes(spec)} computed")
    path_a = save_checkpoint(spec, a, work / f"a-{size_gib}")
    t0 = time.perf_counter()
    engine = CpuEngine(path_a, tp=tp, pp=1, socket_dir=work / f"s-{size_gib}")
    start_s = time.perf_counter() - t0
    bench = Bench(engine)
    samples: dict[str, list[float]] = {
        "weightwire": [],
        "in_place": [],
        "reload": [],
        "save": [],
        "memcpy": [],
    }
    try:
        tokens_a = engine.generate()
        bench.weightwire(b)  # warm-up: the first push creates the shared-memory segments
        tokens_b = engine.generate()
        flat_a = bench.flat(a)
        if tokens_a == tokens_b:
            raise RuntimeError("checkpoints a and b give the same tokens: the checks would show nothing")
        for i in range(reps):
            # each method loads the checkpoint the engine does not hold, then the tokens are checked
            samples["save"].append(save_s(spec, a, work / f"ckpt-{size_gib}-{i}"))
            samples["reload"].append(bench.reload(work / f"ckpt-{size_gib}-{i}"))
            check(engine.generate(), tokens_a, "reload")
            samples["weightwire"].append(bench.weightwire(b))
            check(engine.generate(), tokens_b, "weightwire")
            samples["in_place"].append(bench.in_place(flat_a))
            check(engine.generate(), tokens_a, "in place")
            samples["weightwire"].append(bench.weightwire(b))
            check(engine.generate(), tokens_b, "weightwire")
            samples["memcpy"].append(memcpy_s(a))
            for f in (work / f"ckpt-{size_gib}-{i}").iterdir():
                f.unlink()
    finally:
        bench.close()
        engine.stop()
    med = {k: statistics.median(v) for k, v in samples.items()}
    med["save+reload"] = statistics.median(
        s + r for s, r in zip(samples["save"], samples["reload"], strict=True)
    )
    return {
        "size_gib": size_gib,
        "tp": tp,
        "bytes": total,
        "layers": spec.layers,
        "tensors": len(a),
        "engine_start_s": start_s,
        "median_s": med,
        "samples_s": samples,
        "ratios": {
            "weightwire_over_memcpy": med["weightwire"] / med["memcpy"],
            "in_place_over_memcpy": med["in_place"] / med["memcpy"],
            "reload_over_in_place": med["reload"] / med["in_place"],
            "reload_over_weightwire": med["reload"] / med["weightwire"],
            "save_reload_over_weightwire": med["save+reload"] / med["weightwire"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="0.125,0.5", help="comma-separated model sizes in GiB")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm-cpu"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = "/dev/shm" if os.path.isdir("/dev/shm") else None  # checkpoints in memory, as the page cache
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ww-vllm-bench-", dir=scratch) as work:
        for size in (float(s) for s in args.sizes.split(",")):
            res = run_size(size, args.tp, args.reps, Path(work))
            results.append(res)
            m, r = res["median_s"], res["ratios"]
            print(
                f"{size:5.3f} GiB TP{args.tp} ({res['bytes'] / GiB:.3f} GiB, {res['tensors']} tensors): "
                f"weightwire {m['weightwire'] * 1e3:8.1f} ms | in place {m['in_place'] * 1e3:8.1f} ms | reload {m['reload'] * 1e3:8.1f} ms "
                f"(x{r['reload_over_weightwire']:.2f}) | save+reload {m['save+reload'] * 1e3:8.1f} ms "
                f"(x{r['save_reload_over_weightwire']:.2f}) | memcpy {m['memcpy'] * 1e3:7.1f} ms "
                f"(weightwire = x{r['weightwire_over_memcpy']:.1f} memcpy) | engine start {res['engine_start_s']:.0f} s",
                flush=True,
            )
    import vllm

    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
    }
    (out / "vllm_engine.json").write_text(json.dumps({"machine": machine, "results": results}, indent=2))
    print(f"wrote {out / 'vllm_engine.json'}")


if __name__ == "__main__":
    main()
