"""Fixtures shared by the test suites: shared-memory segments, in-process and subprocess workers.

The helpers they use live in ``tests/helpers.py`` (importable as ``helpers``).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# A suite started in the background of a shell without job control inherits SIGINT ignored, and so
# would every process the tests start: Python then installs no KeyboardInterrupt handler, and the
# tests that press Ctrl-C on a CLI (the demo, the fleet watch) would see it ignored. With a handler
# here, children start with SIGINT at its default, as under a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from helpers import ShmSegments, WorkerProcess, spawn_worker
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model
from weightwire.core.manifest import ParallelRank
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc


@pytest.fixture
def segments() -> Iterator[ShmSegments]:
    """Creates ``ww-`` shared-memory segments; unlinks every one after the test."""
    segs = ShmSegments()
    try:
        yield segs
    finally:
        segs.close()


@dataclass
class InProcessWorker:
    """A real gRPC worker server running in the test process, with the demo model."""

    server: object  # weightwire.server.RunningServer
    adapter: TorchAdapter
    rank: ParallelRank
    config: DemoConfig

    @property
    def address(self) -> str:
        return self.server.address  # type: ignore[attr-defined]

    @property
    def service(self) -> object:
        return self.server.service  # type: ignore[attr-defined]

    def stub(self) -> pb_grpc.WeightTransferServiceStub:
        import grpc

        return pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(self.address))

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.adapter.state().items()}


def start_demo_worker(
    rank: ParallelRank | None = None, *, seed: int = 0, **serve_kw: object
) -> InProcessWorker:
    from weightwire.server import serve

    rank = rank or ParallelRank()
    config = DemoConfig()
    model = build_demo_model(config, rank, "cpu", seed)
    adapter = TorchAdapter(
        model,
        rank=rank,
        device=torch.device("cpu"),
        own_device=None,
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
    )
    server = serve(adapter, **serve_kw)  # type: ignore[arg-type]
    return InProcessWorker(server, adapter, rank, config)


@pytest.fixture
def inproc_worker() -> Iterator[Callable[..., InProcessWorker]]:
    """Factory: ``inproc_worker(rank=None, seed=0, **serve_kw)``; every worker is stopped afterwards."""
    started: list[InProcessWorker] = []

    def factory(rank: ParallelRank | None = None, *, seed: int = 0, **serve_kw: object) -> InProcessWorker:
        worker = start_demo_worker(rank, seed=seed, **serve_kw)
        started.append(worker)
        return worker

    yield factory
    for worker in started:
        worker.server.stop(grace=0)  # type: ignore[attr-defined]


@pytest.fixture
def worker_process() -> Iterator[Callable[..., WorkerProcess]]:
    """Factory: ``worker_process(*serve_args)`` spawns ``weightwire serve``; stopped afterwards."""
    started: list[WorkerProcess] = []

    def factory(*args: str, **kw: object) -> WorkerProcess:
        worker = spawn_worker(*args, **kw)  # type: ignore[arg-type]
        started.append(worker)
        return worker

    yield factory
    for worker in started:
        worker.stop()
