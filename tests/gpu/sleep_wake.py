"""Sleep and wake of a real engine on a GPU, with weightwire pushing over CUDA IPC (issue 39).

    python3 tests/gpu/sleep_wake.py --engine sglang --out DIR   # SGLang 0.5.17 + torch_memory_saver
    python3 tests/gpu/sleep_wake.py --engine vllm --out DIR     # vLLM 0.26, enable_sleep_mode

Run on a CUDA machine whose Python has the engine and weightwire installed (the plugin / backend
loads by its entry point; ``tests/gpu/run_sleep_wake.sh`` installs the shared engine payloads).
This process is the engine's driver and the trainer: it writes a random bfloat16 Qwen2 checkpoint A,
starts the engine on it, holds A and B on the GPU and pushes them with ``WeightPusher`` (CUDA IPC)
into the worker inside the engine. The engine's own greedy tokens on A at start-up are the
reference for A; B's reference is the engine's tokens after the first push of B, checked again on
every later push of B. Steps (each check recorded in DIR/sleep_wake-<engine>.json):

- push B, A, B: tokens B, A, B (the later pushes go through the direct-copy path);
- SGLang: ``release_memory_occupation`` (weights, kv_cache, cuda_graph tags), a push refused with
  ENGINE_ASLEEP, version and state unchanged, the engine process alive; ``resume_memory_occupation``
  and push A, B: tokens A, B (the memory saver keeps virtual addresses; without a CPU backup the
  bytes are gone, so the first push after the wake goes through ``load_weights`` again);
- vLLM: for level 1 and level 2, ``LLM.sleep(level)``, a push refused with ENGINE_ASLEEP, version and
  state unchanged; ``wake_up(["weights"])``, ``wake_up(["kv_cache"])``; level 1 gives the pushed tokens
  again without a push (vLLM restored the bytes); then push A, B: tokens A, B.
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

PROMPTS = [[1, 17, 33, 65, 129], [1, 5, 9], [7, 300, 11, 42]]
NEW_TOKENS = 12
VOCAB, HIDDEN, LAYERS = 4096, 512, 4


def log(*args: Any) -> None:
    print("[sleep-wake]", *args, flush=True)


def checkpoint(seed: int, directory: Path | None = None) -> dict[str, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=1024,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init: distinct greedy tokens per seed
            p.normal_(0.0, 0.08)
    if directory is not None:
        model.save_pretrained(directory, safe_serialization=True)
    return {k: v.detach().to("cuda").contiguous() for k, v in model.state_dict().items()}


def status(pusher: Any) -> tuple[int, str]:
    (st,) = pusher.status().values()
    return st.weights_version, {1: "CONSISTENT", 2: "UPDATING", 3: "INCONSISTENT"}.get(
        st.state, str(st.state)
    )


def refused_push(pusher: Any, weights: dict[str, Any], version: int) -> dict[str, Any]:
    from weightwire.client import PushError

    try:
        pusher.push(weights, version=version)
    except PushError as e:
        (f,) = e.failures.values()
        return {"reason": f.reason, "message": f.message[:400]}
    return {"reason": None}


# ------------------------------------------------------------------------------------------ SGLang


def run_sglang(out: dict[str, Any], work: Path) -> None:
    import sglang
    import torch
    from sglang.srt.managers.io_struct import (
        ContinueGenerationReqInput,
        PauseGenerationReqInput,
    )
    from weightwire.adapters.sglang import discover
    from weightwire.client import WeightPusher

    check = Checks(out, log, detail_chars=300)
    sock = work / "sock"
    os.environ["WEIGHTWIRE_SGLANG_SOCKET_DIR"] = str(sock)
    os.environ["WEIGHTWIRE_SGLANG_PHASE_LOG"] = str(work / "phases.jsonl")
    a = checkpoint(1, work / "ckpt-a")
    b = checkpoint(2)
    t0 = time.perf_counter()
    engine = sglang.Engine(
        model_path=str(work / "ckpt-a"),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        attention_backend="triton",
        sampling_backend="pytorch",
        grammar_backend="none",
        disable_cuda_graph=True,
        enable_memory_saver=True,
        mem_fraction_static=0.15,
        max_total_tokens=8192,
        max_running_requests=4,
        random_seed=0,
        log_level="warning",
    )
    out["engine_start_s"] = round(time.perf_counter() - t0, 1)
    out["versions"] = {"sglang": sglang.__version__}
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    tm, loop = engine.tokenizer_manager, engine.loop

    def tokens() -> list[list[int]]:
        return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=sampling)]

    def pause() -> None:
        loop.run_until_complete(tm.pause_generation(PauseGenerationReqInput(mode="abort")))

    def resume() -> None:
        loop.run_until_complete(tm.continue_generation(ContinueGenerationReqInput()))

    def phases() -> dict[str, Any]:
        lines = (work / "phases.jsonl").read_text().splitlines()
        return json.loads(lines[-1]) if lines else {}

    try:
        ref = {"A": tokens()}
        pusher = WeightPusher(
            discover(str(sock), count=1, timeout_s=300), transport="cuda_ipc", timeout_s=300
        )
        version = 0
        for name, w in (("B", b), ("A", a), ("B", b)):
            version += 1
            pause()
            pusher.push(w, version=version)
            resume()
            got = tokens()
            ref.setdefault(name, got)
            check(got == ref[name], f"push {name} (v{version}) gives {name}'s tokens", phases())
        check(ref["A"] != ref["B"], "A and B give different tokens", ref)
        for tags in (["weights", "kv_cache", "cuda_graph"],):
            free_before = torch.cuda.mem_get_info()[0]
            engine.release_memory_occupation(tags=tags)
            freed = torch.cuda.mem_get_info()[0] - free_before
            check(freed > 0, f"release_memory_occupation({tags}) frees GPU memory", {"freed_bytes": freed})
            pause()
            got = refused_push(pusher, a, version + 1)
            check(
                got["reason"] == "ENGINE_ASLEEP", "a push while released is refused with ENGINE_ASLEEP", got
            )
            # The worker answering lives in the scheduler process: the engine is alive.
            check(
                status(pusher) == (version, "CONSISTENT"),
                "engine alive, version and state unchanged",
                status(pusher),
            )
            resume()
            engine.resume_memory_occupation(tags=tags)
            for name, w in (("A", a), ("B", b)):
                version += 1
                pause()
                pusher.push(w, version=version)
                resume()
                check(
                    tokens() == ref[name],
                    f"after resume: push {name} (v{version}) gives {name}'s tokens",
                    phases(),
                )
        out["tokens"] = ref
        pusher.close()
    finally:
        engine.shutdown()


# -------------------------------------------------------------------------------------------- vLLM


def run_vllm(out: dict[str, Any], work: Path) -> None:
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from weightwire.adapters.vllm import update_window, worker_endpoints
    from weightwire.client import WeightPusher

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ["WEIGHTWIRE_VLLM_SOCKET_DIR"] = str(work / "sock")
    check = Checks(out, log, detail_chars=300)
    a = checkpoint(1, work / "ckpt-a")
    b = checkpoint(2)
    t0 = time.perf_counter()
    llm = LLM(
        model=str(work / "ckpt-a"),
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3,
        max_model_len=256,
        max_num_seqs=8,
        enable_sleep_mode=True,
        attention_backend="TRITON_ATTN",
        weight_transfer_config={"backend": "weightwire"},
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    out["engine_start_s"] = round(time.perf_counter() - t0, 1)
    out["versions"] = {"vllm": vllm.__version__}
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def tokens() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    ref = {"A": tokens()}
    pusher = WeightPusher(worker_endpoints(llm, timeout_s=300), transport="cuda_ipc", timeout_s=300)
    version = 0

    def push(name: str, w: dict[str, Any], what: str) -> None:
        nonlocal version
        version += 1
        with update_window(llm, version):
            pusher.push(w, version=version)
        got = tokens()
        ref.setdefault(name, got)
        check(got == ref[name], f"{what}push {name} (v{version}) gives {name}'s tokens")

    for name, w in (("B", b), ("A", a), ("B", b)):
        push(name, w, "")
    check(ref["A"] != ref["B"], "A and B give different tokens", ref)
    held = "B"
    for level in (1, 2):
        free_before = torch.cuda.mem_get_info()[0]
        llm.sleep(level=level)
        freed = torch.cuda.mem_get_info()[0] - free_before
        check(freed > 0, f"sleep(level={level}) frees GPU memory", {"freed_bytes": freed})
        llm.start_weight_update()
        got = refused_push(pusher, a, version + 1)
        llm.finish_weight_update()
        check(
            got["reason"] == "ENGINE_ASLEEP",
            f"level {level}: a push while asleep is refused with ENGINE_ASLEEP",
            got,
        )
        check(
            status(pusher) == (version, "CONSISTENT"),
            f"level {level}: version and state unchanged",
            status(pusher),
        )
        llm.wake_up(tags=["weights"])
        llm.wake_up(tags=["kv_cache"])
        if level == 1:
            llm.reset_prefix_cache()
            check(tokens() == ref[held], "level 1: after wake_up the engine serves the pushed weights again")
        for name, w in (("A", a), ("B", b)):
            push(name, w, f"level {level}, after wake_up: ")
        held = "B"
    out["tokens"] = ref
    pusher.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("sglang", "vllm"), required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"engine": args.engine}
    try:
        import torch

        out["device"] = torch.cuda.get_device_name(0)
        out["torch"] = torch.__version__
        with tempfile.TemporaryDirectory() as tmp:
            (run_sglang if args.engine == "sglang" else run_vllm)(out, Path(tmp))
    except Exception:
        out["error"] = traceback.format_exc()
        log("ERROR", out["error"])
    checks = out.get("checks", [])
    out["passed"] = "error" not in out and bool(checks) and all(c["ok"] for c in checks)
    (out_dir / f"sleep_wake-{args.engine}.json").write_text(json.dumps(out, indent=1, default=str))
    log("RESULT", "PASS" if out["passed"] else "FAIL", f"{sum(c['ok'] for c in checks)}/{len(checks)} checks")
    sys.exit(0 if out["passed"] else 1)


if __name__ == "__main__":
    main()
