"""Mixture-of-experts pushes into a real SGLang engine on one GPU, bf16 and block FP8, and from every
trainer rank: the tokens after each push.

The GPU half of tests/sglang/test_sglang_moe.py and test_sglang_fp8_moe.py (SGLang runs no FP8
kernels on a CPU without AMX, and the CPU suites never start SGLang's Triton fused MoE), the SGLang
counterpart of tests/gpu/vllm_moe_run.py. On a CUDA machine whose Python has SGLang and weightwire
installed (``tests/gpu/run_sglang_moe.sh`` installs the shared SGLang payload; the plugin loads by
its entry point)::

    python3 tests/gpu/sglang_moe_run.py --out DIR [--only bf16|fp8|slices] [--eager]

The model is the tiny Qwen3-MoE of tests/fp8_moe_checks.py (tests/sglang/moe_checkpoints.py: 2
layers, 4 routed experts of 256 intermediate rows, top-2, a router ``mlp.gate``, head size 128),
written as checkpoint A (seed 1) and B (seed 2). Each half first takes the tokens of an engine
started from B, then starts ``sglang.Engine`` (TP1, Triton attention, CUDA graphs unless
``--eager``) from A and pushes from this process's CUDA tensors over CUDA IPC, the engine paused
(abort) around each push:

- **bf16**: the manifest lists exactly the checkpoint's names and shapes, every expert by its
  per-expert name; after pushing B the tokens equal the engine started from B, after pushing A back
  A's start-up tokens. Refused, version, state and tokens unchanged: a FULL update missing one
  expert's ``down_proj`` (INCOMPLETE_UPDATE), FP8 bytes into the bf16 router (DTYPE_MISMATCH).
- **fp8**: attention and experts block FP8 (``x.weight`` float8_e4m3fn, ``x.weight_scale_inv``
  float32 per 128 x 128 block, the router bf16; ``quantization_config`` as DeepSeek-V3's), so
  SGLang's fused MoE runs its block-FP8 Triton kernel; the same checks, and refused besides: a FULL
  update missing one expert's ``weight_scale_inv`` (INCOMPLETE_UPDATE), bf16 into the FP8 experts
  (DTYPE_MISMATCH).
- **slices**: the FP8 engine (the fp8 half's, or with ``--only slices`` one of its own that first
  takes A in one FULL push, which proves the regions a slices push lands in) takes pushes from
  trainer ranks, each its own process of one gloo world (this file with ``--trainer``, run by
  ``helpers.TrainerRanks``; ``helpers.slice_trainer_main``), every rank a source holding a
  ``Shard(0)`` part of every tensor: first 2 ranks (each half of every weight's rows, on the
  256-row experts' block edges), then 3 (thirds, cutting through the 128 x 128 blocks, as the CPU
  FP8 slices tests do; ``--slice-ranks`` chooses). Each push, B then A: the worker receives its
  kept bytes over the transfer group, and the tokens equal the engine started from B, then A's:
  SGLang's FP8 post-load processing ran after a slices push.

``--cpu`` rehearses on a CPU with a float32 model (``device="cpu"``, torch_native attention,
host shared memory instead of CUDA IPC; the CPU shims package of tests/support must be installed):
the bf16 half, then the slices half on that engine. DIR/sglang_moe_gpu.json holds every check;
exits non-zero when one fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))  # tests/: helpers (TrainerRanks, slice_trainer_main)
sys.path.insert(0, str(HERE))

import sglang_fp8_run  # noqa: E402  (puts tests/sglang on sys.path too)
import vllm_moe_run  # noqa: E402
from run_checks import Checks  # noqa: E402
from vllm_moe_run import MISSING_EXPERT, QUANTIZED, failure  # noqa: E402

ROUTER = "model.layers.0.mlp.gate.weight"
MISSING_SCALE = MISSING_EXPERT + "_scale_inv"
SEEDS = {"A": 1, "B": 2}


def log(*args: Any) -> None:
    print("[sglang-moe]", *args, flush=True)


def moe_spec(float32: bool) -> Any:
    import torch

    moe = vllm_moe_run.moe_checkpoints()
    return moe.MoESpec(
        arch=moe.QWEN3_MOE,
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=256,
        num_heads=2,
        kv_heads=2,
        dtype=torch.float32 if float32 else torch.bfloat16,
    )


def checkpoint(spec: Any, seed: int, fp8: bool) -> dict[str, Any]:
    """Checkpoint ``seed`` on the CPU; with ``fp8`` its attention and experts block-quantised."""
    from weightwire.core.fp8_quant import quantize_block

    out = {}
    for name, t in vllm_moe_run.moe_checkpoints().full_checkpoint(spec, seed).items():
        if fp8 and name.endswith(".weight") and any(f".{m}" in name for m in QUANTIZED):
            out[name], out[name + "_scale_inv"] = quantize_block(t)
        else:
            out[name] = t
    return out


def server_args_names() -> set[str]:
    """The arguments ``sglang.Engine`` takes (a dataclass's fields in 0.5.17, a msgspec Struct's in 0.5.23)."""
    import inspect

    from sglang.srt.server_args import ServerArgs

    return set(inspect.signature(ServerArgs).parameters)


def gpu_engine_kwargs(model: str, dtype: str, eager: bool) -> dict[str, Any]:
    """sglang_fp8_run.py's engine, with CUDA graphs unless ``eager``: decode graphs up to the 4
    running requests, prefill graphs (SGLang 0.5.17's default on CUDA) up to 64 tokens."""
    if "cuda_graph_max_bs_decode" in server_args_names():
        graphs = {"cuda_graph_max_bs_decode": 4, "cuda_graph_max_bs_prefill": 64}
    else:
        graphs = {"cuda_graph_max_bs": 4}
    return dict(
        model_path=model,
        skip_tokenizer_init=True,
        dtype=dtype,
        attention_backend="triton",
        sampling_backend="pytorch",
        grammar_backend="none",
        disable_cuda_graph=eager,
        **graphs,
        mem_fraction_static=0.10,
        max_total_tokens=4096,
        max_running_requests=4,
        random_seed=0,
        log_level="warning",
    )


class Engine(sglang_fp8_run.Engine):
    """``sglang.Engine`` in this process, with the GPU settings of sglang_fp8_run.py (CUDA graphs
    unless ``eager``) or the CPU ones of tests/sglang/real_engine.py."""

    def __init__(self, model: str, socket_dir: str, *, cpu: bool, eager: bool, dtype: str) -> None:
        import sglang

        os.environ["WEIGHTWIRE_SGLANG_SOCKET_DIR"] = socket_dir
        if cpu:
            from real_engine import engine_kwargs

            kwargs = engine_kwargs(model, dtype=dtype)
        else:
            kwargs = gpu_engine_kwargs(model, dtype, eager)
        t0 = time.perf_counter()
        self.engine = sglang.Engine(**kwargs)
        self.start_s = time.perf_counter() - t0

    def shutdown(self) -> None:
        self.engine.shutdown()
        gc.collect()

    def tokens_then_shutdown(self) -> list[list[int]]:
        try:
            return self.tokens()  # type: ignore[no-any-return]
        finally:
            self.shutdown()


class Half:
    """One model (bf16 or FP8): the tokens of an engine started from B, then an engine from A with
    a pusher over CUDA IPC (host shared memory with ``--cpu``)."""

    def __init__(self, args: Any, out: dict[str, Any], work: Path, label: str, fp8: bool) -> None:
        import torch

        self.args, self.out, self.label, self.fp8 = args, out, label, fp8
        self.check = Checks(out, log)
        # On a CPU: float32, except FP8 (SGLang's FP8 layers take bf16 or fp16 only).
        self.spec = moe_spec(args.cpu and not fp8)
        self.device = "cpu" if args.cpu else "cuda"
        self.cpu_weights = {k: checkpoint(self.spec, s, fp8) for k, s in SEEDS.items()}
        self.weights = {k: {n: t.to(self.device) for n, t in w.items()} for k, w in self.cpu_weights.items()}
        self.bf16_b = {
            n: t.to(self.device)
            for n, t in vllm_moe_run.moe_checkpoints().full_checkpoint(self.spec, 2).items()
        }
        self.dirs = {k: self.write(work / f"{label}-{k}", w) for k, w in self.cpu_weights.items()}
        self.work = work
        self.ref: dict[str, list[list[int]]] = {}
        self.ref["B"] = self.start("B", work / f"sock-{label}-b").tokens_then_shutdown()
        self.engine = self.start("A", work / f"sock-{label}")
        self.ref["A"] = self.engine.tokens()
        out[f"{label}_tokens"] = self.ref
        self.check(
            self.ref["A"] != self.ref["B"],
            f"{label}: engines started from A and from B give different tokens",
            self.ref,
        )
        self.check(self.engine.tokens() == self.ref["A"], f"{label}: the engine's tokens are deterministic")
        from weightwire.adapters.sglang import discover
        from weightwire.client import WeightPusher

        self.addresses = discover(str(work / f"sock-{label}"), count=1, timeout_s=300)
        self.pusher = WeightPusher(
            self.addresses, transport="host_shm" if args.cpu else "cuda_ipc", timeout_s=300
        )
        self.version = 0
        self.torch = torch

    def write(self, path: Path, weights: dict[str, Any]) -> str:
        moe = vllm_moe_run.moe_checkpoints()
        moe.write_model_dir(self.spec, str(path), weights)
        config = json.loads((path / "config.json").read_text())
        config.update(dtype=self.spec.dtype_name, torch_dtype=self.spec.dtype_name)
        if self.fp8:
            config["quantization_config"] = sglang_fp8_run.QUANT
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    def start(self, which: str, socket_dir: Path) -> Engine:
        engine = Engine(
            self.dirs[which],
            str(socket_dir),
            cpu=self.args.cpu,
            eager=self.args.eager,
            dtype=self.spec.dtype_name,
        )
        self.out.setdefault("engine_start_s", []).append(round(engine.start_s, 1))
        log(f"{self.label}: engine from {which} up in {engine.start_s:.1f} s")
        return engine

    # -- pushes and checks ---------------------------------------------------------------------------
    def push(self, weights: dict[str, Any], want: str, what: str, **kw: Any) -> list[list[int]]:
        self.version += 1
        t0 = time.perf_counter()
        results = self.engine.paused(lambda: self.pusher.push(weights, version=self.version, **kw))
        self.out.setdefault(f"{self.label}_push_s", []).append(round(time.perf_counter() - t0, 3))
        (r,) = results.values()
        got = self.engine.tokens()
        self.check(
            (r.version, r.state) == (self.version, "CONSISTENT") and got == self.ref[want],
            f"{self.label}: {what} (v{self.version}, {r.transport}) gives the tokens of an engine started "
            f"from {want}",
            {"state": r.state, "tokens": got},
        )
        return got

    def manifest(self) -> None:
        from weightwire.v1 import weight_transfer_pb2 as pb

        (m,) = self.pusher.manifests().values()
        names = {n: (pb.DType.Name(t.dtype), tuple(t.shape)) for n, t in m.tensors.items()}
        want = {n: tuple(t.shape) for n, t in self.cpu_weights["A"].items()}
        experts = sorted(n for n in names if ".mlp.experts." in n)
        spec = self.spec
        self.check(
            {n: s for n, (_, s) in names.items()} == want
            and len(experts) == spec.num_layers * spec.num_experts * 3 * (2 if self.fp8 else 1)
            and all(
                names[n][0] == ("DTYPE_FLOAT32" if n.endswith("_scale_inv") else "DTYPE_FLOAT8_E4M3FN")
                for n in experts
                if self.fp8
            )
            and names[ROUTER][0]
            == ("DTYPE_BFLOAT16" if self.spec.dtype_name == "bfloat16" else "DTYPE_FLOAT32"),
            f"{self.label}: the manifest lists exactly the checkpoint's names and shapes, every expert by "
            f"its per-expert name{' (float8_e4m3fn weight, float32 weight_scale_inv)' if self.fp8 else ''}",
            {
                "tensors": len(names),
                "experts": len(experts),
                "extra": sorted(set(names) - set(want))[:8],
                "missing": sorted(set(want) - set(names))[:8],
                "example": {n: names[n] for n in experts[:2]},
                "router": names.get(ROUTER),
            },
        )

    def pushes(self) -> None:
        self.push(self.weights["B"], "B", "push of B")
        self.push(self.weights["A"], "A", "push of A back")

    def refusals(self) -> None:
        from weightwire.core.errors import WeightwireError
        from weightwire.v1 import weight_transfer_pb2 as pb

        torch = self.torch
        b = self.weights["B"]
        cases: dict[str, dict[str, Any]] = {
            "INCOMPLETE_UPDATE (one expert's down_proj weight missing)": {
                n: t for n, t in b.items() if n != MISSING_EXPERT
            },
            "DTYPE_MISMATCH (FP8 bytes into the router)": {**b, ROUTER: b[ROUTER].to(torch.float8_e4m3fn)},
        }
        if self.fp8:
            cases["INCOMPLETE_UPDATE (one expert's weight_scale_inv missing)"] = {
                n: t for n, t in b.items() if n != MISSING_SCALE
            }
            cases["DTYPE_MISMATCH (bf16 into the FP8 experts)"] = {
                **b,
                **{n: t for n, t in self.bf16_b.items() if ".mlp.experts." in n},
            }
        held = self.engine.tokens()
        for what, weights in cases.items():
            try:
                self.engine.paused(lambda w=weights: self.pusher.push(w, version=self.version + 1))
                got: dict[str, Any] = {"reason": None}
            except WeightwireError as e:
                got = failure(e)
            (st,) = self.pusher.status().values()
            named = (
                MISSING_SCALE
                if "scale" in what
                else MISSING_EXPERT
                if "down_proj" in what
                else ROUTER
                if "router" in what
                else ".mlp.experts."
            )
            self.check(
                got["reason"] == what.split()[0]
                and named in got.get("message", "")
                and (st.weights_version, st.state) == (self.version, pb.WORKER_STATE_CONSISTENT),
                f"{self.label}: refused: {what}; version {self.version} and state unchanged",
                got,
            )
        self.check(
            self.engine.tokens() == held == self.ref["A"],
            f"{self.label}: after the refusals the engine serves A's tokens",
        )

    def slices(self, ranks: int) -> None:
        """Pushes of B, then A, from ``ranks`` trainer processes, every one a source."""
        from helpers import TrainerRanks

        manifests = self.pusher.refresh_manifests()
        self.check(
            all(m.receives_slices for m in manifests.values()),
            f"{self.label}: the worker publishes receives_slices",
        )
        kind = "fp8" if self.fp8 else "f32" if self.args.cpu else "bf16"
        t0 = time.perf_counter()
        trainers = TrainerRanks(
            __file__,
            ["--trainer", kind, *self.addresses],
            world=ranks,
            drop_env=["WEIGHTWIRE_SGLANG_SOCKET_DIR"],
        )
        self.out.setdefault("slice_trainers_ready_s", []).append(round(time.perf_counter() - t0, 1))
        try:
            for which in ("B", "A"):
                self.version += 1
                t0 = time.perf_counter()
                answers = self.engine.paused(
                    lambda seed=SEEDS[which]: trainers.push(version=self.version, seed=seed)
                )
                self.out.setdefault("slices_push_s", []).append(round(time.perf_counter() - t0, 3))
                results = answers[0].get("results", {})
                landed = all(a["ok"] for a in answers) and all(
                    (r["version"], r["state"], r["transport"])
                    == (self.version, "CONSISTENT", "transfer_group")
                    and r["bytes_received"] == manifests[addr].kept_bytes
                    for addr, r in results.items()
                )
                got = self.engine.tokens()
                self.check(
                    landed and bool(results) and got == self.ref[which],
                    f"{self.label}: {which} from {ranks} trainer ranks, every one a source over a gloo "
                    f"transfer group (v{self.version}): each worker received its kept bytes, and the "
                    f"tokens equal an engine started from {which}",
                    {
                        "answers": [
                            a if not a["ok"] else {"ok": True, "results": a["results"]} for a in answers[:1]
                        ]
                        + [{"ok": a["ok"]} for a in answers[1:]],
                        "kept_bytes": {a: m.kept_bytes for a, m in manifests.items()},
                        "tokens": got,
                    },
                )
        finally:
            trainers.close()

    def close(self) -> None:
        self.pusher.close()
        self.engine.shutdown()


def trainer_main(argv: list[str]) -> int:
    """One trainer rank (``--trainer KIND ADDR...``, started by ``helpers.TrainerRanks``)."""
    import torch.distributed.tensor as dt
    from helpers import slice_trainer_main

    kind, addresses = argv[0], argv[1:]
    spec = moe_spec(kind == "f32")
    # Every rank builds the same checkpoint and takes its own Shard(0) part without a scatter (gloo
    # has no float8 collectives; an FSDP trainer holds its shards already).
    scatter = dt.distribute_tensor

    def local_part(t: Any, mesh: Any, placements: Any) -> Any:
        return scatter(t, mesh, placements, src_data_rank=None)

    dt.distribute_tensor = local_part  # type: ignore[assignment]
    return slice_trainer_main(addresses, lambda seed: checkpoint(spec, seed, kind == "fp8"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=("bf16", "fp8", "slices"), help="run one half only")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (faster engine starts)")
    ap.add_argument("--cpu", action="store_true", help="rehearse on CPU: bf16 half (float32), then slices")
    ap.add_argument(
        "--slice-ranks",
        default="2,3",
        help="the slices half's trainer worlds, one after the other (3 ranks cut the experts' 128 x 128 blocks)",
    )
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "cpu_rehearsal": args.cpu,
        "eager": args.eager or args.cpu,
        "halves": args.only or "all",
    }
    if args.cpu:
        os.environ.pop("SGLANG_USE_CPU_ENGINE", None)  # it needs a CPU build of sgl_kernel
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "0")
    halves = {"bf16", "slices"} if args.cpu else {"bf16", "fp8", "slices"}
    if args.only:
        halves = {args.only}
    work = Path(tempfile.mkdtemp(prefix="ww-sgl-moe-"))  # short: Unix socket paths end at 107 bytes

    def save() -> None:
        (out_dir / "sglang_moe_gpu.json").write_text(json.dumps(out, indent=1, default=str))

    try:
        import sglang
        import torch

        out["device"] = "cpu" if args.cpu else torch.cuda.get_device_name(0)
        out["versions"] = {"sglang": sglang.__version__, "torch": torch.__version__}
        if args.cpu:  # what the GPU run will pass must at least be arguments of this SGLang
            unknown = set(gpu_engine_kwargs("m", "bfloat16", False)) - server_args_names()
            Checks(out, log)(
                not unknown, "the GPU run's engine arguments are fields of ServerArgs", sorted(unknown)
            )
        # The slices half runs on the FP8 engine (the bf16 one with --cpu: no FP8 kernels there).
        slices_on = "bf16" if args.cpu else "fp8"
        for label in ("bf16", "fp8"):
            if label not in halves and not (label == slices_on and "slices" in halves):
                continue
            half: Half | None = None
            try:
                half = Half(args, out, work, label, fp8=label == "fp8")
                if label in halves:
                    half.manifest()
                    half.pushes()
                    half.refusals()
                if label == slices_on and "slices" in halves:
                    if label not in halves:  # one FULL push proves the regions slices land in
                        half.push(half.weights["A"], "A", "FULL push of A before the slices")
                    for ranks in args.slice_ranks.split(","):
                        half.slices(int(ranks))
            except Exception:
                out[f"{label}_error"] = traceback.format_exc()
                log("ERROR", label, out[f"{label}_error"])
            finally:
                if half is not None:
                    try:
                        half.close()
                    except Exception:
                        out[f"{label}_close_error"] = traceback.format_exc()
                save()
    except Exception:
        out["error"] = traceback.format_exc()
        log("ERROR", out["error"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    checks = out.get("checks", [])
    errors = [k for k in out if k.endswith("error")]
    out["passed"] = not errors and bool(checks) and all(c["ok"] for c in checks)
    save()
    log("RESULT", "PASS" if out["passed"] else "FAIL", f"{sum(c['ok'] for c in checks)}/{len(checks)} checks")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trainer"]:
        sys.exit(trainer_main(sys.argv[2:]))
    sys.exit(main())
