"""Block-FP8 pushes into a real SGLang engine on one GPU: the tokens after each push.

SGLang runs FP8 linear layers only on a GPU (or an AMX CPU), so this is the GPU half of
tests/sglang/test_sglang_fp8.py. On a CUDA machine whose Python has SGLang and weightwire installed
(the plugin loads by its entry point; docs/validation.md has the payload and the command)::

    python3 tests/gpu/sglang_fp8_run.py --out DIR

A random Qwen2 (head_dim 128; every linear layer FP8 with one float32 scale per 128 x 128 block,
``quantization_config`` as DeepSeek-V3's) is written as checkpoint A; a second, B, from other
random bf16 weights. This process starts ``sglang.Engine`` on A and pushes from its own CUDA
tensors over CUDA IPC, bf16 weights quantised on the trainer side by ``quantize_for``. Checks:

- the engine's tokens are deterministic; after pushing B they differ from A's start-up tokens and
  equal those of a second engine started from B on disk (the push is the checkpoint load); after
  pushing A back, A's start-up tokens (the trainer pushes the checkpoints' own FP8 bytes);
- a PARTIAL push of one layer's FP8 weight and scale, then of A's again: A's tokens;
- noted, not checked: transformers (bfloat16, each FP8 layer's input quantised per 128-element
  group as SGLang's kernel does, times the dequantised weight in float32) on A and B, how many
  tokens agree (this random model's argmax flips under the kernels' other rounding; the engine's
  own load of the same checkpoint is the reference); and ``quantize_for`` on the GPU: how many
  bytes differ from the CPU's quantisation, and whether its push gives the same tokens;
- refused before anything loads, the tokens unchanged: bf16 weights without ``quantize_for``
  (``DTYPE_MISMATCH``), a FULL update missing one ``weight_scale_inv`` (``INCOMPLETE_UPDATE``).

Writes DIR/sglang_fp8_gpu.json; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tests" / "sglang"))

PROMPTS = [[1, 17, 33, 65, 129], [1, 5, 9], [200, 2, 71, 8]]
NEW = 12
SAMPLING = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
QUANT = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "fmt": "e4m3",
}


def log(*args: Any) -> None:
    print("[sglang-fp8]", *args, flush=True)


def spec() -> Any:
    import torch
    from checkpoints import QWEN2, ModelSpec

    return ModelSpec(
        QWEN2,
        kv_heads=2,
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_heads=4,
        num_layers=2,
        dtype=torch.bfloat16,
        fp8_block=128,
    )


def is_linear_weight(name: str) -> bool:
    return name.endswith("_proj.weight")


def fp8_checkpoint(bf16: dict[str, Any]) -> dict[str, Any]:
    from weightwire.core.fp8_quant import quantize_block

    out = {}
    for name, t in bf16.items():
        if is_linear_weight(name):
            out[name], out[name + "_scale_inv"] = quantize_block(t)
        else:
            out[name] = t
    return out


def dequantised(fp8: dict[str, Any]) -> dict[str, Any]:
    import torch
    from weightwire.core.fp8_quant import dequantize_block

    return {
        n: dequantize_block(t, fp8[n + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t.float()
        for n, t in fp8.items()
        if not n.endswith("_scale_inv")
    }


def write_model(path: Path, weights: dict[str, Any]) -> str:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = spec().hf_config()
    config.quantization_config = QUANT
    config.save_pretrained(str(path))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "generation_config.json").write_text("{}")
    return str(path)


def hf_tokens(weights: dict[str, Any], fp8: dict[str, Any]) -> list[list[int]]:
    """transformers' Qwen2 in bfloat16 (the engine's dtype) on these weights, each FP8 linear layer
    computed as the engine's kernel does: its input quantised to e4m3 per 128-element group of a
    token (SGLang's ``per_token_group_quant_fp8``), times the dequantised weight, in float32."""
    import torch
    from transformers import AutoModelForCausalLM
    from weightwire.core.fp8_quant import FP8, FP8_MAX, dequantize_block

    config = spec().hf_config()
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(
        {k: v.to(torch.bfloat16) for k, v in weights.items()}, strict=False
    )
    assert not missing and not unexpected, (missing, unexpected)
    model = model.cuda().eval()

    def fp8_linear(module: Any, w: Any) -> None:
        bias = module.bias

        def forward(x: Any) -> Any:
            g = x.float().reshape(*x.shape[:-1], -1, 128)
            scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
            xq = ((g * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).reshape(x.shape)
            y = xq @ w.t()
            return (y if bias is None else y + bias.float()).to(x.dtype)

        module.forward = forward

    for name, module in model.named_modules():
        if name + ".weight" in fp8 and fp8[name + ".weight"].dtype == FP8:
            fp8_linear(
                module, dequantize_block(fp8[name + ".weight"], fp8[name + ".weight_scale_inv"]).cuda()
            )
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            g = model.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(g[0, len(p) :].tolist())
    del model
    torch.cuda.empty_cache()
    return out


class Engine:
    def __init__(self, model: str, socket_dir: str) -> None:
        import sglang

        os.environ["WEIGHTWIRE_SGLANG_SOCKET_DIR"] = socket_dir
        t0 = time.perf_counter()
        self.engine = sglang.Engine(
            model_path=model,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            attention_backend="triton",
            sampling_backend="pytorch",
            grammar_backend="none",
            disable_cuda_graph=True,
            mem_fraction_static=0.10,
            max_total_tokens=4096,
            max_running_requests=4,
            random_seed=0,
            log_level="warning",
        )
        self.start_s = time.perf_counter() - t0

    def tokens(self) -> list[list[int]]:
        return [o["output_ids"] for o in self.engine.generate(input_ids=PROMPTS, sampling_params=SAMPLING)]

    def paused(self, fn: Any) -> Any:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

        tm, loop = self.engine.tokenizer_manager, self.engine.loop
        loop.run_until_complete(tm.pause_generation(PauseGenerationReqInput(mode="abort")))
        try:
            return fn()
        finally:
            loop.run_until_complete(tm.continue_generation(ContinueGenerationReqInput()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import sglang
    import torch
    from checkpoints import full_checkpoint
    from weightwire.adapters.sglang import discover
    from weightwire.client import PlanError, WeightPusher
    from weightwire.core.fp8_quant import quantize_for

    result: dict[str, Any] = {
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "checks": [],
    }

    def check(ok: bool, what: str, detail: Any = None) -> None:
        result["checks"].append({"what": what, "ok": bool(ok), "detail": detail})
        log("ok:" if ok else "FAILED:", what, "" if detail is None else detail)

    def note(what: str, detail: Any) -> None:
        result.setdefault("notes", []).append({"what": what, "detail": detail})
        log("note:", what, detail)

    def save() -> None:
        Path(args.out, "sglang_fp8_gpu.json").write_text(json.dumps(result, indent=1))

    work = Path(tempfile.mkdtemp(prefix="ww-sgl-fp8-"))
    bf16 = {seed: full_checkpoint(spec(), seed) for seed in (1, 2)}
    fp8 = {seed: fp8_checkpoint(bf16[seed]) for seed in (1, 2)}
    model_a = write_model(work / "a", fp8[1])
    model_b = write_model(work / "b", fp8[2])
    try:
        eng = Engine(model_a, str(work / "sock"))
        log(f"engine up in {eng.start_s:.1f} s")
        tokens_a = eng.tokens()
        log("start-up tokens on A:", tokens_a)
        pusher = WeightPusher(discover(str(work / "sock"), count=1, timeout_s=300), transport="cuda_ipc")
        manifests = list(pusher.manifests().values())
        (m,) = manifests
        scales = sorted(n for n in m.tensors if n.endswith("weight_scale_inv"))
        result["manifest"] = {"tensors": len(m.tensors), "scales": len(scales)}
        check(len(scales) == 7 * spec().num_layers, "manifest lists every linear layer's weight_scale_inv")
        cuda = {s: {k: v.cuda() for k, v in bf16[s].items()} for s in (1, 2)}
        # The trainer's FP8 tensors: the checkpoint's own bytes (quantised on the CPU), so a push
        # and a load from disk hold the same bits; quantize_for on the GPU is compared with them.
        own = {s: {k: v.cuda() for k, v in fp8[s].items()} for s in (1, 2)}
        check(eng.tokens() == tokens_a, "the engine's tokens are deterministic (A twice)")
        on_gpu = dict(quantize_for(cuda[2].items(), manifests))
        differ = sum(
            int((on_gpu[n].cpu().view(torch.uint8) != fp8[2][n].view(torch.uint8)).sum())
            for n in fp8[2]
            if n.endswith(("weight", "weight_scale_inv"))
            and fp8[2][n].dtype in (torch.float8_e4m3fn, torch.float32)
        )
        note("quantize_for on the GPU: bytes differing from the CPU's quantisation of B", differ)

        def push(tensors: Any, version: int, **kw: Any) -> Any:
            return eng.paused(lambda: pusher.push(tensors, version=version, **kw))

        t0 = time.perf_counter()
        res = push(own[2], 1)
        result["push_b_s"] = time.perf_counter() - t0
        (r,) = res.values()
        check(
            (r.version, r.state, r.transport) == (1, "CONSISTENT", "cuda_ipc"),
            "push of B commits",
            r.transport,
        )
        tokens_b = eng.tokens()
        check(tokens_b != tokens_a, "B's tokens differ from A's", tokens_b)
        push(own[1], 2)
        check(eng.tokens() == tokens_a, "pushing A back gives A's start-up tokens")

        # PARTIAL: one layer's gate projection (weight and scale) from B, then A's again.
        one = "model.layers.1.mlp.gate_proj."
        part_b = {n: t for n, t in own[2].items() if n.startswith(one)}
        push(part_b, 3, scope="partial")
        mixed = eng.tokens()
        part_a = {n: t for n, t in own[1].items() if n.startswith(one)}
        push(part_a, 4, scope="partial")
        check(
            eng.tokens() == tokens_a, "a PARTIAL push of one weight and its scale, then A's again: A's tokens"
        )
        result["tokens_with_one_layer_of_b"] = mixed

        # Refusals, before anything loads.
        try:
            push(cuda[2], 5)
            check(False, "bf16 into FP8 weights refused")
        except PlanError as e:
            check(
                e.reason == "DTYPE_MISMATCH" and "float8_e4m3fn" in str(e),
                "bf16 into FP8 weights refused",
                str(e)[:300],
            )
        scale = "model.layers.0.self_attn.o_proj.weight_scale_inv"
        try:
            push({n: t for n, t in own[2].items() if n != scale}, 5)
            check(False, "FULL update without one scale refused")
        except PlanError as e:
            check(
                e.reason == "INCOMPLETE_UPDATE" and scale in str(e),
                "FULL update without one scale refused",
                str(e)[:300],
            )
        check(eng.tokens() == tokens_a, "after the refusals: A's tokens")
        (st,) = pusher.status().values()
        check(st.weights_version == 4, "after the refusals: version 4", st.weights_version)
        # A bf16 trainer's push through quantize_for (quantised on this GPU), then A's own bytes.
        push(on_gpu, 5)
        tokens_b_gpu = eng.tokens()
        note("tokens after pushing quantize_for's B equal the pushed B's", tokens_b_gpu == tokens_b)
        push(own[1], 6)
        check(eng.tokens() == tokens_a, "then A's bytes again: A's tokens")
        pusher.close()
        eng.engine.shutdown()
        save()

        eng_b = Engine(model_b, str(work / "sock-b"))
        check(eng_b.tokens() == tokens_b, "an engine started from B on disk gives the pushed B's tokens")
        eng_b.engine.shutdown()
        save()

        for seed, got in ((1, tokens_a), (2, tokens_b)):
            ref = hf_tokens(dequantised(fp8[seed]), fp8[seed])
            agree = [
                sum(int(a == b) for a, b in zip(x, y, strict=True)) for x, y in zip(got, ref, strict=True)
            ]
            result[f"hf_tokens_{'AB'[seed - 1]}"] = ref
            note(
                f"transformers on {'AB'[seed - 1]}'s dequantised weights (FP8 activations emulated): tokens agreeing",
                agree,
            )
    except Exception as e:  # recorded, then the exit status says it
        import traceback

        result["error"] = traceback.format_exc()
        log("ERROR", repr(e))
    save()
    failed = [c["what"] for c in result["checks"] if not c["ok"]]
    log("RESULT", "passed" if not failed and "error" not in result else f"failed: {failed}")
    return 1 if failed or "error" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
