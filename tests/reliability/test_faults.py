"""Faults with real processes: a trainer SIGKILLed mid-update, a worker SIGKILLed mid-update, a worker
restarted under the client, a client deadline, a cancelled stream and concurrent pushes.

Two CPU worker processes (TP=2 of the demo model, `weightwire serve` on Unix sockets at fixed paths,
so a restarted worker comes back at the same address) serve every test of this module. After each
fault the workers must report the documented state (version unchanged, INCONSISTENT once tensors
were loaded, health NOT_SERVING, mappings released), accept the next FULL update and hold exactly
its weights (read back from their safetensors dumps), and no shared-memory segment created by the
test's processes may be left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from weightwire.adapters.torch.demo import DemoConfig, expected_shard, full_checkpoint
from weightwire.client import WeightPusher
from weightwire.client.push.pusher import PushProgress
from weightwire.core.errors import PushError
from weightwire.core.manifest import ParallelRank
from weightwire.core.transports.shm import sweep_orphans
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

from . import helpers
from .common import (
    SHM_DIR,
    assert_weightwire_error,
    inline_update,
    push_raw,
    segments_of,
    serve_args,
    wait_until,
)

TRAINER = str(pathlib.Path(__file__).with_name("trainer.py"))
BUCKET_BYTES = 16 * 1024  # the demo model then takes dozens of buckets: room to fail in the middle
TP = 2


class Cluster:
    """Two worker processes (tp0, tp1) at fixed Unix socket paths, with dumps after every commit."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.dump_dir = root / "dumps"
        self.config = DemoConfig()
        self.ranks = [ParallelRank(tp_rank=i, tp_size=TP) for i in range(TP)]
        self.addresses = [f"unix:{root / f'w{i}.sock'}" for i in range(TP)]
        self.procs: list[helpers.WorkerProcess | None] = [None] * TP
        self.version = 0
        self.seed = 0  # the demo seed the workers hold (0: what `serve --seed 0` starts with)
        for i, w in enumerate(helpers.spawn_workers([self._args(i) for i in range(TP)], timeout=180.0)):
            self.procs[i] = w

    def _args(self, i: int) -> list[str]:
        return serve_args(tp=(i, TP), listen=self.addresses[i], dump_dir=self.dump_dir)

    def restart(self, i: int) -> None:
        old = self.procs[i]
        if old is not None:
            old.stop()
        self.procs[i] = helpers.spawn_worker(*self._args(i), timeout=180.0)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait(30)

    def close(self) -> None:
        for w in self.procs:
            if w is not None:
                w.stop()

    def stub(self, i: int) -> pb_grpc.WeightTransferServiceStub:
        return pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(self.addresses[i]))

    def status(self, i: int) -> pb.GetStatusResponse:
        return self.stub(i).GetStatus(pb.GetStatusRequest(), timeout=30)

    def health(self, i: int) -> int:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(self.addresses[i]))
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=30).status

    def next_version(self) -> int:
        self.version += 1
        return self.version

    def push_full(self, **pusher_kw: object) -> None:
        """A good FULL update from this process; every worker must then hold it exactly."""
        version = self.next_version()
        full = full_checkpoint(self.config, seed=version)
        with WeightPusher(self.addresses, bucket_size_bytes=BUCKET_BYTES, **pusher_kw) as pusher:  # type: ignore[arg-type]
            results = pusher.push(full, version=version)
        assert {r.version for r in results.values()} == {version}
        self.seed = version
        self.expect_consistent()

    def expect_consistent(self) -> None:
        full = full_checkpoint(self.config, seed=self.seed)
        for i, rank in enumerate(self.ranks):
            st = self.status(i)
            assert (st.weights_version, st.state, st.open_mappings) == (
                self.version,
                pb.WORKER_STATE_CONSISTENT,
                0,
            ), st
            assert self.health(i) == health_pb2.HealthCheckResponse.SERVING
            dump = helpers.load_dump(self.dump_dir, st.worker_id, self.version)
            want = expected_shard(full, rank, self.config)
            assert sorted(dump) == sorted(want)
            for name, tensor in want.items():
                assert torch.equal(dump[name], tensor), (st.worker_id, name)

    def expect_inconsistent(self, i: int, version: int) -> pb.GetStatusResponse:
        """After a failed update that had loaded tensors: version kept, INCONSISTENT, mappings released."""
        assert wait_until(
            lambda: self.status(i).state != pb.WORKER_STATE_UPDATING and self.status(i).open_mappings == 0
        )
        st = self.status(i)
        assert st.weights_version == version, st
        assert st.state == pb.WORKER_STATE_INCONSISTENT, st
        assert st.open_mappings == 0
        assert self.health(i) == health_pb2.HealthCheckResponse.NOT_SERVING
        return st


