"""A real worker process for the client tests whose engine is slow or broken on purpose: the demo
model behind the torch adapter, with each ``load`` taking ``--load-delay-s`` longer and, with
``--fail-loads``, raising after that delay (the engine failing to load: LOAD_FAILED).

Prints ``weightwire-serve listening ADDR`` like ``weightwire serve`` and runs until SIGTERM. Run as a
script: ``python tests/client/paced_worker.py --load-delay-s 1.0 [--fail-loads]``.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Sequence

import torch
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ParallelRank, ShardManifest
from weightwire.server import serve


class PacedAdapter:
    """The real torch adapter, with a slower (or failing) ``load``."""

    def __init__(self, inner: TorchAdapter, delay_s: float, fail: bool) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.fail = fail

    def manifest(self) -> ShardManifest:
        return self.inner.manifest()

    def begin_update(self, version: int) -> None:
        self.inner.begin_update(version)

    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("this engine fails every load (test worker)")
        self.inner.load(named_tensors)

    def end_update(self, success: bool) -> None:
        self.inner.end_update(success)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--load-delay-s", type=float, default=0.0)
    p.add_argument("--fail-loads", action="store_true")
    p.add_argument("--worker-id", default="paced")
    args = p.parse_args()
    config, rank = DemoConfig(), ParallelRank()
    inner = TorchAdapter(
        build_demo_model(config, rank, "cpu", 0),
        rank=rank,
        device=torch.device("cpu"),
        own_device=DeviceRef.host(),
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
        worker_id=args.worker_id,
    )
    server = serve(PacedAdapter(inner, args.load_delay_s, args.fail_loads), own_device=DeviceRef.host())  # type: ignore[arg-type]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"weightwire-serve listening {server.address}", flush=True)
    stop.wait()
    server.stop(grace=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
