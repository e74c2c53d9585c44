"""Test-only stand-in for an engine process: a demo worker served the way an engine plugin serves
one (``serve`` then ``engine_metrics``), so metrics land wherever ``engine_metrics`` puts them
(prometheus multiprocess files, a port). Prints ``listening ADDR`` and, when a port was asked
for, ``metrics URL``; runs until SIGTERM.

Usage: python engine_worker.py TP_RANK TP_SIZE
"""

from __future__ import annotations

import signal
import sys
import threading

import torch
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model
from weightwire.core.manifest import ParallelRank
from weightwire.server import serve
from weightwire.server.observe.metrics import engine_metrics


def main() -> int:
    rank = ParallelRank(tp_rank=int(sys.argv[1]), tp_size=int(sys.argv[2]))
    config = DemoConfig()
    model = build_demo_model(config, rank, "cpu", 0)
    adapter = TorchAdapter(
        model,
        rank=rank,
        device=torch.device("cpu"),
        own_device=None,
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
    )
    server = serve(adapter)
    metrics = engine_metrics(server.service, engine="test-engine", port_offset=rank.tp_rank)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"listening {server.address}", flush=True)
    if metrics is not None and metrics.server is not None:
        print(f"metrics {metrics.server.url}", flush=True)
    stop.wait()
    server.stop(grace=1.0)
    if metrics is not None:
        metrics.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
