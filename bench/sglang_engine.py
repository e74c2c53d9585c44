"""weightwire against SGLang's own weight-update paths, in one real SGLang engine (CPU).

Run with the Python of an environment that has SGLang and weightwire (``make install-sglang``)::

    .venv/bin/python bench/sglang_engine.py [--sizes 0.1,0.25,0.5,1.0] [--reps 3] [--out DIR]

For each model size (a Qwen2-shaped float32 checkpoint of about that many GiB), one
``sglang.Engine`` (TP1, ``torch_native`` attention; the plugin loaded by its entry point) is
started, and in that same engine, repetition after repetition, these replace every weight:

``weightwire``   pause (abort), ``WeightPusher.push`` of the full checkpoint over host shared
                 memory from this process to the worker in the scheduler process, resume
``from_tensor``  SGLang's ``Engine.update_weights_from_tensor`` with the same tensors (inside
                 ``begin_weight_update``/``end_weight_update`` where the release has them)
``from_disk``    SGLang's ``Engine.update_weights_from_disk`` of the same checkpoint as a
                 safetensors directory (in the page cache: the file was just written)
``memcpy``       one in-process copy of the checkpoint's bytes: the copy limit on this machine

Each update is checked: after each method the engine's greedy tokens equal those the engine gave
on that checkpoint before (two checkpoints alternate, so every update changes the weights). With
``--sleep-on-idle-size`` one more engine (``sleep_on_idle=True``) is started at that size, and
weightwire's push there is compared with the first engine's (the idle scheduler must be woken,
or each update step would wait up to 1 s for its poll). Results: DIR/sglang_engine.json (medians
and every sample) and the printed table.
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
sys.path.insert(0, str(ROOT / "tests" / "sglang"))
from checkpoints import QWEN2, ModelSpec, full_checkpoint, write_model_dir  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
SAMPLING = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
GiB = 2**30


def spec_for(size_gib: float) -> ModelSpec:
    """A Qwen2 of about ``size_gib`` GiB in float32: hidden 1024, vocabulary 8192, layers as needed."""
    base = ModelSpec(
        QWEN2,
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=2816,
        num_heads=16,
        kv_heads=4,
        num_layers=1,
    )
    per_layer = nbytes(ModelSpec(**{**base.__dict__, "num_layers": 2})) - nbytes(base)
    fixed = nbytes(base) - per_layer
    layers = max(1, round((size_gib * GiB - fixed) / per_layer))
    return ModelSpec(**{**base.__dict__, "num_layers": layers})


def nbytes(spec: ModelSpec) -> int:
    from checkpoints import checkpoint_shapes

    return sum(torch.Size(s).numel() * 4 for s in checkpoint_shapes(spec).values())


class Bench:
    def __init__(self, engine: Any, spec: ModelSpec, socket_dir: str) -> None:
        from weightwire.adapters.sglang import discover
        from weightwire.client import WeightPusher

        self.engine = engine
        self.spec = spec
        self.pusher = WeightPusher(
            discover(socket_dir, count=1, timeout_s=60), transport="host_shm", timeout_s=600
        )
        self.version = 0
        self.has_session = hasattr(engine, "begin_weight_update")
        # Each push as the trainer saw it, and the update's duration as the worker measured it.
        self.push_split: list[dict[str, float]] = []

    def tokens(self) -> list[list[int]]:
        return [o["output_ids"] for o in self.engine.generate(input_ids=PROMPTS, sampling_params=SAMPLING)]

    def weightwire(self, weights: dict[str, torch.Tensor]) -> float:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

        tm, loop = self.engine.tokenizer_manager, self.engine.loop
        self.version += 1
        t0 = time.perf_counter()
        loop.run_until_complete(tm.pause_generation(PauseGenerationReqInput(mode="abort")))
        t1 = time.perf_counter()
        (result,) = self.pusher.push(weights, version=self.version).values()
        self.push_split.append({"push_s": time.perf_counter() - t1, "worker_s": result.server_duration_s})
        loop.run_until_complete(tm.continue_generation(ContinueGenerationReqInput()))
        return time.perf_counter() - t0

    def from_tensor(self, weights: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        if self.has_session:
            self.engine.begin_weight_update()
        ok, msg = self.engine.update_weights_from_tensor(list(weights.items()))[:2]
        if self.has_session:
            self.engine.end_weight_update()
        elapsed = time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"update_weights_from_tensor: {msg}")
        return elapsed

    def from_disk(self, path: str) -> float:
        t0 = time.perf_counter()
        ok, msg = self.engine.update_weights_from_disk(path)[:2]
        elapsed = time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"update_weights_from_disk: {msg}")
        return elapsed

    def close(self) -> None:
        self.pusher.close()


def memcpy_s(weights: dict[str, torch.Tensor]) -> float:
    # Destination pages touched first, as a loaded model's parameters are.
    dst = {k: torch.zeros_like(v) for k, v in weights.items()}
    t0 = time.perf_counter()
    for k, v in weights.items():
        dst[k].copy_(v)
    return time.perf_counter() - t0


def start_engine(model: str, socket_dir: str, *, sleep_on_idle: bool) -> Any:
    import sglang

    os.environ["WEIGHTWIRE_SGLANG_SOCKET_DIR"] = socket_dir
    return sglang.Engine(
        model_path=model,
        device="cpu",
        attention_backend="torch_native",
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        skip_tokenizer_init=True,
        max_total_tokens=2048,
        max_running_requests=4,
        dtype="float32",
        random_seed=0,
        log_level="error",
        sleep_on_idle=sleep_on_idle,
    )


def run_size(size_gib: float, reps: int, work: Path) -> dict[str, Any]:
    spec = spec_for(size_gib)
    a, b = full_checkpoint(spec, seed=1), full_checkpoint(spec, seed=2)
    total = sum(t.numel() * t.element_size() for t in a.values())
    path_a = write_model_dir(spec, str(work / f"a-{size_gib}"), a)
    socket_dir = str(work / f"s{size_gib}")
    t0 = time.perf_counter()
    engine = start_engine(path_a, socket_dir, sleep_on_idle=False)
    start_s = time.perf_counter() - t0
    bench = Bench(engine, spec, socket_dir)
    samples: dict[str, list[float]] = {"weightwire": [], "from_tensor": [], "from_disk": [], "memcpy": []}
    try:
        tokens_a = bench.tokens()
        bench.weightwire(b)  # warm-up: first push opens the shared-memory segments
        tokens_b = bench.tokens()
        if tokens_a == tokens_b:
            raise RuntimeError("checkpoints a and b give the same tokens: the checks would show nothing")
        for _ in range(reps):
            # each method loads the checkpoint the engine does not hold, then the tokens are checked
            samples["from_tensor"].append(bench.from_tensor(a))
            check(bench.tokens(), tokens_a, "from_tensor")
            samples["weightwire"].append(bench.weightwire(b))
            check(bench.tokens(), tokens_b, "weightwire")
            samples["from_disk"].append(bench.from_disk(path_a))
            check(bench.tokens(), tokens_a, "from_disk")
            samples["weightwire"].append(bench.weightwire(b))
            check(bench.tokens(), tokens_b, "weightwire")
            samples["memcpy"].append(memcpy_s(a))
    finally:
        bench.close()
        engine.shutdown()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "size_gib": size_gib,
        "bytes": total,
        "layers": spec.num_layers,
        "tensors": len(a),
        "engine_start_s": start_s,
        "median_s": med,
        "samples_s": samples,
        "weightwire_push_split": bench.push_split,
        "ratios": {
            "weightwire_over_memcpy": med["weightwire"] / med["memcpy"],
            "from_tensor_over_weightwire": med["from_tensor"] / med["weightwire"],
            "from_disk_over_weightwire": med["from_disk"] / med["weightwire"],
        },
    }


def run_sleep_on_idle(size_gib: float, reps: int, work: Path) -> dict[str, Any]:
    """weightwire's push in an engine with sleep_on_idle, against one without, same size."""
    spec = spec_for(size_gib)
    ckpts = [full_checkpoint(spec, seed=s) for s in (1, 2)]
    path = write_model_dir(spec, str(work / f"idle-{size_gib}"), ckpts[0])
    out: dict[str, Any] = {"size_gib": size_gib}
    for sleep in (False, True):
        socket_dir = str(work / f"idle-s{int(sleep)}")
        engine = start_engine(path, socket_dir, sleep_on_idle=sleep)
        bench = Bench(engine, spec, socket_dir)
        try:
            bench.tokens()
            times = [bench.weightwire(ckpts[(i + 1) % 2]) for i in range(2 * reps + 1)][1:]
        finally:
            bench.close()
            engine.shutdown()
        out["sleep_on_idle" if sleep else "busy_polling"] = {
            "median_s": statistics.median(times),
            "samples_s": times,
        }
    out["ratio_sleep_over_busy"] = out["sleep_on_idle"]["median_s"] / out["busy_polling"]["median_s"]
    return out


