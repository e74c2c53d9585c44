"""A hostile or careless client against one real worker process, through the raw stubs.

Each test is a way a client once hurt a worker: a shared-memory name that slipped through
validation, a FIFO or a shrinking segment where a segment should be, streams that open and go
quiet, megabytes of text stored and echoed, non-ASCII text that overflowed gRPC's trailer, a
doubly prefixed device label, messages after a commit. The worker must answer each with a status
carrying one ErrorInfo (or refuse it at once), keep its version, release its mappings, stay alive
and accept the next good update. One `weightwire serve` process (CPU, demo model, one rank, a
short idle deadline) serves the whole module.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import grpc
import pytest
import torch
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.core.transports.shm import new_shm_name
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

from . import helpers
from .common import SHM_DIR, assert_weightwire_error, failed_outcome, push_raw, start_worker

# The module's worker ends a stream that sends nothing for this long: short, so the idle tests are
# quick; far above any gap between the messages the other tests send.
IDLE_TIMEOUT_S = 5


class Worker:
    """The worker process of this module, its stub, and the checkpoint each version carries."""

    def __init__(self) -> None:
        self.proc = start_worker(extra=["--idle-timeout-s", str(IDLE_TIMEOUT_S)])
        self.channel = grpc.insecure_channel(self.proc.address)
        self.stub = pb_grpc.WeightTransferServiceStub(self.channel)
        self.config = DemoConfig()
        self.owned = [
            t.name for t in self.stub.GetManifest(pb.GetManifestRequest(), timeout=30).manifest.tensors
        ]

    def close(self) -> None:
        self.channel.close()
        self.proc.stop()

    def status(self) -> pb.GetStatusResponse:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=30)

    def next_version(self) -> int:
        return self.status().weights_version + 1

    def checkpoint(self, version: int) -> dict[str, torch.Tensor]:
        full = full_checkpoint(self.config, seed=version)
        return {n: full[n] for n in self.owned}

    def alive(self) -> bool:
        return self.proc.proc.poll() is None

    def expect_unchanged(self, before: pb.GetStatusResponse) -> pb.GetStatusResponse:
        """After a refusal: same version and state, nothing mapped, process alive."""
        assert self.alive(), self.proc.stderr_text()
        assert helpers.wait_until(lambda: self.status().state != pb.WORKER_STATE_UPDATING)
        st = self.status()
        assert (st.weights_version, st.state, st.open_mappings) == (
            before.weights_version,
            before.state,
            0,
        ), st
        return st

    def push_good(self, segments: helpers.ShmSegments) -> None:
        """A good FULL update over shared memory lands (the worker still serves)."""
        version = self.next_version()
        outcome = push_raw(
            self.stub, helpers.full_update_requests(version, self.checkpoint(version), segments, buckets=2)
        )
        assert outcome.code == grpc.StatusCode.OK, outcome.describe()
        st = self.status()
        assert (st.weights_version, st.state, st.open_mappings) == (version, pb.WORKER_STATE_CONSISTENT, 0), (
            st
        )


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def segments() -> Iterator[helpers.ShmSegments]:
    segs = helpers.ShmSegments()
    try:
        yield segs
    finally:
        segs.close()


def _one_bucket(version: int, packed: helpers.Packed, payload: pb.Payload) -> list[pb.PushWeightsRequest]:
    return [helpers.header(version), helpers.bucket(0, packed.specs, [payload]), helpers.commit(1)]


def test_shm_name_with_a_trailing_newline_is_refused(worker: Worker, segments: helpers.ShmSegments) -> None:
    # A name pattern anchored with `$` matches before a final newline; such a segment exists and
    # holds valid data, so only the name rule stands between it and the model.
    before = worker.status()
    version = before.weights_version + 1
    packed = helpers.pack(worker.checkpoint(version))
    name = new_shm_name("nl") + "\n"
    with _raw_segment(name, bytes(packed.data)):
        outcome = push_raw(
            worker.stub, _one_bucket(version, packed, helpers.shm_payload(name, len(packed.data)))
        )
    assert_weightwire_error(outcome, "INVALID_SHM_NAME")
    worker.expect_unchanged(before)
    worker.push_good(segments)


@contextlib.contextmanager
def _raw_segment(name: str, data: bytes) -> Iterator[str]:
    """A segment file made by hand (names multiprocessing.shared_memory cannot track); removed after."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.close(fd)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_shm_name_of_something_not_a_regular_file_is_refused_at_once(
    worker: Worker, segments: helpers.ShmSegments, kind: str
) -> None:
    # A FIFO under a valid name used to block the worker in open(): it stayed UPDATING and refused
    # every later push. Nothing but a regular file may be opened, and nothing may block.
    before = worker.status()
    version = before.weights_version + 1
    packed = helpers.pack(worker.checkpoint(version))
    name = new_shm_name(kind)
    path = os.path.join(SHM_DIR, name)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        os.mkdir(path, 0o700)
    else:
        target = segments.create(packed.data)
        os.symlink(os.path.join(SHM_DIR, target.name), path)
    try:
        outcome = push_raw(
            worker.stub, _one_bucket(version, packed, helpers.shm_payload(name, len(packed.data))), timeout=30
        )
    finally:
        os.rmdir(path) if kind == "directory" else os.unlink(path)
    assert_weightwire_error(outcome, "HANDLE_OPEN_FAILED")
    worker.expect_unchanged(before)
    worker.push_good(segments)