def vanished_client(err: pb.ErrorDetail) -> bool:
    """How a worker records an update whose client went away (killed, timed out, cancelled).

    gRPC Python hands the servicer a broken connection either as a cancellation or as a plain end
    of the request stream, depending on which event it sees first; a client that half-closes
    before cancelling looks the same. The worker then records CANCELLED / DEADLINE_EXCEEDED or
    MALFORMED_STREAM "ended before a commit". Either way nothing is committed.
    """
    if err.code in ("CANCELLED", "DEADLINE_EXCEEDED"):
        return True
    return err.reason == "MALFORMED_STREAM" and "before a commit" in err.message


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # a short path: Unix socket paths are limited to about 100 bytes
    c = Cluster(tmp_path_factory.mktemp("faults"))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def own_segments() -> Iterator[set[int]]:
    """pids whose ``ww-`` segments must all be gone after the test (this process plus any trainer
    processes the test adds)."""
    pids = {os.getpid()}
    before = segments_of(pids)
    yield pids
    leaked = segments_of(pids) - before
    for name in leaked:  # do not leave them on the machine, whatever the outcome
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


def test_trainer_killed_mid_update(cluster: Cluster, own_segments: set[int]) -> None:
    version = cluster.version + 1
    cmd = [
        sys.executable,
        TRAINER,
        "--version",
        str(version),
        "--seed",
        str(version),
        "--bucket-bytes",
        str(BUCKET_BYTES),
        "--sleep-s",
        "0.2",
    ]
    for a in cluster.addresses:
        cmd += ["--endpoint", a]
    trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    own_segments.add(trainer.pid)
    try:
        assert trainer.stdout is not None
        for line in trainer.stdout:
            event = json.loads(line)
            if event["event"] == "progress" and event["buckets_done"] >= 3:
                assert event["buckets_done"] < event["buckets_total"]
                break
            assert event["event"] in ("ready", "progress"), event
        else:
            pytest.fail(
                f"trainer ended before 3 buckets: {trainer.wait()} {trainer.stderr.read() if trainer.stderr else ''}"
            )
        assert segments_of([trainer.pid]), "the trainer stages its buckets in ww-<pid>- segments"
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        for stream in (trainer.stdout, trainer.stderr):
            if stream is not None:
                stream.close()

    for i in range(TP):
        st = cluster.expect_inconsistent(i, cluster.version)
        assert vanished_client(st.last_error), st.last_error
    # A SIGKILLed process cannot unlink its segments, and workers never unlink: the sweep does.
    orphans = segments_of([trainer.pid])
    assert orphans
    assert orphans <= set(sweep_orphans())
    assert not segments_of([trainer.pid])

    cluster.push_full()


def test_worker_killed_mid_update(cluster: Cluster, own_segments: set[int]) -> None:
    victim, survivor = 1, 0
    before = cluster.version
    killed = threading.Event()

    def progress(report: PushProgress) -> None:
        if report.buckets_done == 3 and not killed.is_set():
            cluster.kill(victim)
            killed.set()

    version = cluster.next_version()
    with WeightPusher(cluster.addresses, bucket_size_bytes=BUCKET_BYTES, timeout_s=120.0) as pusher:
        with pytest.raises(PushError) as exc:
            pusher.push(full_checkpoint(cluster.config, seed=version), version=version, progress=progress)
    assert killed.is_set()
    failures = exc.value.failures
    dead, other = cluster.addresses[victim], cluster.addresses[survivor]
    # the dead worker is named with a transport error (not a deadline: the client did not wait it out)
    assert failures[dead].code == "UNAVAILABLE", failures[dead]
    assert dead in str(exc.value)
    # the survivor's stream was cancelled because of the dead one, and says so
    assert failures[other].code == "CANCELLED", failures[other]
    assert "tp1-pp0" in failures[other].message or dead in failures[other].message
    assert not exc.value.results
    cluster.expect_inconsistent(survivor, before)

    cluster.restart(victim)
    cluster.push_full()


def test_worker_restart_is_detected_by_the_client(cluster: Cluster, own_segments: set[int]) -> None:
    with WeightPusher(cluster.addresses, bucket_size_bytes=BUCKET_BYTES) as pusher:
        manifests = pusher.manifests()
        old_instance = manifests[cluster.addresses[0]].instance_id
        cluster.restart(0)  # same address, same layout, new process (and weights of seed 0, version 0)
        version = cluster.next_version()
        with pytest.raises(PushError) as exc:
            pusher.push(full_checkpoint(cluster.config, seed=version), version=version)
        failure = exc.value.failures[cluster.addresses[0]]
        assert failure.reason == "MANIFEST_CHANGED", failure
        assert list(exc.value.failures) == [cluster.addresses[0]]
        # nothing was sent: the other worker still holds the previous update
        assert cluster.status(1).weights_version == version - 1
        assert cluster.status(1).state == pb.WORKER_STATE_CONSISTENT
        assert cluster.status(0).weights_version == 0
        # the next push re-reads the manifests and goes through
        results = pusher.push(full_checkpoint(cluster.config, seed=version), version=version)
        assert pusher.manifests()[cluster.addresses[0]].instance_id != old_instance
    assert {r.version for r in results.values()} == {version}
    cluster.seed = version
    cluster.expect_consistent()


