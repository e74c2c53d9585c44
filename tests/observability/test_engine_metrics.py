"""``engine_metrics``, the call an engine plugin makes after starting its worker (the SGLang plugin
does), in real worker processes (``engine_worker.py``, a test-only stand-in for an engine process):

- prometheus multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, as SGLang with ``--enable-metrics``
  and vLLM with several API servers run): two TP workers write their values to the directory, and
  ``MultiProcessCollector`` (what the engine's ``/metrics`` serves) shows each worker's series;
- ``WEIGHTWIRE_METRICS_PORT``: each worker serves its own endpoint;
- off (neither set, or ``WEIGHTWIRE_METRICS=0``), and a bad port refused with its name.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.client import PushError, WeightPusher
from weightwire.server.observe.metrics import engine_metrics

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_worker.py")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclasses.dataclass
class EngineProcess:
    proc: subprocess.Popen[str]
    address: str
    metrics_url: str | None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(
    tp_rank: int, tp_size: int, env: Mapping[str, str], *, want_url: bool, timeout: float = 90.0
) -> EngineProcess:
    proc_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PROMETHEUS_", "WEIGHTWIRE_METRICS"))
    }
    proc_env.update(env, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, str(tp_rank), str(tp_size)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=proc_env,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    errors: list[str] = []

    def pump(stream: object, sink: Callable[[str], None], end: bool) -> None:
        for line in stream:  # type: ignore[attr-defined]
            sink(line)
        if end:
            lines.put(None)

    threading.Thread(target=pump, args=(proc.stdout, lines.put, True), daemon=True).start()
    threading.Thread(target=pump, args=(proc.stderr, errors.append, False), daemon=True).start()
    address, url = "", None
    deadline = time.monotonic() + timeout
    while not address or (want_url and url is None):
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"engine worker did not start within {timeout}s\n{''.join(errors)}") from None
        if line is None:
            proc.wait()
            raise RuntimeError(f"engine worker exited with {proc.returncode}\n{''.join(errors)}")
        if line.startswith("listening "):
            address = line.split(" ", 1)[1].strip()
        elif line.startswith("metrics "):
            url = line.split(" ", 1)[1].strip()
    return EngineProcess(proc, address, url)


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, worker: str, **labels: str) -> float:
    key = (name, frozenset({"worker": worker, **labels}.items()))
    assert key in samples, f"no sample {name}{{worker={worker}, {labels}}}"
    return samples[key]


def push_two_versions_and_a_stale_one(addresses: list[str]) -> dict[str, list[int]]:
    """v1 and v2 to every worker, then v2 again to each worker on its own (refused: STALE_VERSION).
    Returns the bytes each worker loaded per committed version."""
    config = DemoConfig()
    loaded: dict[str, list[int]] = {a: [] for a in addresses}
    with WeightPusher(addresses, bucket_size_bytes=128 * 1024) as pusher:
        for version in (1, 2):
            for a, r in pusher.push(full_checkpoint(config, seed=version), version=version).items():
                loaded[a].append(r.bytes_loaded)
    for a in addresses:
        with WeightPusher([a]) as single, pytest.raises(PushError) as refused:
            single.push(full_checkpoint(config, seed=2), version=2)
        assert refused.value.failures[a].reason == "STALE_VERSION"
    return loaded


def test_multiprocess_mode_records_for_the_engines_metrics(tmp_path: pathlib.Path) -> None:
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(multiproc)}
    workers = [spawn(0, 2, env, want_url=False), spawn(1, 2, env, want_url=False)]
    try:
        assert all(w.metrics_url is None for w in workers)  # no HTTP server of their own
        loaded = push_two_versions_and_a_stale_one([w.address for w in workers])
        # What SGLang's and vLLM's /metrics do: a fresh registry over the directory.
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(multiproc))
        samples = parse(generate_latest(registry).decode())
    finally:
        for w in workers:
            w.stop()
    assert len(list(multiproc.glob("*.db"))) > 0
    for w, worker_id in zip(workers, ("tp0-pp0", "tp1-pp0"), strict=True):
        assert value(samples, "weightwire_weights_version", worker_id) == 2
        assert value(samples, "weightwire_worker_state", worker_id, state="CONSISTENT") == 1
        assert value(samples, "weightwire_worker_state", worker_id, state="UPDATING") == 0
        assert value(samples, "weightwire_updates_total", worker_id, outcome="committed", reason="") == 2
        assert (
            value(samples, "weightwire_updates_total", worker_id, outcome="refused", reason="STALE_VERSION")
            == 1
        )
        assert value(samples, "weightwire_update_duration_seconds_count", worker_id, outcome="committed") == 2
        assert value(samples, "weightwire_loaded_bytes_total", worker_id) == sum(loaded[w.address])
    # TP halves: the two workers loaded different byte counts, each counted under its own label.
    assert loaded[workers[0].address] != [0, 0] and loaded[workers[1].address] != [0, 0]


def test_a_port_per_worker_when_asked(tmp_path: pathlib.Path) -> None:
    worker = spawn(0, 1, {"WEIGHTWIRE_METRICS_PORT": "0"}, want_url=True)
    try:
        assert worker.metrics_url is not None
        loaded = push_two_versions_and_a_stale_one([worker.address])
        with urllib.request.urlopen(worker.metrics_url, timeout=30) as resp:
            samples = parse(resp.read().decode())
    finally:
        worker.stop()
    assert value(samples, "weightwire_weights_version", "tp0-pp0") == 2
    assert (
        value(samples, "weightwire_updates_total", "tp0-pp0", outcome="refused", reason="STALE_VERSION") == 1
    )
    assert value(samples, "weightwire_loaded_bytes_total", "tp0-pp0") == sum(loaded[worker.address])


def test_off_unless_the_engine_exports_or_a_port_is_asked(inproc_worker: Callable[..., object]) -> None:
    service = inproc_worker().service  # type: ignore[attr-defined]
    assert engine_metrics(service, engine="test-engine", env={}) is None
    assert (
        engine_metrics(
            service, engine="test-engine", env={"WEIGHTWIRE_METRICS": "0", "WEIGHTWIRE_METRICS_PORT": "9"}
        )
        is None
    )
    with pytest.raises(ValueError, match="WEIGHTWIRE_METRICS_PORT='http' is not a port number"):
        engine_metrics(service, engine="test-engine", env={"WEIGHTWIRE_METRICS_PORT": "http"})
    with pytest.raises(ValueError, match=r"\+ worker index 3 is not a port number"):
        engine_metrics(service, engine="test-engine", port_offset=3, env={"WEIGHTWIRE_METRICS_PORT": "65533"})
