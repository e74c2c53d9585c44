"""A demo worker on the CPU whose own device is a simulated GPU: the dry-run stand-in for
``weightwire serve --model demo --device cuda`` in tests/gpu/test_multi_gpu.py.

Started by tests/gpu/multi_procs.py only when WEIGHTWIRE_GPU_SIM is set (a machine without the GPUs
the multi-GPU scenarios need). Its own device is ``DeviceRef.host(--label)``, a made-up host label
standing for one GPU, so several "GPUs" can be told apart on one CPU machine; trainers then send host
shared memory labelled the same way. This checks the scenarios' routing, labels, ownership and
contents, not CUDA IPC. Prints ``weightwire-serve listening ADDR`` like ``weightwire serve``, writes
``DIR/<worker_id>-v<version>.safetensors`` after every commit, and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True, help="UUID of the simulated GPU this worker is on")
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--dump-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    for axis in ("tp", "pp", "sp"):
        parser.add_argument(f"--{axis}-rank", type=int, default=0)
        parser.add_argument(f"--{axis}-size", type=int, default=1)
    args = parser.parse_args()
    rank = ParallelRank(
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        pp_rank=args.pp_rank,
        pp_size=args.pp_size,
        sp_rank=args.sp_rank,
        sp_size=args.sp_size,
    )
    own_device = DeviceRef.host(args.label)
    config = DemoConfig()
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

    def on_commit(result: Any) -> None:
        if dump_dir:
            _dump(adapter, dump_dir, result.version)

    server = serve(adapter, listen="127.0.0.1:0", own_device=own_device, on_commit=on_commit)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"weightwire-serve listening {server.address}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop(grace=2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