def check(got: list[list[int]], want: list[list[int]], method: str) -> None:
    if got != want:
        raise RuntimeError(f"after {method}, the engine generated {got}, expected {want}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.1,0.25,0.5,1.0", help="model sizes in GiB, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--sleep-on-idle-size",
        type=float,
        default=0.1,
        help="size for the sleep_on_idle comparison (0: skip)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sglang-cpu-2core"))
    args = ap.parse_args()
    import sglang

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": {"sglang": sglang.__version__, "torch": torch.__version__},
        "command": " ".join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
        "sizes": [],
    }
    with tempfile.TemporaryDirectory(prefix="ww-sgl-bench-") as tmp:
        work = Path(tmp)
        for size in [float(s) for s in args.sizes.split(",") if s]:
            r = run_size(size, args.reps, work)
            results["sizes"].append(r)
            m = r["median_s"]
            print(
                f"{r['bytes'] / GiB:5.2f} GiB ({r['tensors']} tensors): weightwire {m['weightwire'] * 1e3:8.1f} ms  "
                f"from_tensor {m['from_tensor'] * 1e3:8.1f} ms ({r['ratios']['from_tensor_over_weightwire']:.2f}x)  "
                f"from_disk {m['from_disk'] * 1e3:8.1f} ms ({r['ratios']['from_disk_over_weightwire']:.2f}x)  "
                f"memcpy {m['memcpy'] * 1e3:7.1f} ms (weightwire {r['ratios']['weightwire_over_memcpy']:.2f}x of it)",
                flush=True,
            )
            (out / "sglang_engine.json").write_text(json.dumps(results, indent=1))
        if args.sleep_on_idle_size > 0:
            r = run_sleep_on_idle(args.sleep_on_idle_size, args.reps, work)
            results["sleep_on_idle"] = r
            print(
                f"sleep_on_idle at {args.sleep_on_idle_size} GiB: {r['sleep_on_idle']['median_s'] * 1e3:.1f} ms vs "
                f"{r['busy_polling']['median_s'] * 1e3:.1f} ms busy-polling ({r['ratio_sleep_over_busy']:.2f}x)",
                flush=True,
            )
    (out / "sglang_engine.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