def test_segment_shrunk_while_the_worker_reads_it_costs_the_update_not_the_worker(
    worker: Worker, segments: helpers.ShmSegments
) -> None:
    # Two buckets over one segment: the worker opens it for the first and keeps it for the second.
    # The sender shrinks it in between. A mapped read past the new end raised SIGBUS and killed the
    # worker; now the second bucket is refused, and the worker (INCONSISTENT: the first bucket had
    # loaded) takes the next good update.
    before = worker.status()
    version = before.weights_version + 1
    named = worker.checkpoint(version)
    packed = helpers.pack(named)
    seg = segments.create(packed.data)
    payload = helpers.shm_payload(seg, len(packed.data))
    half = len(packed.specs) // 2
    feed = helpers.RequestFeed()
    call = worker.stub.PushWeights(iter(feed), timeout=60)
    feed.send(helpers.header(version))
    feed.send(helpers.bucket(0, packed.specs[:half], [payload]))
    first = next(call)
    assert first.ack.index == 0 and first.ack.tensors_loaded == half
    os.truncate(os.path.join(SHM_DIR, seg.name), 4096)
    feed.send(helpers.bucket(1, packed.specs[half:], [payload]))
    feed.send(helpers.commit(2))
    feed.end()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    outcome = failed_outcome(err.value, [first])
    assert_weightwire_error(outcome, "INVALID_SIZE")
    assert worker.alive(), worker.proc.stderr_text()
    st = worker.status()
    assert (st.weights_version, st.state, st.open_mappings) == (
        before.weights_version,
        pb.WORKER_STATE_INCONSISTENT,
        0,
    ), st
    assert st.last_error.reason == "INVALID_SIZE" and "shrank" in st.last_error.message
    worker.push_good(segments)


def _label(uuid: str) -> pb.DeviceId:
    return pb.DeviceId(kind=pb.DEVICE_KIND_HOST, uuid=uuid)


def test_doubly_prefixed_own_label_is_not_the_worker_s_own(worker: Worker) -> None:
    # Normalising twice made "GPU-GPU-<own>" the worker's own: it was imported ahead of a payload
    # labelled exactly with the own UUID, and the ack named "gpu-<own>" as the source.
    own = worker.status().device.uuid
    before = worker.status()
    version = before.weights_version + 1
    packed = helpers.pack(worker.checkpoint(version))
    decoy = bytes(len(packed.data))  # zeros: what must never reach the model
    payloads = [
        helpers.inline_payload(decoy, device=_label("GPU-GPU-" + own)),
        helpers.inline_payload(packed.data, device=_label(own)),
    ]
    outcome = push_raw(
        worker.stub, [helpers.header(version), helpers.bucket(0, packed.specs, payloads), helpers.commit(1)]
    )
    assert_weightwire_error(outcome, "PAYLOAD_LABEL_MISSING")
    assert "prefix twice" in outcome.message
    worker.expect_unchanged(before)


