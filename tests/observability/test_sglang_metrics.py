"""Worker metrics inside a real SGLang engine (TP=1, CPU) started with ``enable_metrics``: the
plugin's worker records into SGLang's prometheus multiprocess directory, and reading that
directory the way SGLang's ``/metrics`` does shows the scheduler's weightwire series next to
SGLang's own, with the values of a committed push and a refused one. (Several processes merging
in one directory: test_engine_metrics.py.)"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sglang"))

from checkpoints import QWEN2, ModelSpec, full_checkpoint, write_model_dir
from real_engine import SGLANG_ENVS, EngineHost, engine_kwargs
from weightwire.adapters.sglang import discover
from weightwire.client import PushError, WeightPusher

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

SPEC = ModelSpec(QWEN2)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineHost, str, str]]:
    env = SGLANG_ENVS["0.5.23"]
    if not env.available():
        pytest.skip("no SGLang 0.5.23 environment: `make install-sglang` makes it")
    root = tmp_path_factory.mktemp("sglang-metrics")
    model = write_model_dir(SPEC, str(root / "model"), full_checkpoint(SPEC, seed=1))
    multiproc = root / "prometheus"
    multiproc.mkdir()
    socket_dir = f"/tmp/ww-sglm-{uuid.uuid4().hex[:10]}"
    host = EngineHost(
        env,
        engine_kwargs(model, tp=1, dtype=SPEC.dtype_name, enable_metrics=True),
        socket_dir=socket_dir,
        log_path=str(root / "engine.log"),
        extra_env={"PROMETHEUS_MULTIPROC_DIR": str(multiproc)},
    )
    try:
        yield host, socket_dir, str(multiproc)
    finally:
        host.stop()
        for entry in os.listdir(socket_dir) if os.path.isdir(socket_dir) else []:
            os.unlink(os.path.join(socket_dir, entry))
        if os.path.isdir(socket_dir):
            os.rmdir(socket_dir)


def test_weightwire_series_in_sglangs_metrics(engine: tuple[EngineHost, str, str]) -> None:
    host, socket_dir, multiproc = engine
    endpoints = discover(socket_dir, count=1, timeout_s=60)
    with WeightPusher(endpoints, transport="host_shm", timeout_s=120) as pusher:
        host.pause("abort")
        results = pusher.push(full_checkpoint(SPEC, seed=2), version=1)
        host.resume()
    for address in endpoints:
        with WeightPusher([address], timeout_s=120) as single, pytest.raises(PushError) as refused:
            single.push(full_checkpoint(SPEC, seed=2), version=1)
        assert refused.value.failures[address].reason == "STALE_VERSION"
    assert host.generate([[1, 2, 3]], 4)[0]["weight_version"] == "1"

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=multiproc)
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}

    def value(name: str, worker: str, **labels: str) -> float:
        key = (name, frozenset({"worker": worker, **labels}.items()))
        assert key in samples, f"no sample {name} for {worker} {labels}"
        return samples[key]

    # SGLang's own metrics are still there (importing prometheus_client too early would break them).
    assert any(f.name.startswith("sglang:") for f in families)
    assert {r.worker_id for r in results.values()} == {"tp0-pp0"}
    for r in results.values():
        assert value("weightwire_weights_version", r.worker_id) == 1
        assert value("weightwire_worker_state", r.worker_id, state="CONSISTENT") == 1
        assert value("weightwire_updates_total", r.worker_id, outcome="committed", reason="") == 1
        assert value("weightwire_updates_total", r.worker_id, outcome="refused", reason="STALE_VERSION") == 1
        assert value("weightwire_update_duration_seconds_count", r.worker_id, outcome="committed") == 1
        assert value(
            "weightwire_update_duration_seconds_sum", r.worker_id, outcome="committed"
        ) == pytest.approx(r.server_duration_s, rel=1e-9)
        assert value("weightwire_loaded_bytes_total", r.worker_id) == r.bytes_loaded
