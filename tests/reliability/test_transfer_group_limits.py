"""Transfer groups refuse or give up instead of waiting: a join whose store accepts TCP and never
answers ends within its timeout, and the next join still works; a bucket whose byte ranges leave out
a tensor the worker owns is refused before anything waits for bytes; a bucket whose message (or
its announcement) arrives short is refused, nothing counted; an update whose call ends
(cancelled, past its deadline) while it waits for group bytes ends at once, so the worker is not
left UPDATING until the group's timeout, can leave the group and takes the next push.

One real gRPC worker server in the test process (the demo model, with its real transfer-group
importer) shared by the module; the test process is the trainer (group rank 0, serving the store
over real gloo on loopback), talking to the worker through raw stubs.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch
from helpers import RequestFeed, error_info, full_update_requests, header, pack, push, wait_until
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.transfer_group import TransferGroup
from weightwire.core.transports.transfer_group_agreement import agree
from weightwire.core.transports.transfer_group_plan import (
    ANNOUNCEMENT_INDEX,
    MemberIdentity,
    message_tag,
    plan_group,
)
from weightwire.core.transports.transfer_group_store import StoreServer
from weightwire.core.transports.transfer_plan import TransferPlan
from weightwire.core.transports.whole_messages import announce, last_byte
from weightwire.server import serve
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

from .common import demo_adapter

HOST = "127.0.0.1"
NORM = "model.norm.weight"
# Far beyond what any of these tests may take: a worker still waiting at the end of one of them
# waits for the group's timeout, and the test fails on its own much shorter call deadline.
GROUP_TIMEOUT_MS = 120_000
CALL_TIMEOUT_S = 20.0


class Worker:
    def __init__(self) -> None:
        self.server = serve(demo_adapter(), listen=f"{HOST}:0")
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.WeightTransferServiceStub(self.channel)
        self.manifest = ShardManifest.from_proto(
            self.stub.GetManifest(pb.GetManifestRequest(), timeout=30).manifest
        )

    def status(self) -> pb.GetStatusResponse:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=30)

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(grace=0)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def store() -> Iterator[StoreServer]:
    server = StoreServer(HOST, 0)
    yield server
    server.close()


def _spec(worker: Worker, store_address: str, timeout_ms: int) -> tuple[pb.TransferGroupSpec, MemberIdentity]:
    trainer = MemberIdentity.of_trainer(0, uuid.uuid4().hex)
    plan = plan_group(
        {"w": worker.manifest},
        trainer=trainer,
        group_id=f"limits-{uuid.uuid4().hex[:12]}",
        backend=pb.TRANSFER_BACKEND_GLOO,
        store_address=store_address,
        timeout_ms=timeout_ms,
        max_bucket_bytes=1 << 20,
        broadcast=False,
    )
    return plan.spec, trainer


def _join(worker: Worker, spec: pb.TransferGroupSpec) -> grpc.RpcError | pb.JoinTransferGroupResponse:
    try:
        return worker.stub.JoinTransferGroup(pb.JoinTransferGroupRequest(spec=spec), timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        return err


def _form(worker: Worker, store: StoreServer) -> tuple[TransferGroup, pb.TransferGroupSpec]:
    """A new group of the test (rank 0) and the worker (rank 1)."""
    spec, trainer = _spec(worker, store.address, GROUP_TIMEOUT_MS)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    mine = pool.submit(TransferGroup.form, spec, trainer, listen_host=HOST, store=store.store)
    joined = _join(worker, spec)
    assert isinstance(joined, pb.JoinTransferGroupResponse), joined
    formed = mine.result(timeout=60)
    pool.shutdown()
    return formed, spec


@pytest.fixture
def group(worker: Worker, store: StoreServer) -> Iterator[tuple[TransferGroup, pb.TransferGroupSpec]]:
    formed, spec = _form(worker, store)
    yield formed, spec
    formed.close()


def _packed_norm(version: int) -> torch.Tensor:
    """The bytes of a point-to-point bucket holding the norm weight of ``version``."""
    return torch.frombuffer(
        bytearray(pack({NORM: full_checkpoint(DemoConfig(), version)[NORM]}).data), dtype=torch.uint8
    )


def _silent_store() -> tuple[socket.socket, list[socket.socket]]:
    """A socket that accepts connections and never says a word."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return listener, accepted


