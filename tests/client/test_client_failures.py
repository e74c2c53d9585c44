"""Failures during an update, against real worker processes: a worker restarted between plan and
push (MANIFEST_CHANGED, seen by the client and by the worker), a worker killed mid-update (the push
fails fast naming it, the others are cancelled), a hung worker (deadline), and recovery after each."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
from engines import CONFIG, Engine, WorkerSpec, shard_mismatches, start_engine
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.client import PushError, PushProgress, WeightPusher
from weightwire.v1 import weight_transfer_pb2 as pb

# Each test restarts a worker (a few seconds); none waits for anything near this long.
pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    socks = tmp_path_factory.mktemp("socks")
    # Fixed socket paths, so a restarted worker comes back at the same address.
    specs = [WorkerSpec((r, 2), listen=f"unix:{socks}/w{r}.sock") for r in (0, 1)]
    eng = start_engine(specs, tmp_path_factory.mktemp("dumps"))
    yield eng
    eng.stop()


def _version(pusher: WeightPusher) -> int:
    return max(s.weights_version for s in pusher.status().values())


def _recover(eng: Engine) -> None:
    """A fresh pusher makes every worker CONSISTENT again with a FULL update, checked bit for bit."""
    with WeightPusher(eng.addresses) as p:
        v = _version(p) + 1
        full = full_checkpoint(CONFIG, seed=v)
        p.push(full, version=v)
        assert {s.state for s in p.status().values()} == {pb.WORKER_STATE_CONSISTENT}
        assert shard_mismatches(eng.dump_dir, p.manifests(), full, v) == {}


def test_restart_between_plan_and_push_is_caught_by_the_client(engine: Engine) -> None:
    with WeightPusher(engine.addresses) as p:
        p.manifests()
        a0, a1 = engine.addresses
        engine.restart(1)
        with pytest.raises(PushError) as e:
            p.push(full_checkpoint(CONFIG, seed=1), version=_version(p) + 1)
        assert list(e.value.failures) == [a1]
        assert e.value.failures[a1].reason == "MANIFEST_CHANGED"
        assert "restarted" in e.value.failures[a1].message
        assert p.status()[a0].updates_failed == 0  # nothing was sent to the healthy worker either
        # The next push re-reads the manifests by itself and goes through.
        v = _version(p) + 1
        full = full_checkpoint(CONFIG, seed=v)
        p.push(full, version=v)
        assert shard_mismatches(engine.dump_dir, p.manifests(), full, v) == {}


def test_restart_between_plan_and_push_is_refused_by_the_worker(engine: Engine) -> None:
    # Without the client's own re-check, the fingerprint in the header still catches it.
    with WeightPusher(engine.addresses, recheck_manifests=False) as p:
        p.manifests()
        a0, a1 = engine.addresses
        v0 = _version(p)
        engine.restart(1)
        with pytest.raises(PushError) as e:
            p.push(full_checkpoint(CONFIG, seed=1), version=v0 + 1)
        failures = e.value.failures
        assert failures[a1].reason == "MANIFEST_CHANGED" and failures[a1].code == "FAILED_PRECONDITION"
        assert a0 not in e.value.results  # nobody commits when one worker refused
        assert p.status()[a0].weights_version == v0
    _recover(engine)


def test_worker_killed_mid_update_fails_fast_and_names_it(engine: Engine) -> None:
    a0, a1 = engine.addresses
    victim = engine.workers[1]
    killed: list[int] = []

    def kill_after_first_bucket(progress: PushProgress) -> None:
        if not killed:
            killed.append(progress.buckets_done)
            victim.proc.send_signal(signal.SIGKILL)

    # A long deadline: if the push waited for it instead of noticing the dead worker, the reason
    # would be DEADLINE_EXCEEDED (and the test's timeout would hit first).
    with WeightPusher(engine.addresses, bucket_size_bytes=8 * 1024, timeout_s=600) as p:
        v0 = _version(p)
        with pytest.raises(PushError) as e:
            p.push(full_checkpoint(CONFIG, seed=v0 + 1), version=v0 + 1, progress=kill_after_first_bucket)
        assert killed == [1]
        failures = e.value.failures
        assert failures[a1].code == "UNAVAILABLE" and failures[a1].worker == a1
        assert "tp1-pp0" in failures[a1].message
        assert failures[a0].reason == "CANCELLED" and "tp1-pp0" in failures[a0].message
        assert not e.value.results
        assert a1 in str(e.value) and "UNAVAILABLE" in str(e.value)
        # The survivor had loaded a bucket: its version stays, and it says it is INCONSISTENT.
        st = engine.workers[0].stub().GetStatus(pb.GetStatusRequest(), timeout=10)
        assert st.weights_version == v0 and st.state == pb.WORKER_STATE_INCONSISTENT
        # A push while the worker is down fails at once, naming it.
        with pytest.raises(PushError) as down:
            p.push(full_checkpoint(CONFIG, seed=1), version=v0 + 1)
        assert list(down.value.failures) == [a1] and down.value.failures[a1].code == "UNAVAILABLE"
    engine.restart(1)
    _recover(engine)


def test_hung_worker_hits_the_deadline(engine: Engine) -> None:
    a0, a1 = engine.addresses
    victim = engine.workers[1]
    stopped: list[bool] = []

    def freeze_after_first_bucket(progress: PushProgress) -> None:
        if not stopped:
            stopped.append(True)
            victim.proc.send_signal(signal.SIGSTOP)

    try:
        with WeightPusher(engine.addresses, bucket_size_bytes=8 * 1024, timeout_s=2.0) as p:
            v0 = _version(p)
            with pytest.raises(PushError) as e:
                p.push(
                    full_checkpoint(CONFIG, seed=v0 + 1), version=v0 + 1, progress=freeze_after_first_bucket
                )
            failures = e.value.failures
            assert (
                failures[a1].code == "DEADLINE_EXCEEDED"
                and "did not answer within the deadline" in failures[a1].message
            )
            assert failures[a0].reason == "CANCELLED"
            assert not e.value.results
            # Unary calls have the deadline too.
            with pytest.raises(PushError) as unary:
                p.status()
            assert list(unary.value.failures) == [a1] and unary.value.failures[a1].code == "DEADLINE_EXCEEDED"
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    _recover(engine)


class _Counted:
    """A client stub method that counts its calls (blocking and ``future``)."""

    def __init__(self, inner: object, calls: list[str], name: str) -> None:
        self._inner, self._calls, self._name = inner, calls, name

    def __call__(self, *a: object, **k: object) -> object:
        self._calls.append(self._name)
        return self._inner(*a, **k)  # type: ignore[operator]

    def future(self, *a: object, **k: object) -> object:
        self._calls.append(self._name)
        return self._inner.future(*a, **k)  # type: ignore[attr-defined]


def test_one_pusher_rechecks_every_push_and_refetches_manifests_only_after_a_restart(engine: Engine) -> None:
    a0, a1 = engine.addresses
    calls: dict[str, list[str]] = {a0: [], a1: []}
    with WeightPusher(engine.addresses) as p:
        for a, w in p._workers.items():
            for method in ("GetManifest", "GetStatus"):
                setattr(w.stub, method, _Counted(getattr(w.stub, method), calls[a], method))
        v = _version(p)
        for _ in range(2):  # the first push reads the manifests, the second reuses them
            for c in calls.values():
                c.clear()
            v += 1
            full = full_checkpoint(CONFIG, seed=v)
            p.push(full, version=v)
            assert shard_mismatches(engine.dump_dir, p.manifests(), full, v) == {}
        # The unchanged workers' manifests were not fetched again; the re-check still ran.
        assert calls == {a0: ["GetStatus"], a1: ["GetStatus"]}

        engine.restart(1)  # same address: the pusher's channel (and the counting stubs) reach the new process
        for c in calls.values():
            c.clear()
        with pytest.raises(PushError) as e:
            p.push(full_checkpoint(CONFIG, seed=v + 1), version=v + 1)
        assert list(e.value.failures) == [a1] and e.value.failures[a1].reason == "MANIFEST_CHANGED"
        assert calls[a1] == ["GetStatus"]  # caught by the re-check, before any stream
        assert p.status()[a0].weights_version == v  # nothing was sent to the healthy worker

        for c in calls.values():
            c.clear()
        v = _version(p) + 1
        full = full_checkpoint(CONFIG, seed=v)
        p.push(full, version=v)  # re-reads both manifests, re-plans, and goes through
        assert calls[a0].count("GetManifest") == 1 and calls[a1].count("GetManifest") == 1
        assert "GetStatus" in calls[a0] and "GetStatus" in calls[a1]
        assert shard_mismatches(engine.dump_dir, p.manifests(), full, v) == {}
    _recover(engine)


def test_single_worker_single_bucket_push_hits_the_deadline(engine: Engine) -> None:
    # One worker and one bucket: the pushing thread reads the stream itself; a hung worker must
    # still end the push at the deadline, blamed on that worker, nothing committed.
    a1 = engine.addresses[1]
    victim = engine.workers[1]

    class FreezeAfterSetup(WeightPusher):
        def _setup(self, *args: Any, **kwargs: Any) -> Any:
            setup = super()._setup(*args, **kwargs)
            victim.proc.send_signal(signal.SIGSTOP)
            return setup

    try:
        with FreezeAfterSetup([a1], timeout_s=2.0) as p:
            v0 = _version(p)
            with pytest.raises(PushError) as e:
                p.push(full_checkpoint(CONFIG, seed=v0 + 1), version=v0 + 1)
            failures = e.value.failures
            assert list(failures) == [a1]
            assert (
                failures[a1].code == "DEADLINE_EXCEEDED"
                and "did not answer within the deadline" in failures[a1].message
            )
            assert not e.value.results
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    st = victim.stub().GetStatus(pb.GetStatusRequest(), timeout=10)
    assert st.weights_version == v0
    _recover(engine)