def test_nvml_form_of_the_own_label_is_the_own_device_in_canonical_form(worker: Worker) -> None:
    own = worker.status().device.uuid
    version = worker.next_version()
    packed = helpers.pack(worker.checkpoint(version))
    nvml = helpers.inline_payload(packed.data, device=_label("GPU-" + own.upper()))
    outcome = push_raw(
        worker.stub, [helpers.header(version), helpers.bucket(0, packed.specs, [nvml]), helpers.commit(1)]
    )
    assert outcome.code == grpc.StatusCode.OK, outcome.describe()
    assert outcome.acks[0].source_device == pb.DeviceId(kind=pb.DEVICE_KIND_HOST, uuid=own)
    # The same device twice, once in each form, is one label twice.
    before = worker.status()
    version += 1
    packed = helpers.pack(worker.checkpoint(version))
    twice = [
        helpers.inline_payload(packed.data, device=_label("GPU-" + own)),
        helpers.inline_payload(packed.data, device=_label(own)),
    ]
    outcome = push_raw(
        worker.stub, [helpers.header(version), helpers.bucket(0, packed.specs, twice), helpers.commit(1)]
    )
    assert_weightwire_error(outcome, "DUPLICATE_PAYLOAD_LABEL")
    worker.expect_unchanged(before)


FOREIGN_HOST = pb.DeviceId(kind=pb.DEVICE_KIND_HOST, uuid="0badb007-0000-0000-0000-000000000000")


def test_a_malformed_payload_is_refused_even_when_another_one_is_selected(worker: Worker) -> None:
    # The whole message is validated: an inline payload whose length differs from size_bytes, or
    # an shm name outside the rule, is refused also when it belongs to another device.
    before = worker.status()
    version = before.weights_version + 1
    packed = helpers.pack(worker.checkpoint(version))
    short = helpers.inline_payload(packed.data[:-8], device=FOREIGN_HOST, size_bytes=len(packed.data))
    bad_name = helpers.shm_payload("/ww-../../etc/passwd", len(packed.data), device=FOREIGN_HOST)
    for broken, reason in ((short, "INVALID_SIZE"), (bad_name, "INVALID_SHM_NAME")):
        own = helpers.inline_payload(packed.data)
        outcome = push_raw(
            worker.stub,
            [helpers.header(version), helpers.bucket(0, packed.specs, [own, broken]), helpers.commit(1)],
        )
        assert_weightwire_error(outcome, reason)
        worker.expect_unchanged(before)


def test_a_malformed_payload_is_refused_in_a_bucket_the_worker_owns_nothing_of(worker: Worker) -> None:
    before = worker.status()
    version = before.weights_version + 1
    packed = helpers.pack({"not.owned.by.this.worker": torch.zeros(4)})
    bad_name = helpers.shm_payload("ww-a/../../etc/shadow", len(packed.data))
    outcome = push_raw(
        worker.stub,
        [
            helpers.header(version, scope=pb.UPDATE_SCOPE_PARTIAL),
            helpers.bucket(0, packed.specs, [bad_name]),
            helpers.commit(1),
        ],
    )
    assert_weightwire_error(outcome, "INVALID_SHM_NAME")
    worker.expect_unchanged(before)


MEGABYTES = 5 * 1024 * 1024


def _status_error_bytes(worker: Worker) -> int:
    """GetStatus through a default client (4 MiB receive limit) works; the bytes of its last error."""
    st = worker.status()
    return len(st.last_error.message.encode())


@pytest.mark.parametrize("field", ["fingerprint", "tensor_name", "device_label", "update_id"])
def test_megabytes_of_client_text_are_neither_stored_nor_echoed(worker: Worker, field: str) -> None:
    # A refused update that quoted megabytes of client text made every later GetStatus fail for a
    # default client (over its 4 MiB message limit) until another failure replaced it.
    before = worker.status()
    version = before.weights_version + 1
    packed = helpers.pack(worker.checkpoint(version))
    huge = "x" * MEGABYTES
    head = helpers.header(version)
    specs = list(packed.specs)
    payload = helpers.inline_payload(packed.data)
    if field == "fingerprint":
        head.header.manifest_fingerprint, reason = huge, "MANIFEST_CHANGED"
    elif field == "update_id":
        head.header.update_id, reason = huge, "MALFORMED_STREAM"
    elif field == "tensor_name":
        specs[0] = pb.TensorSpec(name=huge, dtype=pb.DTYPE_UNSPECIFIED, shape=[1])
        reason = "DTYPE_UNSPECIFIED"
    else:
        payload.device.uuid, reason = huge, "PAYLOAD_LABEL_MISSING"
    outcome = push_raw(worker.stub, [head, helpers.bucket(0, specs, [payload]), helpers.commit(1)])
    assert_weightwire_error(outcome, reason)
    assert len(outcome.message.encode()) <= 1024
    assert sum(len(k) + len(v.encode()) for k, v in outcome.info.metadata.items()) <= 6144  # type: ignore[union-attr]
    assert _status_error_bytes(worker) <= 1024
    worker.expect_unchanged(before)