def _closed_port() -> str:
    sock = socket.socket()
    sock.bind((HOST, 0))
    address = f"{HOST}:{sock.getsockname()[1]}"
    sock.close()
    return address


def test_a_store_that_never_answers_ends_the_join_and_the_next_join_works(
    worker: Worker, store: StoreServer
) -> None:
    listener, accepted = _silent_store()
    try:
        port = listener.getsockname()[1]
        spec, _ = _spec(worker, f"{HOST}:{port}", timeout_ms=1000)
        first = _join(worker, spec)
        assert isinstance(first, grpc.RpcError), first
        assert (first.code(), error_info(first)[0]) == (
            grpc.StatusCode.UNAVAILABLE,
            "GROUP_STORE_UNREACHABLE",
        ), first.details()  # type: ignore[attr-defined]
        assert accepted, "the join never reached the silent store"
        assert worker.status().transfer_group.state == pb.TRANSFER_GROUP_STATE_NONE
        # The next join is not stuck behind the first: a closed port is refused as usual.
        spec, _ = _spec(worker, _closed_port(), timeout_ms=1000)
        second = _join(worker, spec)
        assert isinstance(second, grpc.RpcError), second
        assert (second.code(), error_info(second)[0]) == (
            grpc.StatusCode.UNAVAILABLE,
            "GROUP_STORE_UNREACHABLE",
        ), second.details()  # type: ignore[attr-defined]
    finally:
        listener.close()
        for conn in accepted:
            conn.close()


def _group_bucket(
    spec: pb.TransferGroupSpec, size: int, ranges: list[tuple[int, int]], specs: list[pb.TensorSpec]
) -> pb.PushWeightsRequest:
    handle = pb.TransferGroupHandle(
        group_id=spec.group_id,
        source_rank=0,
        mode=pb.TRANSFER_MODE_POINT_TO_POINT,
        sequence=1,
        ranges=[pb.ByteRange(offset_bytes=o, size_bytes=n) for o, n in ranges],
    )
    payload = pb.Payload(device=pb.DeviceId(kind=pb.DEVICE_KIND_HOST), size_bytes=size, transfer_group=handle)
    return pb.PushWeightsRequest(bucket=pb.Bucket(index=0, tensors=specs, payloads=[payload]))


def _norm_update(
    worker: Worker, spec: pb.TransferGroupSpec, version: int, ranges_of: object
) -> list[pb.PushWeightsRequest]:
    """A PARTIAL update of the norm weight over the group; ``ranges_of(size)`` gives the byte ranges."""
    packed = pack({NORM: full_checkpoint(DemoConfig(), version)[NORM]})
    size = len(packed.data)
    bucket = _group_bucket(spec, size, ranges_of(size), list(packed.specs))  # type: ignore[operator]
    own = worker.manifest.device.to_proto()
    bucket.bucket.payloads[0].device.CopyFrom(own)
    return [
        header(version, scope=pb.UPDATE_SCOPE_PARTIAL),
        bucket,
        pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=1)),
    ]


def test_an_owned_tensor_outside_the_ranges_is_refused_before_any_wait(worker: Worker, group: object) -> None:
    _, spec = group  # type: ignore[misc]
    before = worker.status()
    version = before.weights_version + 1
    # The ranges cover only the tail of the payload; the norm weight (owned) starts at 0. The
    # trainer sends nothing: a worker that waited for bytes would still be waiting.
    reqs = _norm_update(worker, spec, version, lambda size: [(size - 64, 64)])
    out = push(worker.stub, reqs, timeout=CALL_TIMEOUT_S)
    assert (out.code, out.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "TENSOR_OUT_OF_BOUNDS"), (
        out.code,
        out.reason,
        out.message,
    )
    assert out.metadata.get("tensor") == NORM
    st = worker.status()
    assert (st.weights_version, st.state) == (before.weights_version, before.state)


