"""Trainer metrics (``WeightPusher(metrics=TrainerMetrics(...))``) over two committed pushes and one
refused push to a real TP=2 engine of ``weightwire serve`` processes; and the import rule that keeps
prometheus_client out of an engine process until its metrics directory is set."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import WorkerProcess, demo_args, spawn_workers
from prometheus_client import CollectorRegistry
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.client import PushError, WeightPusher
from weightwire.client.observe.trainer_metrics import TrainerMetrics


@pytest.fixture(scope="module")
def engine() -> Iterator[list[WorkerProcess]]:
    workers = spawn_workers([demo_args(tp=(0, 2)), demo_args(tp=(1, 2))])
    try:
        yield workers
    finally:
        for w in workers:
            w.stop()


def test_pushes_recorded_by_phase_and_worker(engine: list[WorkerProcess]) -> None:
    registry = CollectorRegistry()
    addrs = [w.address for w in engine]
    config = DemoConfig()
    with WeightPusher(addrs, metrics=TrainerMetrics(registry), bucket_size_bytes=128 * 1024) as pusher:
        v0 = max(s.weights_version for s in pusher.status().values())
        results = [pusher.push(full_checkpoint(config, seed=v), version=v) for v in (v0 + 1, v0 + 2)]
        with pytest.raises(PushError) as refused:
            pusher.push(full_checkpoint(config, seed=v0 + 2), version=v0 + 2)  # not newer: STALE_VERSION
    failures = refused.value.failures
    assert "STALE_VERSION" in {e.reason for e in failures.values()}

    def sample(name: str, **labels: str) -> float:
        got = registry.get_sample_value(name, labels)
        assert got is not None, f"no sample {name}{labels}"
        return got

    assert sample("weightwire_trainer_pushes_total", outcome="committed") == 2
    assert sample("weightwire_trainer_pushes_total", outcome="failed") == 1
    assert sample("weightwire_trainer_weights_version") == v0 + 2
    # plan and total for every push; transfer and commit only for the two that sent buckets and committed.
    for phase, count in (("plan", 3), ("total", 3), ("transfer", 2), ("commit", 2)):
        assert sample("weightwire_trainer_push_duration_seconds_count", phase=phase) == count
    # The phases of a committed push add up to its total (one clock, consecutive intervals).
    parts = sum(
        sample("weightwire_trainer_push_duration_seconds_sum", phase=p)
        for p in ("plan", "transfer", "commit")
    )
    assert parts <= sample("weightwire_trainer_push_duration_seconds_sum", phase="total") + 1e-9
    ids = {a: results[0][a].worker_id for a in addrs}
    assert set(ids.values()) == {"tp0-pp0", "tp1-pp0"}
    for a, worker in ids.items():
        assert (
            sample("weightwire_trainer_worker_push_duration_seconds_count", worker=worker, phase="transfer")
            == 2
        )
        assert (
            sample("weightwire_trainer_worker_push_duration_seconds_count", worker=worker, phase="commit")
            == 2
        )
        assert sample("weightwire_trainer_pushed_bytes_total", worker=worker) == sum(
            r[a].bytes_loaded for r in results
        )
        # Each worker's failure is counted under the reason its stream ended with.
        assert (
            sample("weightwire_trainer_worker_failures_total", worker=worker, reason=failures[a].reason) == 1
        )


def test_a_second_recorder_on_one_registry_is_refused() -> None:
    registry = CollectorRegistry()
    TrainerMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        TrainerMetrics(registry)


def test_engine_side_imports_leave_prometheus_client_alone() -> None:
    # SGLang and vLLM set PROMETHEUS_MULTIPROC_DIR after their processes import plugins, and
    # prometheus_client fixes its storage at import: importing it early would break their metrics.
    code = (
        "import sys\n"
        "import weightwire.client, weightwire.client.push.pusher, weightwire.server, weightwire.server.worker.service\n"
        "import weightwire.server.rpc.grpc_server, weightwire.adapters.sglang.plugin\n"
        "assert 'prometheus_client' not in sys.modules, [m for m in sys.modules if 'weightwire' in m]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
