"""A demo worker whose own device is set by the test: the stand-in for an engine worker on one GPU,
for the FSDP2 tests on a CPU machine (tests/fsdp).

Real parts: the demo model (``TorchAdapter``), the real gRPC server (``weightwire.server.serve``),
host shared memory. What is made up is only the device identity: ``--label UUID`` makes the worker's
own device ``DeviceRef.host(UUID)``, a host label standing for one GPU, so several "GPUs" can be told
apart on one machine; the trainer ranks' stand-in exporter (``tests/fsdp/fsdp_rank.py``) labels its
shared memory the same way. Without ``--label`` the worker is an ordinary host worker of this
machine. ``--hidden-size`` and friends size the model (the memory test needs one much larger than a
bucket); ``--dtype`` sets the engine's dtype (the dtype-conversion test).

Prints ``weightwire-serve listening ADDR`` like ``weightwire serve``, writes
``DIR/<worker_id>-v<version>.safetensors`` after every commit, and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

import torch
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ParallelRank
from weightwire.server import serve
from weightwire.server.cli import _dump


def config_of(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        dtype=getattr(torch, args.dtype),
    )


def add_config_args(parser: argparse.ArgumentParser) -> None:
    defaults = DemoConfig()
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--label", default=None, help="UUID of the stand-in GPU this worker is on (default: this host)"
    )
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--dump-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    for axis in ("tp", "pp"):
        parser.add_argument(f"--{axis}-rank", type=int, default=0)
        parser.add_argument(f"--{axis}-size", type=int, default=1)
    add_config_args(parser)
    args = parser.parse_args()
    rank = ParallelRank(
        tp_rank=args.tp_rank, tp_size=args.tp_size, pp_rank=args.pp_rank, pp_size=args.pp_size
    )
    own_device = DeviceRef.host(args.label) if args.label else DeviceRef.host()
    config = config_of(args)
    device = torch.device("cpu")
    adapter = TorchAdapter(
        build_demo_model(config, rank, device, args.seed),
        rank=rank,
        device=device,
        own_device=own_device,
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
        engine="torch-demo",
        worker_id=args.worker_id,
    )
    dump_dir = args.dump_dir
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)

    def on_commit(result: Any) -> None:
        if dump_dir:
            _dump(adapter, dump_dir, result.version)

    server = serve(adapter, own_device=own_device, on_commit=on_commit)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"weightwire-serve listening {server.address}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop(grace=2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