def _agree_then_announce(formed: TransferGroup, plan: TransferPlan, announce_messages: bool) -> object:
    """The trainer's side of a slices update that stops before its messages: the plans compared,
    and (``announce_messages``) the norm weight's one message announced, never sent."""
    agree(formed.process_group(), plan, 0, 2, GROUP_TIMEOUT_MS / 1000)
    if not announce_messages:
        return None
    data = full_checkpoint(DemoConfig(), 1)[NORM].contiguous().view(-1).view(torch.uint8)
    work = formed.send(announce([(data.numel(), last_byte(data))], data.device), 1, 0)
    formed.wait(work, "the test's announcement")
    return work


def _norm_slices_update(
    worker: Worker, spec: pb.TransferGroupSpec, version: int
) -> list[pb.PushWeightsRequest]:
    """A PARTIAL update of the norm weight as a slices bucket (every trainer rank a source: here
    the one trainer, group rank 0), whose receive starts by comparing plans with every member."""
    owned = worker.manifest.tensors[NORM]
    request = pb.PushWeightsRequest()
    payload = request.bucket.payloads.add()
    payload.device.CopyFrom(worker.manifest.device.to_proto())
    h = payload.transfer_group
    h.group_id, h.mode = spec.group_id, pb.TRANSFER_MODE_SLICES
    h.plan_fingerprint, h.max_message_bytes = "0" * 32, 1 << 20
    s = h.slices.add(tensor=NORM, source_rank=0)
    s.start.extend(0 for _ in owned.shape)
    s.stop.extend(owned.shape)
    payload.size_bytes = owned.nbytes
    return [
        header(version, scope=pb.UPDATE_SCOPE_PARTIAL),
        request,
        pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=1)),
    ]


@pytest.mark.parametrize("how", ["stream cancelled", "PushUpdate deadline"])
@pytest.mark.parametrize(
    "plane", ["point-to-point", "slices", "slices, plans agreed", "slices, messages announced"]
)
def test_an_update_whose_call_ends_while_waiting_for_group_bytes_ends_at_once(
    worker: Worker, group: object, how: str, plane: str
) -> None:
    """The trainer (this process) never sends: the worker waits for its bytes (point to point),
    for the plan comparison (slices, where a silent trainer rank holds every member), the plans
    compared and agreed, for the trainer's announcement of its messages, or, those announced, for
    the messages themselves (a worker's gloo receives are staged, so one given up on lands nowhere)."""
    formed, spec = group  # type: ignore[misc]
    before = worker.status()
    version = before.weights_version + 1
    if plane.startswith("slices"):
        reqs = _norm_slices_update(worker, spec, version)
    else:
        reqs = _norm_update(worker, spec, version, lambda size: [(0, size)])  # bytes never sent
    compared: concurrent.futures.Future[object] | None = None
    if plane in ("slices, plans agreed", "slices, messages announced"):
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        plan = TransferPlan((), "0" * 32)  # the fingerprint the bucket names
        compared = pool.submit(_agree_then_announce, formed, plan, plane.endswith("announced"))
        pool.shutdown(wait=False)
    if how == "stream cancelled":
        feed = RequestFeed()
        call = worker.stub.PushWeights(iter(feed), timeout=CALL_TIMEOUT_S)
        for req in reqs[:2]:
            feed.send(req)
        assert wait_until(lambda: worker.status().state == pb.WORKER_STATE_UPDATING)
        if compared is not None:
            compared.result(timeout=CALL_TIMEOUT_S)  # the worker now waits for the announcement
        call.cancel()
        feed.end()
    else:
        out = push(worker.stub, reqs, timeout=3.0, whole=True)
        assert out.code == grpc.StatusCode.DEADLINE_EXCEEDED, (out.code, out.reason, out.message)
        if compared is not None:
            compared.result(timeout=CALL_TIMEOUT_S)  # the plans were agreed before the deadline
    # Ends well before the group's timeout (the call deadline of the checks below is far shorter).
    assert wait_until(lambda: worker.status().state != pb.WORKER_STATE_UPDATING, timeout=CALL_TIMEOUT_S)
    st = worker.status()
    assert st.weights_version == before.weights_version
    assert st.last_error.reason == "CANCELLED" and st.last_error.version == version, st.last_error
    # Not refused with UPDATE_IN_PROGRESS: the failed update already tore the group down.
    left = worker.stub.LeaveTransferGroup(
        pb.LeaveTransferGroupRequest(group_id=spec.group_id), timeout=CALL_TIMEOUT_S
    )
    assert left.left is False
    assert worker.status().transfer_group.state == pb.TRANSFER_GROUP_STATE_NONE
    # And the next push is taken.
    full = full_checkpoint(DemoConfig(), version)
    landed = push(worker.stub, full_update_requests(version, full, None), timeout=CALL_TIMEOUT_S)
    assert landed.code == grpc.StatusCode.OK, (landed.code, landed.reason, landed.message)
    assert worker.status().weights_version == version