def test_an_update_id_is_echoed_up_to_its_bound(worker: Worker) -> None:
    version = worker.next_version()
    label = "é" * 128  # 256 bytes: the most an update_id may carry
    outcome = push_raw(
        worker.stub,
        helpers.full_update_requests(version, worker.checkpoint(version), None, buckets=1, update_id=label),
    )
    assert outcome.code == grpc.StatusCode.OK, outcome.describe()
    assert outcome.result is not None and outcome.result.update_id == label
    assert worker.status().last_result.update_id == label


@pytest.mark.parametrize("name", ["é" * 2000, "中" * 1000, "😀" * 1000], ids=["latin", "cjk", "emoji"])
def test_non_ascii_text_in_an_error_still_fits_the_status(worker: Worker, name: str) -> None:
    # Messages were cut by characters; gRPC limits the trailer in bytes (a non-ASCII byte takes
    # three once percent-encoded), so the client got RESOURCE_EXHAUSTED instead of the reason.
    before = worker.status()
    version = before.weights_version + 1
    spec = pb.TensorSpec(name=name, dtype=pb.DTYPE_UNSPECIFIED, shape=[1])
    outcome = push_raw(
        worker.stub,
        [
            helpers.header(version),
            helpers.bucket(0, [spec], [helpers.inline_payload(b"\0" * 4)]),
            helpers.commit(1),
        ],
    )
    assert_weightwire_error(outcome, "DTYPE_UNSPECIFIED")
    assert (
        outcome.info is not None
        and outcome.info.metadata["tensor"]
        and name.startswith(outcome.info.metadata["tensor"].removesuffix("..."))
    )
    worker.expect_unchanged(before)


def test_an_error_listing_hundreds_of_labels_still_fits_the_status(worker: Worker) -> None:
    before = worker.status()
    version = before.weights_version + 1
    packed = helpers.pack({"model.norm.weight": worker.checkpoint(version)["model.norm.weight"]})
    foreign = [
        helpers.inline_payload(
            packed.data, device=pb.DeviceId(kind=pb.DEVICE_KIND_HOST, uuid=f"{i:08x}-" + "0" * 100)
        )
        for i in range(300)
    ]
    head = helpers.header(version, scope=pb.UPDATE_SCOPE_PARTIAL)
    outcome = push_raw(worker.stub, [head, helpers.bucket(0, packed.specs, foreign), helpers.commit(1)])
    assert_weightwire_error(outcome, "NO_PAYLOAD_FOR_DEVICE")
    assert outcome.info is not None and outcome.info.metadata["labels"].startswith("host:00000000-")
    worker.expect_unchanged(before)


# --- streams that go quiet, and what comes after a commit -------------------------------------


def _thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_idle_streams_do_not_starve_status_manifest_or_health() -> None:
    # A handful of PushWeights streams that open and send nothing (and one that sends a header and
    # goes quiet) used to hold every thread of the worker's one pool: GetStatus, GetManifest and
    # the health check timed out. This worker keeps the default idle deadline (minutes).
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    proc = start_worker()
    channel = grpc.insecure_channel(proc.address)
    stub = pb_grpc.WeightTransferServiceStub(channel)
    feeds = [helpers.RequestFeed() for _ in range(12)]
    try:
        base = _thread_count(proc.proc.pid)
        feeds[0].send(helpers.header(1))
        calls = [stub.PushWeights(iter(feed), timeout=120) for feed in feeds]
        # The worker has taken the streams on (one thread each, or more).
        assert helpers.wait_until(lambda: _thread_count(proc.proc.pid) >= base + 8, timeout=60)
        assert helpers.wait_until(
            lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=30).state == pb.WORKER_STATE_UPDATING
        )
        assert stub.GetManifest(pb.GetManifestRequest(), timeout=30).manifest.tensors
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        for call in calls:
            call.cancel()
        assert helpers.wait_until(
            lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=30).state == pb.WORKER_STATE_CONSISTENT
        )
    finally:
        for feed in feeds:
            feed.end()
        channel.close()
        proc.stop()


