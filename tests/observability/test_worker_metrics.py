"""Metrics and update log lines of a real ``weightwire serve`` process (``--metrics-port 0``), after
three committed pushes through the client library and two refused updates sent with raw stubs:
one at its header (STALE_VERSION) and one at its bucket (SHAPE_MISMATCH).

The scrape goes over HTTP to the worker's own endpoint and is read by prometheus_client's parser;
every expected value comes from what the pushes returned (versions, bytes, buckets, handles,
server-side durations), not from constants.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import torch
from helpers import bucket, commit, header, inline_payload, push, wait_until
from prometheus_client.parser import text_string_to_metric_families
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.client import PushError, WeightPusher
from weightwire.client.inputs.types import PushResult
from weightwire.core import dtypes
from weightwire.server.observe.update_log import parse_update_line
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

LISTENING = "weightwire-serve listening "
METRICS = "weightwire-serve metrics "
WORKER = "tp0-pp0"


@dataclasses.dataclass
class MetricsWorker:
    proc: subprocess.Popen[str]
    address: str
    metrics_url: str
    stderr_lines: list[str]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def spawn_metrics_worker(*extra: str, timeout: float = 90.0) -> MetricsWorker:
    """``weightwire serve --metrics-port 0``: wait for its listening and metrics lines."""
    cmd = [
        sys.executable,
        "-m",
        "weightwire.client.cli.main",
        "serve",
        "--model",
        "demo",
        "--seed",
        "0",
        "--metrics-port",
        "0",
        "--log-level",
        "INFO",
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()
    stderr_lines: list[str] = []

    def pump(stream: object, sink: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            sink(line)  # type: ignore[operator]
        if stream is proc.stdout:
            lines.put(None)

    threading.Thread(target=pump, args=(proc.stdout, lines.put), daemon=True).start()
    threading.Thread(target=pump, args=(proc.stderr, stderr_lines.append), daemon=True).start()
    address = url = ""
    deadline = time.monotonic() + timeout
    while not (address and url):
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"worker did not print its addresses within {timeout}s\n{''.join(stderr_lines)}"
            ) from None
        if line is None:
            proc.wait()
            raise RuntimeError(f"worker exited with {proc.returncode}\n{''.join(stderr_lines)}")
        if line.startswith(LISTENING):
            address = line[len(LISTENING) :].strip()
        elif line.startswith(METRICS):
            url = line[len(METRICS) :].strip()
    return MetricsWorker(proc, address, url, stderr_lines)


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of one scrape: (sample name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def update_lines(worker: MetricsWorker) -> list[dict[str, str]]:
    return [
        parse_update_line(line) for line in list(worker.stderr_lines) if "event=weightwire.update" in line
    ]


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    key = (name, frozenset({"worker": WORKER, **labels}.items()))
    assert key in samples, (
        f"no sample {name}{labels}; have {sorted(n for n, _ in samples if n.startswith(name))}"
    )
    return samples[key]


@dataclasses.dataclass
class Scenario:
    worker: MetricsWorker
    results: list[PushResult]
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    worker = spawn_metrics_worker()
    try:
        config = DemoConfig()
        results: list[PushResult] = []
        # Small buckets: several per update, so per-bucket histograms count more than updates.
        with WeightPusher([worker.address], bucket_size_bytes=64 * 1024, timeout_s=60) as pusher:
            for version in (1, 2):
                results.append(
                    pusher.push(full_checkpoint(config, seed=version), version=version)[worker.address]
                )
            partial = {"lm_head.weight": full_checkpoint(config, seed=3)["lm_head.weight"]}
            results.append(pusher.push(partial, version=3, scope="partial")[worker.address])
            # Refused at the header: version 2 is not newer than 3.
            with pytest.raises(PushError) as stale:
                pusher.push(full_checkpoint(config, seed=9), version=2)
            assert stale.value.failures[worker.address].reason == "STALE_VERSION"
        # Refused at its bucket: the worker's manifest says lm_head.weight is [vocab, hidden].
        stub = pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(worker.address))
        wrong = torch.zeros(config.hidden_size, config.vocab_size, dtype=torch.float32)
        spec = pb.TensorSpec(
            name="lm_head.weight",
            dtype=dtypes.from_torch(wrong.dtype),
            shape=list(wrong.shape),
            offset_bytes=0,
        )
        data = wrong.view(-1).view(torch.uint8).numpy().tobytes()
        refused = push(
            stub,
            [header(4, scope=pb.UPDATE_SCOPE_PARTIAL), bucket(0, [spec], [inline_payload(data)]), commit(1)],
        )
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and refused.reason == "SHAPE_MISMATCH"
        samples = scrape(worker.metrics_url)
        # Logged before each answer was sent; the pipe to this process may still hold them.
        assert wait_until(lambda: len(update_lines(worker)) >= 5), worker.stderr_lines
        yield Scenario(worker, results, samples)
    finally:
        worker.stop()


def test_version_state_and_mappings(scenario: Scenario) -> None:
    s = scenario.samples
    assert value(s, "weightwire_weights_version") == 3
    assert value(s, "weightwire_worker_state", state="CONSISTENT") == 1
    assert value(s, "weightwire_worker_state", state="UPDATING") == 0
    assert value(s, "weightwire_worker_state", state="INCONSISTENT") == 0
    assert value(s, "weightwire_open_mappings") == 0
    assert value(s, "weightwire_last_commit_timestamp_seconds") > 0


def test_updates_by_outcome_and_reason(scenario: Scenario) -> None:
    s = scenario.samples
    assert value(s, "weightwire_updates_total", outcome="committed", reason="") == 3
    assert value(s, "weightwire_updates_total", outcome="refused", reason="STALE_VERSION") == 1
    assert value(s, "weightwire_updates_total", outcome="refused", reason="SHAPE_MISMATCH") == 1
    assert not [k for k in s if k[0] == "weightwire_updates_total" and ("outcome", "failed") in k[1]]


def test_update_durations(scenario: Scenario) -> None:
    s = scenario.samples
    assert value(s, "weightwire_update_duration_seconds_count", outcome="committed") == 3
    # The histogram sums exactly the durations the worker reported in its UpdateResults.
    expected = sum(r.server_duration_s for r in scenario.results)
    assert value(s, "weightwire_update_duration_seconds_sum", outcome="committed") == pytest.approx(
        expected, rel=1e-9
    )
    assert value(s, "weightwire_update_duration_seconds_bucket", outcome="committed", le="+Inf") == 3
    # The SHAPE_MISMATCH update began (its header was accepted); the stale one never did.
    assert value(s, "weightwire_update_duration_seconds_count", outcome="refused") == 1
    assert not [
        k
        for k in s
        if k[0].startswith("weightwire_update_duration_seconds") and ("outcome", "failed") in k[1]
    ]


def test_bytes_buckets_and_handles(scenario: Scenario) -> None:
    s = scenario.samples
    results = scenario.results
    assert value(s, "weightwire_loaded_bytes_total") == sum(r.bytes_loaded for r in results)
    assert value(s, "weightwire_loaded_tensors_total") == sum(r.tensors_loaded for r in results)
    buckets = sum(r.buckets for r in results)
    assert buckets > len(results)  # the small bucket size split the full updates
    assert {r.transport for r in results} == {"host_shm"}
    assert value(s, "weightwire_buckets_total", transport="host_shm") == buckets
    assert value(s, "weightwire_bucket_load_duration_seconds_count", transport="host_shm") == buckets
    assert value(s, "weightwire_bucket_open_duration_seconds_count", transport="host_shm") == buckets
    assert value(s, "weightwire_handles_opened_total", transport="host_shm") == sum(
        r.handles_opened for r in results
    )


def test_one_update_line_per_update(scenario: Scenario) -> None:
    lines = update_lines(scenario.worker)
    assert [(f["version"], f["outcome"], f["reason"]) for f in lines] == [
        ("1", "committed", ""),
        ("2", "committed", ""),
        ("3", "committed", ""),
        ("2", "refused", "STALE_VERSION"),
        ("4", "refused", "SHAPE_MISMATCH"),
    ]
    for f, r in zip(lines[:3], scenario.results, strict=True):
        assert f["worker"] == WORKER
        assert int(f["bytes"]) == r.bytes_loaded
        assert int(f["buckets"]) == r.buckets
        assert float(f["duration_ms"]) == pytest.approx(r.server_duration_s * 1e3, abs=1e-3)
        assert f["state"] == "CONSISTENT" and f["code"] == "OK"
    assert lines[2]["scope"] == "partial" and lines[2]["weights_version"] == "3"
    assert lines[3]["duration_ms"] == "" and lines[3]["weights_version"] == "3"
    assert lines[4]["code"] == "FAILED_PRECONDITION" and "lm_head.weight" in lines[4]["message"]