def test_client_deadline_exceeded(cluster: Cluster, own_segments: set[int]) -> None:
    before = cluster.version
    buckets_done: list[int] = []

    def slow(report: PushProgress) -> None:
        buckets_done.append(report.buckets_done)
        threading.Event().wait(0.5)  # blocks the reader of acks: dozens of buckets cannot finish in time

    version = cluster.next_version()
    # Only the update stream runs under the short deadline: manifests are read first, and the
    # pre-push status check is off, so the deadline can only strike inside the update.
    with WeightPusher(cluster.addresses, bucket_size_bytes=BUCKET_BYTES, recheck_manifests=False) as pusher:
        pusher.manifests()
        pusher.timeout_s = 4.0
        with pytest.raises(PushError) as exc:
            pusher.push(full_checkpoint(cluster.config, seed=version), version=version, progress=slow)
    assert buckets_done, "no bucket was acked by every worker before the deadline"
    codes = {a: f.code for a, f in exc.value.failures.items()}
    assert set(codes) == set(cluster.addresses)
    assert "DEADLINE_EXCEEDED" in codes.values(), codes
    assert set(codes.values()) <= {"DEADLINE_EXCEEDED", "CANCELLED"}, codes
    for i in range(TP):
        st = cluster.expect_inconsistent(i, before)
        assert vanished_client(st.last_error), st.last_error
    cluster.push_full()


def test_stream_cancelled_by_the_client(cluster: Cluster, own_segments: set[int]) -> None:
    before = cluster.version
    stub = cluster.stub(0)
    full = full_checkpoint(cluster.config, seed=99)
    owned = sorted(
        stub.GetManifest(pb.GetManifestRequest(), timeout=30).manifest.tensors, key=lambda t: t.name
    )
    segments = helpers.ShmSegments()
    try:
        packed = helpers.pack({t.name: full[t.name] for t in owned[:3]})
        seg = segments.create(packed.data)
        feed = helpers.RequestFeed()
        call = stub.PushWeights(iter(feed), timeout=60)
        feed.send(helpers.header(before + 1))
        feed.send(helpers.bucket(0, packed.specs, [helpers.shm_payload(seg, len(packed.data))]))
        first = next(call)
        assert first.ack.tensors_loaded == 3 and first.ack.handle_opened
        call.cancel()
        with pytest.raises(grpc.RpcError) as exc:
            next(call)
        assert exc.value.code() == grpc.StatusCode.CANCELLED
        st = cluster.expect_inconsistent(0, before)
        assert st.last_error.code == "CANCELLED"
        feed.end()
    finally:
        segments.close()
    cluster.push_full()


def test_concurrent_pushes_are_aborted(cluster: Cluster, own_segments: set[int]) -> None:
    # raw streams: the second update on a worker is refused while the first runs, which then commits
    stub = cluster.stub(0)
    owned = stub.GetManifest(pb.GetManifestRequest(), timeout=30).manifest.tensors
    full = full_checkpoint(cluster.config, seed=cluster.seed)
    one = {owned[0].name: full[owned[0].name]}
    first_version = cluster.next_version()
    feed = helpers.RequestFeed()
    call = stub.PushWeights(iter(feed), timeout=60)
    first_reqs = inline_update(one, first_version, scope=pb.UPDATE_SCOPE_PARTIAL)
    feed.send(first_reqs[0])
    feed.send(first_reqs[1])
    assert next(call).WhichOneof("message") == "ack"
    assert cluster.status(0).state == pb.WORKER_STATE_UPDATING
    second = push_raw(stub, inline_update(one, first_version + 1, scope=pb.UPDATE_SCOPE_PARTIAL))
    assert_weightwire_error(second, "UPDATE_IN_PROGRESS")
    feed.send(first_reqs[2])
    feed.end()
    result = next(call)
    assert result.result.version == first_version
    assert cluster.status(0).weights_version == first_version

    # two trainers (pushers) at once: the one that comes second fails on every worker, naming the reason
    cluster.push_full()  # both workers at the same version again
    blocked, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def hold(report: PushProgress) -> None:
        if report.buckets_done == 1:
            blocked.set()
            release.wait(60)

    version = cluster.next_version()

    def first_trainer() -> None:
        with WeightPusher(cluster.addresses, bucket_size_bytes=BUCKET_BYTES) as p:
            outcome["results"] = p.push(
                full_checkpoint(cluster.config, seed=version), version=version, progress=hold
            )

    t = threading.Thread(target=first_trainer)
    t.start()
    try:
        assert blocked.wait(60)
        with (
            WeightPusher(cluster.addresses, bucket_size_bytes=BUCKET_BYTES) as p2,
            pytest.raises(PushError) as exc,
        ):
            p2.push(full_checkpoint(cluster.config, seed=version + 1), version=version + 1)
        reasons = {a: f.reason for a, f in exc.value.failures.items()}
        assert "UPDATE_IN_PROGRESS" in reasons.values(), reasons
        assert set(reasons.values()) <= {"UPDATE_IN_PROGRESS", "CANCELLED"}, reasons
    finally:
        release.set()
        t.join(120)
    results = outcome["results"]
    assert {r.version for r in results.values()} == {version}  # type: ignore[attr-defined]
    cluster.seed = version
    cluster.expect_consistent()
