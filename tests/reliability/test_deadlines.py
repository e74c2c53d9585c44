"""Calls that end while the worker is still working on them: a client's deadline (or cancel) must
never be followed by a commit, and a call that cannot get a thread is answered at once.

One real gRPC worker server in the test process (so that the engine's load and finishing step can
be held at a point the test chooses, with events instead of sleeps), shared by the module; raw
stubs, as any client would call it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc
import pytest
import torch
from helpers import RequestFeed, error_info, full_update_requests, header, push, wait_until
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model, full_checkpoint
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ParallelRank
from weightwire.server import serve
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

IDLE_TIMEOUT_S = 60.0
# The client deadline of the calls that must end while the engine is held (it is held until the
# test lets it go, so any deadline passes there once the engine was reached).
DEADLINE_S = 2.0
NORM = "model.norm.weight"


@dataclasses.dataclass
class Hold:
    """Where the engine stops until the test lets it go: ``at`` is "load", "end" (its finishing
    step after a successful update) or None (it runs through)."""

    at: str | None = None
    entered: threading.Event = dataclasses.field(default_factory=threading.Event)
    release: threading.Event = dataclasses.field(default_factory=threading.Event)

    def point(self, where: str) -> None:
        if self.at == where:
            self.entered.set()
            assert self.release.wait(60), "the test never let the engine go"

    def arm(self, where: str) -> None:
        self.at = where
        self.entered.clear()
        self.release.clear()

    def disarm(self) -> None:
        self.at = None
        self.release.set()


class HeldAdapter(TorchAdapter):
    """The demo model's real adapter, with a point in the load and in the finishing step where it
    waits for the test (``Hold``)."""

    hold: Hold

    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.hold.point("load")
        super().load(named_tensors)

    def prepare_load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Callable[[], None]:
        run = super().prepare_load(named_tensors)

        def held() -> None:
            self.hold.point("load")
            run()

        return held

    def end_update(self, success: bool) -> None:
        if success:
            self.hold.point("end")
        super().end_update(success)


@dataclasses.dataclass
class Worker:
    server: object
    adapter: HeldAdapter
    stub: pb_grpc.WeightTransferServiceStub
    channel: grpc.Channel

    @property
    def service(self) -> object:
        return self.server.service  # type: ignore[attr-defined]

    def status(self) -> pb.GetStatusResponse:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=30)

    def next_version(self) -> int:
        return self.status().weights_version + 1


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    config = DemoConfig()
    rank = ParallelRank()
    adapter = HeldAdapter(
        build_demo_model(config, rank, "cpu", 0),
        rank=rank,
        device=torch.device("cpu"),
        own_device=DeviceRef.host(),
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
    )
    adapter.hold = Hold()
    server = serve(adapter, idle_timeout_s=IDLE_TIMEOUT_S)
    channel = grpc.insecure_channel(server.address)
    try:
        yield Worker(server, adapter, pb_grpc.WeightTransferServiceStub(channel), channel)
    finally:
        adapter.hold.disarm()
        channel.close()
        server.stop(grace=0)


@pytest.fixture
def hold(worker: Worker) -> Iterator[Hold]:
    yield worker.adapter.hold
    worker.adapter.hold.disarm()
    # Every test leaves the worker able to take the next update: nothing running, nothing held.
    assert wait_until(lambda: worker.status().state != pb.WORKER_STATE_UPDATING)
    assert worker.status().open_mappings == 0


def partial_update(version: int) -> list[pb.PushWeightsRequest]:
    """header (PARTIAL), one inline bucket with the norm weight, commit."""
    full = full_checkpoint(DemoConfig(), version)
    reqs = full_update_requests(version, {NORM: full[NORM]}, None, buckets=1)
    reqs[0] = header(version, scope=pb.UPDATE_SCOPE_PARTIAL)
    return reqs


def call_ended_on_worker(worker: Worker) -> bool:
    """The worker's running update knows its call is over (gRPC told the server, not only the client)."""
    active = worker.service._active  # type: ignore[attr-defined]
    ended = getattr(active, "_rpc_ended", None)
    return ended is not None and ended.is_set()


def _call_ending(worker: Worker, hold: Hold, rpc: str, how: str, reqs: list[pb.PushWeightsRequest]) -> None:
    """Send ``reqs`` as ``rpc`` and end the call while the engine is held: its deadline passes
    (DEADLINE_S), or the client cancels it once the engine was reached."""
    if how == "deadline":
        out = push(worker.stub, reqs, timeout=DEADLINE_S, whole=rpc == "PushUpdate")
        assert out.code == grpc.StatusCode.DEADLINE_EXCEEDED, (out.code, out.reason, out.message)
        return
    if rpc == "PushUpdate":
        future = worker.stub.PushUpdate.future(pb.PushUpdateRequest(messages=reqs), timeout=60)
        assert hold.entered.wait(30)
        future.cancel()
        return
    call = worker.stub.PushWeights(iter(reqs), timeout=60)
    assert hold.entered.wait(30)
    call.cancel()


