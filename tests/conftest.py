"""Fixtures shared by the test suites: shared-memory segments, in-process and subprocess workers.

The helpers they use live in ``tests/helpers.py`` (importable as ``helpers``).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# A suite started in the background of a shell without job control inherits SIGINT ignored, and so
# would every process the tests start: Python then installs no KeyboardInterrupt handler, and the
# tests that press Ctrl-C on a CLI (the demo, the fleet watch) would see it ignored. With a handler
# here, children start with SIGINT at its default, as under a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from helpers import InProcessWorker, ShmSegments, WorkerProcess, spawn_worker, start_demo_worker
from weightwire.core.manifest import ParallelRank


@pytest.fixture
def segments() -> Iterator[ShmSegments]:
    """Creates ``ww-`` shared-memory segments; unlinks every one after the test."""
    segs = ShmSegments()
    try:
        yield segs
    finally:
        segs.close()


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