class _SlowToLetGo:
    """An observer that takes its time over each finished update: the worker has recorded the
    outcome (its status no longer says UPDATING) but holds the update until its observers ran."""

    def __init__(self) -> None:
        self.delay_s = 0.0

    def update_started(self, version: int) -> None:
        pass

    def bucket_acked(self, ack: pb.BucketAck) -> None:
        pass

    def update_finished(self, outcome: object) -> None:
        time.sleep(self.delay_s)


def test_a_leave_as_soon_as_the_status_says_the_update_ended_is_taken(
    worker: Worker, group: tuple[TransferGroup, pb.TransferGroupSpec]
) -> None:
    """A client that sees the update's failure in the status and leaves the group at once is not
    refused with UPDATE_IN_PROGRESS while the ended update lets go of the worker."""
    _, spec = group
    slow = _SlowToLetGo()
    worker.server.service.add_observer(slow)
    version = worker.status().weights_version + 1
    reqs = _norm_update(worker, spec, version, lambda size: [(0, size)])  # bytes never sent
    feed = RequestFeed()
    call = worker.stub.PushWeights(iter(feed), timeout=CALL_TIMEOUT_S)
    for req in reqs[:2]:
        feed.send(req)
    assert wait_until(lambda: worker.status().state == pb.WORKER_STATE_UPDATING)
    slow.delay_s = 1.0
    try:
        call.cancel()
        feed.end()
        assert wait_until(lambda: worker.status().state != pb.WORKER_STATE_UPDATING, timeout=CALL_TIMEOUT_S)
        assert worker.status().last_error.version == version
        left = worker.stub.LeaveTransferGroup(
            pb.LeaveTransferGroupRequest(group_id=spec.group_id), timeout=CALL_TIMEOUT_S
        )
    finally:
        slow.delay_s = 0.0
    assert left.left is False  # the failed update already tore the group down