def _worker_deadline(call: object, worker: Worker) -> object:
    with pytest.raises(grpc.RpcError) as err:
        list(call)  # type: ignore[call-overload]
    outcome = failed_outcome(err.value)
    assert_weightwire_error(outcome, "DEADLINE_EXCEEDED")  # the worker's, with its ErrorInfo
    assert f"{IDLE_TIMEOUT_S} s" in outcome.message
    return outcome


def test_a_stream_that_sends_nothing_ends_with_a_reason(
    worker: Worker, segments: helpers.ShmSegments
) -> None:
    before = worker.status()
    feed = helpers.RequestFeed()
    try:
        outcome = _worker_deadline(worker.stub.PushWeights(iter(feed), timeout=120), worker)
    finally:
        feed.end()
    assert "the header" in outcome.message  # type: ignore[attr-defined]
    st = worker.expect_unchanged(before)
    assert st.last_error.reason == "DEADLINE_EXCEEDED" and st.updates_failed == before.updates_failed + 1
    worker.push_good(segments)


def test_a_header_then_silence_does_not_hold_the_update(
    worker: Worker, segments: helpers.ShmSegments
) -> None:
    before = worker.status()
    feed = helpers.RequestFeed()
    feed.send(helpers.header(before.weights_version + 1))
    try:
        outcome = _worker_deadline(worker.stub.PushWeights(iter(feed), timeout=120), worker)
    finally:
        feed.end()
    assert "the next bucket or the commit" in outcome.message  # type: ignore[attr-defined]
    worker.expect_unchanged(before)
    worker.push_good(segments)


@pytest.mark.parametrize("after", ["commit", "header", "bucket"])
def test_a_message_after_the_commit_is_malformed_and_nothing_commits(
    worker: Worker, segments: helpers.ShmSegments, after: str
) -> None:
    # header -> bucket -> commit -> commit used to end OK and commit, while the contract says a
    # message after the commit is MALFORMED_STREAM. The worker now commits only when the stream
    # ends right after the commit.
    before = worker.status()
    version = before.weights_version + 1
    reqs = helpers.full_update_requests(version, worker.checkpoint(version), segments, buckets=1)
    extra = {"commit": reqs[-1], "header": helpers.header(version + 1), "bucket": reqs[1]}[after]
    outcome = push_raw(worker.stub, [*reqs, extra])
    assert_weightwire_error(outcome, "MALFORMED_STREAM")
    assert "after the commit" in outcome.message and outcome.result is None
    st = worker.status()
    # Not committed: version kept; the bucket had loaded, so the worker is INCONSISTENT.
    assert (st.weights_version, st.state, st.open_mappings) == (
        before.weights_version,
        pb.WORKER_STATE_INCONSISTENT,
        0,
    ), st
    worker.push_good(segments)


def test_a_commit_the_client_does_not_close_after_is_not_applied(
    worker: Worker, segments: helpers.ShmSegments
) -> None:
    before = worker.status()
    version = before.weights_version + 1
    reqs = helpers.full_update_requests(version, worker.checkpoint(version), segments, buckets=1)
    feed = helpers.RequestFeed()
    for req in reqs:
        feed.send(req)
    try:
        outcome = _worker_deadline(worker.stub.PushWeights(iter(feed), timeout=120), worker)
    finally:
        feed.end()
    assert "end of the stream after the commit" in outcome.message  # type: ignore[attr-defined]
    assert worker.status().weights_version == before.weights_version
    worker.push_good(segments)


def test_a_retry_right_after_a_cancelled_update_is_never_refused(
    worker: Worker, segments: helpers.ShmSegments
) -> None:
    # A trainer whose push failed elsewhere cancels this worker's stream and retries at once; the
    # cancelled update may still be unwinding. The retry must not get UPDATE_IN_PROGRESS for it.
    for _ in range(20):
        version = worker.next_version()
        reqs = helpers.full_update_requests(version, worker.checkpoint(version), segments, buckets=2)
        feed = helpers.RequestFeed()
        call = worker.stub.PushWeights(iter(feed), timeout=60)
        feed.send(reqs[0])
        feed.send(reqs[1])
        assert next(call).ack.index == 0
        call.cancel()
        feed.end()
        outcome = push_raw(worker.stub, reqs)
        assert outcome.code == grpc.StatusCode.OK, outcome.describe()
        assert worker.status().weights_version == version
        segments.close()
