"""One rank of SGLang's real Qwen3-MoE with a block-FP8 checkpoint, on CPU, serving its weights
through weightwire's SGLang plugin (a process of tests/sglang/test_sglang_fp8_moe.py).

SGLang 0.5.23 cannot run FP8 kernels on a CPU without AMX (its FP8 post-load processing asserts
it), so no engine can start here; this process builds what a scheduler builds short of that:
SGLang's parallel state over gloo (``sglang_cpu.init_parallel``, with expert parallelism when
``--ep`` is 2), its model class with ``Fp8Config(weight_block_size=[128, 128])`` (experts through
``Fp8MoEMethod``: ``w13_weight`` / ``w2_weight`` float8_e4m3fn, ``w13_weight_scale_inv`` /
``w2_weight_scale_inv`` float32 per block), weights from checkpoint ``--ckpt`` through the model's
own ``load_weights``, and the worker through the plugin's ``start_worker`` on the fake scheduler of
rank_worker.py (no update sessions: their end step is the post-load processing that needs AMX).

Commands on stdin, one per line; each answers ``ok ...`` or ``error <message>`` on stdout:
``dump PATH`` (every parameter, by SGLang name, into a torch file), ``reference CKPT PATH`` (a
fresh model loaded from checkpoint CKPT by SGLang's ``load_weights`` alone, dumped),
``manifest_error BLOCK`` (the manifest builder's refusal, or "none", were the experts' FP8 blocks
BLOCK x BLOCK), ``quit``. Prints ``ready <address>`` once serving.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

# This directory (sglang_cpu, rank_worker) and tests/ (fp8_moe_checks, rank_fleet).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sglang_cpu
import torch
from fp8_moe_checks import SPEC


def build(config: Any) -> torch.nn.Module:
    """SGLang's Qwen3-MoE under the current parallel state, block-FP8 linear layers and experts."""
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return Qwen3MoeForCausalLM(config, quant_config=sglang_cpu.fp8_config(128))
    finally:
        torch.set_default_dtype(previous)


def load(config: Any, ckpt: str) -> torch.nn.Module:
    """A model built and filled from ``ckpt`` (a safetensors file) by SGLang's ``load_weights``."""
    from safetensors.torch import load_file

    model = build(config)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan")) if p.is_floating_point() and p.element_size() > 1 else p.zero_()
    model.load_weights(load_file(ckpt).items())
    return model


def dump(model: torch.nn.Module, path: str) -> None:
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, path)


def manifest_error(model: torch.nn.Module, config: Any, block: int) -> str:
    """What the manifest builder says of this model were its experts' FP8 blocks ``block`` x
    ``block`` (SGLang checks its own block size when it builds the layers, so the model is built
    with 128 and the experts' method changed afterwards)."""
    from weightwire.adapters.layout_rules import ManifestError
    from weightwire.adapters.sglang.manifest import model_layout

    methods = [m.quant_method for n, m in model.named_modules() if n.endswith("mlp.experts")]
    saved = [(m, m.weight_block_size) for m in methods]
    try:
        for m, _ in saved:
            m.weight_block_size = [block, block]
        model_layout(model, config)
        return "none"
    except ManifestError as e:
        return str(e).replace("\n", " ")
    finally:
        for m, size in saved:
            m.weight_block_size = size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--init-port", type=int, required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--socket-dir", required=True)
    ap.add_argument(
        "--dump-dir", required=True, help="where the fake scheduler writes each committed version"
    )
    args = ap.parse_args()

    sglang_cpu.prepare_cpu_import()
    sglang_cpu.init_parallel(
        rank=args.rank, world_size=2, tp_size=2, pp_size=1, init_port=args.init_port, ep_size=args.ep
    )
    config = SPEC.hf_config()
    model = load(config, args.ckpt)

    os.environ["WEIGHTWIRE_SGLANG_SOCKET_DIR"] = args.socket_dir
    from rank_worker import FakeScheduler, FakeSchedulerLoop
    from weightwire.adapters.sglang.plugin import start_worker

    scheduler = FakeScheduler(model, config, args.dump_dir, sessions=False)
    worker = start_worker(scheduler)
    loop = FakeSchedulerLoop(scheduler)
    loop.start()
    print(f"ready {worker.address}", flush=True)

    for line in sys.stdin:
        cmd, *rest = line.split()
        try:
            if cmd == "quit":
                break
            if cmd == "dump":
                dump(model, rest[0])
                answer = ""
            elif cmd == "reference":
                dump(load(config, rest[0]), rest[1])
                answer = ""
            elif cmd == "manifest_error":
                answer = manifest_error(model, config, int(rest[0]))
            else:
                raise ValueError(f"unknown command {cmd!r}")
            print(f"ok {answer}".strip(), flush=True)
        except Exception as e:  # the test reads the message
            traceback.print_exc()
            print("error " + f"{type(e).__name__}: {e}".replace("\n", " "), flush=True)

    loop.stopped.set()
    loop.join(timeout=10)
    worker.stop()
    sys.stdout.flush()
    # torch.distributed teardown with peers that may already be gone can hang; nothing is left to save.
    os._exit(0)


if __name__ == "__main__":
    main()