@pytest.mark.parametrize("short", ["message", "announcement"])
def test_a_message_that_arrives_short_is_refused_and_nothing_counts(
    worker: Worker, group: object, short: str
) -> None:
    """The trainer announces the bucket's one message whole, then sends only its first half (or
    sends half the announcement). gloo completes the worker's receive as if it were whole; the
    worker must refuse with MESSAGE_TRUNCATED, the version must not move, and the model is as it
    was (the bytes were staged, not written)."""
    formed, spec = group  # type: ignore[misc]
    before = worker.status()
    version = before.weights_version + 1
    reqs = _norm_update(worker, spec, version, lambda size: [(0, size)])
    data = _packed_norm(version)
    note = announce([(data.numel(), last_byte(data))], data.device)
    if short == "message":
        data = data[: data.numel() // 2]
    else:
        note = note[: note.numel() // 2]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    pushed = pool.submit(push, worker.stub, reqs, timeout=CALL_TIMEOUT_S)
    works = [
        formed.send(note, 1, message_tag(1, ANNOUNCEMENT_INDEX)),
        formed.send(data, 1, message_tag(1, 0)) if short == "message" else None,
    ]
    out = pushed.result(timeout=CALL_TIMEOUT_S + 10)
    pool.shutdown()
    assert (out.code, out.reason) == (grpc.StatusCode.DATA_LOSS, "MESSAGE_TRUNCATED"), (
        out.code,
        out.reason,
        out.message,
    )
    for work in works:
        if work is not None:
            formed.wait(work, "the test's send")
    st = worker.status()
    assert st.weights_version == before.weights_version
    assert st.state != pb.WORKER_STATE_INCONSISTENT, st
    assert st.last_error.reason == "MESSAGE_TRUNCATED", st.last_error


@pytest.mark.parametrize("plane", ["point-to-point", "slices"])
def test_a_message_that_arrives_long_is_refused_and_the_worker_lives(
    worker: Worker, store: StoreServer, group: object, plane: str
) -> None:
    """The trainer announces the bucket's one message at its planned size, then sends twice as many
    bytes. gloo ends the process that posted the receive (std::terminate, which nothing in Python
    catches): that must be the worker's receiving process, not the worker. The update is refused
    with MESSAGE_TOO_LONG naming the sizes, the version does not move, nothing reached the model,
    and the worker forms the next group and takes the next push."""
    formed, spec = group  # type: ignore[misc]
    before = worker.status()
    version = before.weights_version + 1
    data = _packed_norm(version)
    if plane == "slices":
        reqs = _norm_slices_update(worker, spec, version)
        data = full_checkpoint(DemoConfig(), version)[NORM].contiguous().view(-1).view(torch.uint8)
    else:
        reqs = _norm_update(worker, spec, version, lambda size: [(0, size)])
    note = announce([(data.numel(), last_byte(data))], data.device)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    pushed = pool.submit(push, worker.stub, reqs, timeout=CALL_TIMEOUT_S)
    if plane == "slices":
        agree(formed.process_group(), TransferPlan((), "0" * 32), 0, 2, GROUP_TIMEOUT_MS / 1000)
        works = [formed.send(note, 1, 0), formed.send(torch.cat([data, data]), 1, 0)]
    else:
        works = [
            formed.send(note, 1, message_tag(1, ANNOUNCEMENT_INDEX)),
            formed.send(torch.cat([data, data]), 1, message_tag(1, 0)),
        ]
    out = pushed.result(timeout=CALL_TIMEOUT_S + 10)
    pool.shutdown()
    assert (out.code, out.reason) == (grpc.StatusCode.DATA_LOSS, "MESSAGE_TOO_LONG"), (
        out.code,
        out.reason,
        out.message,
    )
    assert (out.metadata.get("sent_bytes"), out.metadata.get("posted_bytes")) == (
        str(2 * data.numel()),
        str(data.numel()),
    ), out.metadata
    for work in works:
        try:
            formed.wait(work, "the test's send")
        except Exception:
            pass  # the receiving end is gone; whether the send saw that first is gloo's business
    st = worker.status()
    assert st.weights_version == before.weights_version
    assert st.state == before.state, st
    assert st.last_error.reason == "MESSAGE_TOO_LONG", st.last_error
    assert st.transfer_group.state == pb.TRANSFER_GROUP_STATE_NONE
    # The worker lives: a new group forms (a new receiving process) and carries the next update.
    second, spec2 = _form(worker, store)
    try:
        reqs = _norm_update(worker, spec2, version, lambda size: [(0, size)])
        packed = _packed_norm(version)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        pushed = pool.submit(push, worker.stub, reqs, timeout=CALL_TIMEOUT_S)
        note = announce([(packed.numel(), last_byte(packed))], packed.device)
        sends = [
            second.send(note, 1, message_tag(1, ANNOUNCEMENT_INDEX)),
            second.send(packed, 1, message_tag(1, 0)),
        ]
        out = pushed.result(timeout=CALL_TIMEOUT_S + 10)
        pool.shutdown()
        for work in sends:
            second.wait(work, "the test's send")
        assert out.code == grpc.StatusCode.OK, (out.code, out.reason, out.message)
        assert worker.status().weights_version == version
    finally:
        second.close()