@pytest.mark.parametrize(
    ("rpc", "at", "how"),
    [(rpc, at, "deadline") for rpc in ("PushUpdate", "PushWeights") for at in ("load", "end")]
    + [("PushUpdate", "load", "cancel"), ("PushUpdate", "end", "cancel"), ("PushWeights", "end", "cancel")],
)
def test_a_call_that_ended_never_commits(worker: Worker, hold: Hold, rpc: str, at: str, how: str) -> None:
    # The client's deadline passes (or it cancels) while the engine loads the bucket, or while it
    # finishes the update after the commit message: the client is told the call failed, so the
    # worker must not move to the new version (a retry would get STALE_VERSION for it).
    before = worker.status()
    version = before.weights_version + 1
    hold.arm(at)
    _call_ending(worker, hold, rpc, how, partial_update(version))
    # Once the worker learned that the call is over (or the update already ended, a deadline
    # that passed before the engine was reached), let the engine go.
    assert wait_until(
        lambda: call_ended_on_worker(worker) or worker.status().state != pb.WORKER_STATE_UPDATING
    )
    hold.release.set()
    assert wait_until(lambda: worker.status().state != pb.WORKER_STATE_UPDATING)
    st = worker.status()
    assert st.weights_version == before.weights_version
    assert st.last_error.reason == "CANCELLED" and st.last_error.version == version, st.last_error
    assert st.updates_succeeded == before.updates_succeeded
    # Once the engine was reached it had loaded the norm weight: INCONSISTENT.
    assert st.state == (pb.WORKER_STATE_INCONSISTENT if hold.entered.is_set() else before.state)
    # The next update lands as usual.
    full = full_checkpoint(DemoConfig(), version)
    hold.disarm()
    landed = push(worker.stub, full_update_requests(version, full, None), whole=rpc == "PushUpdate")
    assert landed.code == grpc.StatusCode.OK, (landed.code, landed.reason, landed.message)
    st = worker.status()
    assert (st.weights_version, st.state) == (version, pb.WORKER_STATE_CONSISTENT)
    assert torch.equal(worker.adapter.state()[NORM], full[NORM])


def test_update_calls_are_not_queued_behind_idle_streams(worker: Worker, hold: Hold) -> None:
    # Streams that opened and say nothing hold every stream thread (for up to the idle deadline,
    # a minute here); a PushUpdate must still land at once.
    feeds = [RequestFeed() for _ in range(12)]
    calls = [worker.stub.PushWeights(iter(f), timeout=IDLE_TIMEOUT_S) for f in feeds]
    try:
        assert wait_until(
            lambda: sum(t.name.startswith("weightwire-push") for t in threading.enumerate()) >= 8
        )
        version = worker.next_version()
        full = full_checkpoint(DemoConfig(), version)
        out = push(worker.stub, full_update_requests(version, full, None), timeout=10, whole=True)
        assert out.code == grpc.StatusCode.OK, (out.code, out.reason, out.message)
        assert worker.status().weights_version == version
    finally:
        for call in calls:
            call.cancel()
        for f in feeds:
            f.end()


def test_an_update_call_without_a_slot_is_refused_at_once(
    worker: Worker, hold: Hold, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="weightwire.server.worker.service")
    # One update is held inside its load and then cancelled by its client; retries wait for it to
    # end (up to 30 s) and take every update slot. One call more gets UPDATE_IN_PROGRESS at once,
    # not a place in a queue.
    version = worker.next_version()
    hold.arm("load")
    feed = RequestFeed()
    stuck = worker.stub.PushWeights(iter(feed), timeout=60)
    for req in partial_update(version)[:2]:
        feed.send(req)
    assert hold.entered.wait(30)
    stuck.cancel()
    feed.end()
    assert wait_until(lambda: call_ended_on_worker(worker))
    waiting = [
        worker.stub.PushUpdate.future(pb.PushUpdateRequest(messages=partial_update(version)), timeout=60)
        for _ in range(4)
    ]
    try:
        # The four retries are inside the worker (each holds a slot) once each logged its wait.
        assert wait_until(
            lambda: caplog.text.count(f"waits for update {version}, cancelled by its client") >= 4
        )
        try:
            worker.stub.PushUpdate(pb.PushUpdateRequest(messages=partial_update(version)), timeout=10)
            raise AssertionError("a fifth update call was accepted while four held every slot")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.ABORTED, (err.code(), err.details())  # type: ignore[attr-defined]
            reason, _, md = error_info(err)
            assert reason == "UPDATE_IN_PROGRESS" and md.get("busy_calls") == "4", (reason, md)
    finally:
        hold.release.set()
        for f in waiting:
            try:
                f.result()
            except grpc.RpcError:
                pass
    # One of the retries landed after the held update ended; the others were UPDATE_IN_PROGRESS or STALE_VERSION.
    assert wait_until(lambda: worker.status().weights_version == version)
