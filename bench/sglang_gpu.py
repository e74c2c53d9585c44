"""weightwire in a real SGLang engine on a GPU: a trainer process pushes over CUDA IPC.

On a CUDA machine whose Python has SGLang (0.5.17 on the torch 2.11 image) and weightwire
installed, so that the plugin loads by its entry point::

    python3 bench/sglang_gpu.py --out DIR [--reps 5] [--cuda-graph-check]

This process is the engine's driver: it writes a bfloat16 Qwen2 checkpoint A (about 0.6 GiB) and
starts ``sglang.Engine`` on it (one GPU, triton attention). A second process, the trainer, holds
checkpoints A and B on the same GPU and pushes them with ``WeightPusher`` over CUDA IPC (copied into one set of
parameters before each push, as an optimizer step writes a training loop's parameters) to the
worker the plugin started in the scheduler process. The driver pauses (abort) and resumes around
every push and compares the greedy tokens after each update:

- after pushing B, then A: the tokens equal the engine's own start-up tokens on A (a fresh engine
  on that checkpoint), and differ from them after B;
- SGLang's ``update_weights_from_tensor`` (CUDA tensors from this process) of B gives the same
  tokens as weightwire's push of B, and of A those of A;
- then ``--reps`` timed rounds of both methods on the same engine, each followed by the check.

This runs once per ``--modes`` entry, each on its own engine: ``load_weights`` (the worker loads
every update through SGLang's ``load_weights``, ``WEIGHTWIRE_SGLANG_DIRECT_COPY=0``) and
``direct`` (the default: from the second update on, the checked regions copied directly). The
worker appends each update's phase times to ``WEIGHTWIRE_SGLANG_PHASE_LOG``; every timed push
records them next to the trainer's time (``push - server``: the trainer's plan and export, gRPC
and the way back).

With ``--cuda-graph-check`` a second engine with CUDA graphs captured runs the push -> generate
check (in-place loads keep parameter addresses, so captured graphs must see the new weights).
``--cpu`` runs the same script on a CPU machine (a tiny model, host shared memory, torch_native
attention), to check the script itself before a GPU run. Results: DIR/sglang_gpu.json and the log
on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "sglang"))

PROMPTS = [[1, 17, 33, 65, 129], [1, 5, 9], [200, 2, 71, 8]]
SAMPLING = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
SPEC_ARGS = dict(
    family="qwen2",
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=5632,
    num_heads=16,
    kv_heads=4,
    num_layers=4,
)
CPU = "--cpu" in sys.argv
if CPU:
    SPEC_ARGS = dict(
        family="qwen2",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        kv_heads=2,
        num_layers=2,
    )
DEVICE = "cpu" if CPU else "cuda"
PUSH_CHECKPOINTS = "--push-checkpoints" in sys.argv


def log(*args: Any) -> None:
    print("[sglang-gpu]", *args, flush=True)


def spec() -> Any:
    import torch
    from checkpoints import ModelSpec

    return ModelSpec(**SPEC_ARGS, dtype=torch.bfloat16)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------- trainer


def trainer(socket_dir: str, bucket_bytes: int) -> None:
    """The trainer process: checkpoints A and B on this GPU, pushed over CUDA IPC on command."""
    import torch
    from checkpoints import full_checkpoint
    from weightwire.adapters.sglang import discover
    from weightwire.client import WeightPusher

    s = spec()
    ckpt = {seed: {k: v.to(DEVICE) for k, v in full_checkpoint(s, seed).items()} for seed in (1, 2)}
    if not CPU:
        torch.cuda.synchronize()
    transport = "host_shm" if CPU else "cuda_ipc"
    pusher = WeightPusher(
        discover(socket_dir, count=1, timeout_s=600),
        transport=transport,
        timeout_s=300,
        bucket_size_bytes=bucket_bytes or None,
    )
    print(json.dumps({"ready": True, "device": "cpu" if CPU else torch.cuda.get_device_name(0)}), flush=True)
    # As a training loop: one set of parameters, written in place before each push (an optimizer
    # step), so the worker keeps the same storages from one update to the next. Pushing the two
    # checkpoints' own tensors instead would make every FULL push name a different storage set,
    # which closes the other one in the worker (a set that is complete drops the rest), and every
    # push would open all its handles again (--push-checkpoints measures that).
    params = {k: v.clone() for k, v in ckpt[1].items()}
    for line in sys.stdin:
        cmd = json.loads(line)
        if PUSH_CHECKPOINTS:
            source = ckpt[cmd["seed"]]
        else:
            with torch.no_grad():
                for k, v in params.items():
                    v.copy_(ckpt[cmd["seed"]][k])
            source = params
        if not CPU:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = pusher.push(source, version=cmd["version"])
        elapsed = time.perf_counter() - t0
        (res,) = results.values()
        print(
            json.dumps(
                {
                    "push_s": elapsed,
                    "version": res.version,
                    "state": res.state,
                    "transport": res.transport,
                    "bytes": res.bytes_loaded,
                    "server_s": res.server_duration_s,
                }
            ),
            flush=True,
        )
    pusher.close()


class Trainer:
    def __init__(self, socket_dir: str, bucket_bytes: int) -> None:
        cmd = [sys.executable, __file__, "--trainer", socket_dir, str(bucket_bytes)] + (
            ["--cpu"] if CPU else []
        )
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def wait_ready(self) -> None:
        ready = self._read()
        log("trainer up on", ready["device"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"trainer exited with {self.proc.wait()}")
        return json.loads(line)  # type: ignore[no-any-return]

    def push(self, seed: int, version: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"seed": seed, "version": version}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------- driver


class Driver:
    def __init__(self, model: str, socket_dir: str, *, cuda_graph: bool, direct: bool = True) -> None:
        import sglang

        os.environ["WEIGHTWIRE_SGLANG_SOCKET_DIR"] = socket_dir
        os.environ["WEIGHTWIRE_SGLANG_DIRECT_COPY"] = "1" if direct else "0"
        self.phase_log = Path(socket_dir + "-phases.jsonl")
        os.environ["WEIGHTWIRE_SGLANG_PHASE_LOG"] = str(self.phase_log)
        t0 = time.perf_counter()
        device = (
            {"device": "cpu", "attention_backend": "torch_native"} if CPU else {"attention_backend": "triton"}
        )
        # Captured decode graphs only (small batch sizes: capture is quick); no compiled prefill graphs.
        graphs: dict[str, Any] = (
            {
                "cuda_graph_backend_decode": "full",
                "cuda_graph_backend_prefill": "disabled",
                "cuda_graph_max_bs_decode": 4,
            }
            if cuda_graph
            else {"disable_cuda_graph": True}
        )
        self.engine = sglang.Engine(
            model_path=model,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            sampling_backend="pytorch",
            grammar_backend="none",
            mem_fraction_static=0.15,
            max_total_tokens=8192,
            max_running_requests=4,
            random_seed=0,
            log_level="warning",
            **graphs,
            **device,
        )
        self.start_s = time.perf_counter() - t0
        self.version = 0

    def tokens(self) -> list[list[int]]:
        return [o["output_ids"] for o in self.engine.generate(input_ids=PROMPTS, sampling_params=SAMPLING)]

    def weight_version(self) -> str:
        out = self.engine.generate(input_ids=PROMPTS[:1], sampling_params=SAMPLING)
        return str(out[0]["meta_info"].get("weight_version"))

    def push(self, trainer: Trainer, seed: int) -> dict[str, Any]:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

        tm, loop = self.engine.tokenizer_manager, self.engine.loop
        self.version += 1
        t0 = time.perf_counter()
        loop.run_until_complete(tm.pause_generation(PauseGenerationReqInput(mode="abort")))
        answer = trainer.push(seed, self.version)
        loop.run_until_complete(tm.continue_generation(ContinueGenerationReqInput()))
        answer["pause_push_resume_s"] = time.perf_counter() - t0
        if (answer["version"], answer["state"]) != (self.version, "CONSISTENT"):
            raise RuntimeError(f"push of checkpoint {seed}: {answer}")
        lines = self.phase_log.read_text().splitlines() if self.phase_log.exists() else []
        phases = json.loads(lines[-1]) if lines else {}
        if phases.get("version") == self.version:
            answer["worker_phases_ms"] = phases
        return answer

    def from_tensor(self, weights: dict[str, Any]) -> float:
        import torch

        if not CPU:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if hasattr(self.engine, "begin_weight_update"):
            self.engine.begin_weight_update()
        ok, msg = self.engine.update_weights_from_tensor(list(weights.items()))[:2]
        if hasattr(self.engine, "end_weight_update"):
            self.engine.end_weight_update()
        elapsed = time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"update_weights_from_tensor: {msg}")
        return elapsed

    def shutdown(self) -> None:
        self.engine.shutdown()


def check(got: Any, want: Any, what: str, out: dict[str, Any]) -> None:
    out.setdefault("checks", []).append({"what": what, "ok": got == want})
    if got != want:
        raise RuntimeError(f"{what}: got {got}, expected {want}")
    log("ok:", what)


def run(args: argparse.Namespace, out: dict[str, Any]) -> None:
    import sglang
    import torch
    from checkpoints import full_checkpoint, write_model_dir

    s = spec()
    work = Path(tempfile.mkdtemp(prefix="ww-sgl-gpu-"))
    args.work_dir = str(work)
    # The trainer builds its copies while the engine starts (it waits for the worker's socket).
    trainer = Trainer(str(work / "sock"), args.bucket_mib << 20)
    ckpt = {seed: full_checkpoint(s, seed) for seed in (1, 2)}
    model = write_model_dir(s, str(work / "model-a"), ckpt[1])
    nbytes = sum(t.numel() * t.element_size() for t in ckpt[1].values())
    out.update(
        {
            "versions": {
                "sglang": sglang.__version__,
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "python": platform.python_version(),
            },
            "gpu": "none (--cpu)" if CPU else torch.cuda.get_device_name(0),
            "model": {**SPEC_ARGS, "dtype": "bfloat16", "bytes": nbytes},
            "command": " ".join(["python3", *sys.argv]),
        }
    )
    log(f"checkpoint: {nbytes / 2**30:.3f} GiB bf16, {len(ckpt[1])} tensors")
    tokens_a = tokens_b = None
    for n, mode in enumerate(args.modes.split(",")):
        if n:
            trainer = Trainer(str(work / f"sock-{mode}"), args.bucket_mib << 20)
        res: dict[str, Any] = {}
        out.setdefault("modes", {})[mode] = res
        driver = Driver(
            model,
            str(work / ("sock" if n == 0 else f"sock-{mode}")),
            cuda_graph=False,
            direct=mode == "direct",
        )
        res["engine_start_s"] = driver.start_s
        log(f"[{mode}] engine up in {driver.start_s:.1f} s")
        trainer.wait_ready()
        try:
            tokens_a, tokens_b = measure(args, driver, trainer, ckpt, res, mode, tokens_a, tokens_b)
        finally:
            trainer.stop()
            driver.shutdown()
        save(args, out)
    if args.cuda_graph_check:
        save(args, out)
        graph: dict[str, Any] = {}
        out["cuda_graph_check"] = graph
        trainer = Trainer(str(work / "sock-graph"), args.bucket_mib << 20)
        driver = Driver(model, str(work / "sock-graph"), cuda_graph=True, direct=True)
        graph["engine_start_s"] = driver.start_s
        trainer.wait_ready()
        try:
            check(driver.tokens(), tokens_a, "CUDA-graph engine on A gives the tokens of A", graph)
            driver.push(trainer, seed=2)
            check(driver.tokens(), tokens_b, "CUDA-graph engine after pushing B gives the tokens of B", graph)
            driver.push(trainer, seed=1)
            check(driver.tokens(), tokens_a, "CUDA-graph engine after pushing A gives the tokens of A", graph)
            # Both checkpoints' first loads went through load_weights; these two copy directly.
            for seed, want in ((2, tokens_b), (1, tokens_a)):
                answer = driver.push(trainer, seed)
                graph.setdefault("direct_pushes", []).append(answer)
                check(
                    driver.tokens(), want, f"CUDA-graph engine after a direct push of {'AB'[seed - 1]}", graph
                )
        finally:
            trainer.stop()
            driver.shutdown()


def measure(
    args: argparse.Namespace,
    driver: Driver,
    trainer: Trainer,
    ckpt: dict[int, Any],
    out: dict[str, Any],
    mode: str,
    tokens_a: Any,
    tokens_b: Any,
) -> tuple[Any, Any]:
    """The checks and timed rounds of one engine (module docstring); returns A's and B's tokens."""
    if tokens_a is None:
        tokens_a = driver.tokens()
        log("tokens on A (engine started from A):", tokens_a)
    else:
        check(driver.tokens(), tokens_a, f"[{mode}] engine on A gives the tokens of A", out)
    first = driver.push(trainer, seed=2)
    out["first_push"] = first
    got_b = driver.tokens()
    log(f"[{mode}] tokens after pushing B:", got_b, first)
    if tokens_b is None:
        tokens_b = got_b
        if tokens_b == tokens_a:
            raise RuntimeError("A and B give the same tokens: the checks would show nothing")
    else:
        check(got_b, tokens_b, f"[{mode}] weightwire push of B gives the tokens of B", out)
    out["weight_version_after_push"] = driver.weight_version()
    driver.push(trainer, seed=1)
    check(driver.tokens(), tokens_a, f"[{mode}] weightwire push of A gives the start-up tokens of A", out)
    local = {seed: {k: v.to(DEVICE) for k, v in ckpt[seed].items()} for seed in (1, 2)}
    driver.from_tensor(local[2])
    check(
        driver.tokens(),
        tokens_b,
        f"[{mode}] update_weights_from_tensor of B gives weightwire's tokens of B",
        out,
    )
    driver.from_tensor(local[1])
    check(
        driver.tokens(),
        tokens_a,
        f"[{mode}] update_weights_from_tensor of A gives the start-up tokens of A",
        out,
    )
    samples: dict[str, list[float]] = {
        "weightwire_push": [],
        "weightwire_pause_push_resume": [],
        "from_tensor": [],
        "weightwire_server": [],
    }
    phases: list[dict[str, Any]] = []
    for _ in range(args.reps):
        for seed, want in ((2, tokens_b), (1, tokens_a)):
            answer = driver.push(trainer, seed)
            samples["weightwire_push"].append(answer["push_s"])
            samples["weightwire_server"].append(answer["server_s"])
            samples["weightwire_pause_push_resume"].append(answer["pause_push_resume_s"])
            phases.append(answer.get("worker_phases_ms", {}))
            check(driver.tokens(), want, f"[{mode}] weightwire push of {'AB'[seed - 1]}", out)
        for seed, want in ((2, tokens_b), (1, tokens_a)):
            samples["from_tensor"].append(driver.from_tensor(local[seed]))
            check(driver.tokens(), want, f"[{mode}] update_weights_from_tensor of {'AB'[seed - 1]}", out)
    med = {k: statistics.median(v) for k, v in samples.items()}
    out["median_s"], out["samples_s"], out["worker_phases_ms"] = med, samples, phases
    keys = sorted({k for p in phases for k, v in p.items() if k.endswith("_ms")})
    out["median_worker_phases_ms"] = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in keys}
    out["ratio_weightwire_push_over_from_tensor"] = med["weightwire_push"] / med["from_tensor"]
    log(
        f"[{mode}] medians (ms):",
        {k: round(v * 1e3, 2) for k, v in med.items()},
        f"weightwire push / from_tensor = {out['ratio_weightwire_push_over_from_tensor']:.2f}x",
    )
    log(
        f"[{mode}] worker phases, medians (ms):",
        {k: round(v, 3) for k, v in out["median_worker_phases_ms"].items()},
    )
    return tokens_a, tokens_b


def save(args: argparse.Namespace, out: dict[str, Any]) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sglang_gpu.json").write_text(json.dumps(out, indent=1))


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--trainer":
        trainer(sys.argv[2], int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="sglang-gpu-results")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cuda-graph-check", action="store_true")
    ap.add_argument(
        "--bucket-mib",
        type=int,
        default=0,
        help="the trainer's bucket size where it packs (0: the library's default; CUDA tensors "
        "exported where they live are not packed)",
    )
    ap.add_argument(
        "--modes",
        default="load_weights,direct",
        help="worker load paths to measure, each on its own engine: load_weights, direct",
    )
    ap.add_argument("--cpu", action="store_true", help="check this script on a CPU machine")
    ap.add_argument(
        "--push-checkpoints",
        action="store_true",
        help="push the two checkpoints' own tensors alternately (two storage sets, each push "
        "reopening its handles) instead of one set of parameters written in place",
    )
    args = ap.parse_args()
    out: dict[str, Any] = {}
    try:
        run(args, out)
        out["outcome"] = "passed"
    except BaseException as e:
        out["outcome"] = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        save(args, out)
        log("outcome:", out.get("outcome"))
        if getattr(args, "work_dir", None):
            shutil.rmtree(args.work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
