"""Real workers in separate processes (``python -m weightwire.client.cli.main serve``), driven by raw
requests: a TP=2 x PP=2 engine receives full updates over shared memory and inline bytes, each
worker's parameters are read back from its --dump-dir, refused updates leave everything as it was,
and the process lifecycle (listening line, signals, listeners, tokens) behaves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import (
    ShmSegments,
    WorkerProcess,
    bucket,
    commit,
    demo_args,
    full_update_requests,
    header,
    inline_payload,
    load_dump,
    pack,
    push,
    serve_command,
    spawn_workers,
    unary_error,
)
from weightwire.adapters.torch.demo import DemoConfig, expected_shard, full_checkpoint
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ParallelRank
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

CONFIG = DemoConfig()
RANKS = [ParallelRank(tp_rank=t, tp_size=2, pp_rank=p, pp_size=2) for p in range(2) for t in range(2)]


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("dumps"))


@pytest.fixture(scope="module")
def engine(dump_dir: str):
    """Four demo workers (TP=2 x PP=2), started with seed 0, shared by the tests of this module."""
    workers = spawn_workers(
        [demo_args(tp=(r.tp_rank, 2), pp=(r.pp_rank, 2), dump_dir=dump_dir) for r in RANKS]
    )
    yield list(zip(RANKS, workers, strict=True))
    for w in workers:
        w.stop()


def stub_of(worker: WorkerProcess) -> pb_grpc.WeightTransferServiceStub:
    return pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(worker.address))


def next_version(engine) -> int:
    return max(stub_of(w).GetStatus(pb.GetStatusRequest()).weights_version for _, w in engine) + 1


def worker_id(rank: ParallelRank) -> str:
    return f"tp{rank.tp_rank}-pp{rank.pp_rank}"


def assert_dump(dump_dir: str, rank: ParallelRank, version: int, full: dict[str, torch.Tensor]) -> None:
    got = load_dump(dump_dir, worker_id(rank), version)
    want = expected_shard(full, rank, CONFIG)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), f"{worker_id(rank)}: {name}"


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_engine_full_update(engine, dump_dir: str, segments: ShmSegments, transport: str) -> None:
    version = next_version(engine)
    full = full_checkpoint(CONFIG, version)
    # The same buckets go to every worker; each loads its own shard and skips the rest.
    reqs = full_update_requests(version, full, segments if transport == "shm" else None, buckets=3)
    for rank, worker in engine:
        stub = stub_of(worker)
        manifest = stub.GetManifest(pb.GetManifestRequest()).manifest
        assert manifest.worker_id == worker_id(rank)
        out = push(stub, reqs)
        assert out.code == grpc.StatusCode.OK, f"{worker_id(rank)}: {out.message}"
        assert out.result is not None and out.result.tensors_loaded == len(manifest.tensors)
        assert sum(a.tensors_skipped for a in out.acks) == len(full) - len(manifest.tensors)
        status = stub.GetStatus(pb.GetStatusRequest())
        assert (status.weights_version, status.state, status.open_mappings) == (
            version,
            pb.WORKER_STATE_CONSISTENT,
            0,
        )
        assert_dump(dump_dir, rank, version, full)


def test_refused_update_changes_nothing(engine, dump_dir: str, segments: ShmSegments) -> None:
    rank, worker = engine[0]
    stub = stub_of(worker)
    version = next_version(engine)
    good = full_checkpoint(CONFIG, version)
    assert push(stub, full_update_requests(version, good, segments)).code == grpc.StatusCode.OK
    bad = full_checkpoint(CONFIG, version + 1)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"][:, :-1].contiguous()
    out = push(stub, full_update_requests(version + 1, bad, segments))
    assert (out.code, out.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "SHAPE_MISMATCH")
    assert out.metadata["tensor"] == "model.layers.0.mlp.up_proj.weight"
    status = stub.GetStatus(pb.GetStatusRequest())
    assert status.weights_version == version and status.last_error.reason == "SHAPE_MISMATCH"
    assert not os.path.exists(os.path.join(dump_dir, f"{worker_id(rank)}-v{version + 1}.safetensors"))
    assert_dump(dump_dir, rank, version, good)


def test_no_payload_for_device_across_processes(engine) -> None:
    _, worker = engine[2]  # tp0-pp1: the last stage owns model.norm.weight
    p = pack({"model.norm.weight": torch.zeros(CONFIG.hidden_size)})
    foreign = pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid="GPU-0BADC0DE-0000-0000-0000-000000000000")
    out = push(
        stub_of(worker),
        [
            header(next_version(engine)),
            bucket(0, p.specs, [inline_payload(p.data, device=foreign)]),
            commit(1),
        ],
    )
    assert (out.code, out.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "NO_PAYLOAD_FOR_DEVICE")
    own = DeviceRef.host().uuid
    assert own in out.message and "0badc0de-0000-0000-0000-000000000000" in out.message
    assert out.metadata == {
        "own_device": f"host:{own}",
        "labels": "cuda:0badc0de-0000-0000-0000-000000000000",
    }


def test_incomplete_update_makes_worker_not_serving(engine, dump_dir: str, segments: ShmSegments) -> None:
    rank, worker = engine[3]
    stub = stub_of(worker)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(worker.address))
    version = next_version(engine)
    full = full_checkpoint(CONFIG, version)
    out = push(
        stub, full_update_requests(version, {"lm_head.weight": full["lm_head.weight"]}, segments, buckets=1)
    )
    assert out.reason == "INCOMPLETE_UPDATE" and "model.norm.weight" in out.metadata["missing"]
    assert stub.GetStatus(pb.GetStatusRequest()).state == pb.WORKER_STATE_INCONSISTENT
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert push(stub, full_update_requests(version, full, segments)).code == grpc.StatusCode.OK
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    assert_dump(dump_dir, rank, version, full)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(worker_process, sig: int) -> None:
    worker = worker_process(*demo_args())
    socket_dir = os.path.dirname(worker.address.removeprefix("unix:"))
    assert os.path.isdir(socket_dir)
    assert stub_of(worker).GetStatus(pb.GetStatusRequest()).state == pb.WORKER_STATE_CONSISTENT
    assert worker.stop(sig) == 0, worker.stderr_text()
    assert not os.path.exists(socket_dir)


def test_tcp_with_token(worker_process, segments: ShmSegments) -> None:
    worker = worker_process(*demo_args(listen="127.0.0.1:0", seed=4, extra=["--token", "tok-123"]))
    assert worker.address.startswith("127.0.0.1:") and not worker.address.endswith(":0")
    stub = stub_of(worker)
    assert unary_error(lambda: stub.GetStatus(pb.GetStatusRequest()))[:2] == (
        grpc.StatusCode.UNAUTHENTICATED,
        "MISSING_TOKEN",
    )
    md = [("authorization", "Bearer tok-123")]
    out = push(stub, full_update_requests(1, full_checkpoint(CONFIG, 1), segments), metadata=md)
    assert out.code == grpc.StatusCode.OK, out.message
    assert stub.GetStatus(pb.GetStatusRequest(), metadata=md).weights_version == 1


def test_refuses_non_loopback_without_token() -> None:
    proc = subprocess.run(
        serve_command(*demo_args(listen="0.0.0.0:0")), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stdout == ""  # never claimed to listen
    assert "requires a token" in proc.stderr


def test_cli_help_lists_the_agreed_flags() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "weightwire.client.cli.main", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    for flag in (
        "--model",
        "--tp-rank",
        "--tp-size",
        "--pp-rank",
        "--pp-size",
        "--dp-rank",
        "--dp-size",
        "--sp-rank",
        "--sp-size",
        "--listen",
        "--seed",
        "--device",
        "--token",
        "--tls-cert",
        "--tls-key",
        "--dump-dir",
    ):
        assert flag in proc.stdout
