"""A real worker server in the test process: good updates land bit-for-bit, the state machine,
concurrency, cancellation, mapping release, health, reflection, listeners and tokens."""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import (
    RequestFeed,
    ShmSegments,
    bucket,
    commit,
    full_update_requests,
    header,
    inline_payload,
    pack,
    push,
    shm_payload,
    unary_error,
    wait_until,
)
from weightwire.adapters.torch.demo import expected_shard, full_checkpoint
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ParallelRank
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

NORM = "model.norm.weight"


def status_of(worker) -> pb.GetStatusResponse:
    return worker.stub().GetStatus(pb.GetStatusRequest())


def health_of(worker, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(worker.address))
    return stub.Check(health_pb2.HealthCheckRequest(service=service)).status


def assert_holds(worker, full: dict[str, torch.Tensor]) -> None:
    want = expected_shard(full, worker.rank, worker.config)
    state = worker.state()
    assert sorted(state) == sorted(want)
    for name, t in want.items():
        assert torch.equal(state[name], t), name


@pytest.mark.parametrize("rpc", ["stream", "whole"])
@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("buckets", [1, 3])
def test_full_update_lands(
    inproc_worker, segments: ShmSegments, transport: str, buckets: int, rpc: str
) -> None:
    """On a PushWeights stream, and as the same messages in one PushUpdate call: the same answers."""
    worker = inproc_worker(seed=0)
    full = full_checkpoint(worker.config, 1)
    requests = full_update_requests(
        1, full, segments if transport == "shm" else None, buckets=buckets, update_id="step-1"
    )
    out = push(worker.stub(), requests, whole=rpc == "whole")
    assert out.code == grpc.StatusCode.OK, out.message
    assert [a.index for a in out.acks] == list(range(buckets))
    kind = pb.TRANSPORT_KIND_HOST_SHM if transport == "shm" else pb.TRANSPORT_KIND_INLINE
    for ack in out.acks:
        assert ack.transport == kind and ack.handle_opened and not ack.peer_device_import
        assert DeviceRef.from_proto(ack.source_device) == DeviceRef.host()
    result = out.result
    assert result is not None
    assert (result.version, result.previous_version, result.bucket_count) == (1, 0, buckets)
    assert result.tensors_loaded == len(full) and result.bytes_loaded == sum(t.nbytes for t in full.values())
    assert result.state == pb.WORKER_STATE_CONSISTENT and result.update_id == "step-1"
    assert_holds(worker, full)
    status = status_of(worker)
    assert (status.weights_version, status.state, status.open_mappings) == (1, pb.WORKER_STATE_CONSISTENT, 0)
    assert status.last_result == result and not status.HasField("last_error")


def test_successive_versions_and_segment_reuse(inproc_worker, segments: ShmSegments) -> None:
    """A sender reuses one segment for several buckets and updates: opened once per update."""
    worker = inproc_worker()
    stub = worker.stub()
    names = list(full_checkpoint(worker.config, 0))
    half = len(names) // 2
    seg = segments.create(b"", size=1 << 20)
    for version in (1, 2, 5):
        full = full_checkpoint(worker.config, version)
        first, second = pack({n: full[n] for n in names[:half]}), pack({n: full[n] for n in names[half:]})
        # Both buckets share the segment: the second layout sits after the first.
        base = (len(first.data) + 4095) // 4096 * 4096
        seg.buf[: len(first.data)] = bytes(first.data)
        seg.buf[base : base + len(second.data)] = bytes(second.data)
        for spec in second.specs:
            spec.offset_bytes += base
        size = base + len(second.data)
        out = push(
            stub,
            [
                header(version),
                bucket(0, first.specs, [shm_payload(seg, size)]),
                bucket(1, second.specs, [shm_payload(seg, size)]),
                commit(2),
            ],
        )
        assert out.code == grpc.StatusCode.OK, out.message
        assert [a.handle_opened for a in out.acks] == [True, False]
        assert out.result is not None and out.result.handles_opened == 1
        assert_holds(worker, full)
    assert status_of(worker).weights_version == 5


def test_unowned_tensors_skipped_and_unowned_bucket_never_opened(
    inproc_worker, segments: ShmSegments
) -> None:
    rank = ParallelRank(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    worker = inproc_worker(rank)
    full = full_checkpoint(worker.config, 1)
    owned = set(worker.adapter.manifest().tensors)
    unowned = [n for n in full if n not in owned]
    stage0 = {n: full[n] for n in unowned[::2]}
    mixed = {n: t for n, t in full.items() if n not in stage0}
    p_all, p_other = pack(mixed), pack(stage0)
    seg = segments.create(p_all.data)
    reqs = [
        header(1),
        # Nothing owned here, and the segment does not exist: acked without opening anything.
        bucket(0, p_other.specs, [shm_payload("ww-test-never-created", len(p_other.data))]),
        bucket(1, p_all.specs, [shm_payload(seg, len(p_all.data))]),
        commit(2),
    ]
    out = push(worker.stub(), reqs)
    assert out.code == grpc.StatusCode.OK, out.message
    skip, load = out.acks
    assert (
        skip.tensors_loaded,
        skip.tensors_skipped,
        skip.handle_opened,
        skip.HasField("source_device"),
    ) == (0, len(stage0), False, False)
    assert (load.tensors_loaded, load.tensors_skipped, load.handle_opened) == (
        len(owned),
        len(mixed) - len(owned),
        True,
    )
    assert load.bytes_loaded == sum(full[n].nbytes for n in owned)
    assert_holds(worker, full)


def test_gathered_bucket_picks_own_label(inproc_worker, segments: ShmSegments) -> None:
    """Several labelled copies: the worker imports its own, whatever the order."""
    worker = inproc_worker()
    full = full_checkpoint(worker.config, 1)
    good = pack(full)
    wrong = pack({n: torch.zeros_like(t) for n, t in full.items()})
    other_gpu = pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid="0badc0de-0000-0000-0000-000000000000")
    other_host = pb.DeviceId(kind=pb.DEVICE_KIND_HOST, uuid="0badb007-0000-0000-0000-000000000000")
    payloads = [
        shm_payload(segments.create(wrong.data), len(wrong.data), device=other_host),
        inline_payload(wrong.data, device=other_gpu),
        shm_payload(segments.create(good.data), len(good.data)),
    ]
    out = push(worker.stub(), [header(1), bucket(0, good.specs, payloads), commit(1)])
    assert out.code == grpc.StatusCode.OK, out.message
    assert_holds(worker, full)


def test_partial_update(inproc_worker, segments: ShmSegments) -> None:
    worker = inproc_worker(seed=0)
    stub = worker.stub()
    v1 = full_checkpoint(worker.config, 1)
    assert push(stub, full_update_requests(1, v1, segments)).code == grpc.StatusCode.OK
    v2 = full_checkpoint(worker.config, 2)
    out = push(
        stub, full_update_requests(2, {NORM: v2[NORM]}, segments, buckets=1, scope=pb.UPDATE_SCOPE_PARTIAL)
    )
    assert out.code == grpc.StatusCode.OK, out.message
    assert (
        out.result is not None
        and out.result.scope == pb.UPDATE_SCOPE_PARTIAL
        and out.result.tensors_loaded == 1
    )
    assert status_of(worker).state == pb.WORKER_STATE_CONSISTENT
    assert_holds(worker, {**v1, NORM: v2[NORM]})


def test_inconsistent_until_a_good_full_update(inproc_worker, segments: ShmSegments) -> None:
    worker = inproc_worker()
    stub = worker.stub()
    assert health_of(worker) == health_pb2.HealthCheckResponse.SERVING
    full = full_checkpoint(worker.config, 1)
    # Loads one bucket, then the commit finds the rest missing.
    out = push(stub, full_update_requests(1, {NORM: full[NORM]}, segments, buckets=1))
    assert out.reason == "INCOMPLETE_UPDATE"
    assert status_of(worker).state == pb.WORKER_STATE_INCONSISTENT
    assert health_of(worker) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert (
        health_of(worker, "weightwire.v1.WeightTransferService") == health_pb2.HealthCheckResponse.NOT_SERVING
    )
    # A verified partial update does not make a mixed model whole.
    out = push(
        stub, full_update_requests(1, {NORM: full[NORM]}, segments, buckets=1, scope=pb.UPDATE_SCOPE_PARTIAL)
    )
    assert out.code == grpc.StatusCode.OK and out.result is not None
    assert out.result.state == pb.WORKER_STATE_INCONSISTENT
    assert health_of(worker) == health_pb2.HealthCheckResponse.NOT_SERVING
    # A failure before anything loads keeps it INCONSISTENT (not "repaired").
    assert push(stub, [header(9, manifest_fingerprint="x"), commit(0)]).reason == "MANIFEST_CHANGED"
    assert status_of(worker).state == pb.WORKER_STATE_INCONSISTENT
    out = push(stub, full_update_requests(2, full_checkpoint(worker.config, 2), segments))
    assert out.code == grpc.StatusCode.OK, out.message
    status = status_of(worker)
    assert (status.weights_version, status.state) == (2, pb.WORKER_STATE_CONSISTENT)
    assert health_of(worker) == health_pb2.HealthCheckResponse.SERVING
    assert (status.updates_succeeded, status.updates_failed) == (2, 2)


@pytest.mark.parametrize("rpc", ["stream", "whole"])
def test_second_concurrent_push_is_aborted(inproc_worker, segments: ShmSegments, rpc: str) -> None:
    """A second update, on a stream or as one PushUpdate call, while one runs: refused, the running
    one goes on and lands."""
    worker = inproc_worker()
    stub = worker.stub()
    full = full_checkpoint(worker.config, 1)
    reqs = full_update_requests(1, full, segments, buckets=2)
    feed = RequestFeed()
    call = stub.PushWeights(iter(feed), timeout=60)
    feed.send(reqs[0])
    feed.send(reqs[1])
    first_ack = next(call)
    assert first_ack.ack.index == 0
    assert status_of(worker).state == pb.WORKER_STATE_UPDATING
    other = push(stub, full_update_requests(7, full, segments), whole=rpc == "whole")
    assert (other.code, other.reason) == (grpc.StatusCode.ABORTED, "UPDATE_IN_PROGRESS")
    for req in reqs[2:]:
        feed.send(req)
    feed.end()  # the commit is the last message: the worker commits once the stream ends after it
    rest = list(call)
    assert rest[-1].result.version == 1
    assert status_of(worker).weights_version == 1
    assert_holds(worker, full)


def _worker_fds_of(name: str) -> list[str]:
    """The worker's read-only descriptors of a segment (the worker reads segments with pread and
    never maps them; the test's own read-write mapping and descriptor are not counted)."""
    path = f"/dev/shm/{name}"
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != path:
                continue
            with open(f"/proc/self/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration):
            continue  # closed meanwhile
        if flags & os.O_ACCMODE == os.O_RDONLY:
            found.append(fd)
    return found


def _segment_mapped_by_worker(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(name in line and line.split()[1] == "r--s" for line in f)


def test_mappings_read_only_counted_and_released(inproc_worker, segments: ShmSegments) -> None:
    worker = inproc_worker()
    stub = worker.stub()
    full = full_checkpoint(worker.config, 1)
    reqs = full_update_requests(1, full, segments, buckets=2)
    names = [r.bucket.payloads[0].host_shm.name for r in reqs[1:3]]
    feed = RequestFeed()
    call = stub.PushWeights(iter(feed), timeout=60)
    feed.send(reqs[0])
    feed.send(reqs[1])
    next(call)
    assert status_of(worker).open_mappings == 1
    assert len(_worker_fds_of(names[0])) == 1  # opened read-only, once
    assert not _segment_mapped_by_worker(names[0])  # read, never mapped (a shrinking segment cannot fault it)
    feed.send(reqs[2])
    next(call)
    assert status_of(worker).open_mappings == 2
    feed.send(reqs[3])
    feed.end()
    assert list(call)[-1].result.version == 1
    assert status_of(worker).open_mappings == 0
    assert _worker_fds_of(names[0]) == [] and _worker_fds_of(names[1]) == []
    # The worker never unlinks the sender's segments.
    assert all(os.path.exists(f"/dev/shm/{n}") for n in names)


def test_cancelled_update_leaves_worker_inconsistent(inproc_worker, segments: ShmSegments) -> None:
    worker = inproc_worker()
    stub = worker.stub()
    reqs = full_update_requests(1, full_checkpoint(worker.config, 1), segments, buckets=2)
    feed = RequestFeed()
    call = stub.PushWeights(iter(feed), timeout=60)
    feed.send(reqs[0])
    feed.send(reqs[1])
    next(call)
    call.cancel()
    assert wait_until(lambda: status_of(worker).state != pb.WORKER_STATE_UPDATING)
    status = status_of(worker)
    assert (status.weights_version, status.state) == (0, pb.WORKER_STATE_INCONSISTENT)
    assert status.last_error.code == "CANCELLED"
    assert status.open_mappings == 0
    assert health_of(worker) == health_pb2.HealthCheckResponse.NOT_SERVING
    # And the worker takes the next update.
    assert (
        push(stub, full_update_requests(2, full_checkpoint(worker.config, 2), segments)).code
        == grpc.StatusCode.OK
    )


def test_cancel_before_anything_loaded_keeps_worker_consistent(inproc_worker) -> None:
    worker = inproc_worker()
    feed = RequestFeed()
    call = worker.stub().PushWeights(iter(feed), timeout=60)
    feed.send(header(1))
    assert wait_until(lambda: status_of(worker).state == pb.WORKER_STATE_UPDATING)
    call.cancel()
    assert wait_until(lambda: status_of(worker).state != pb.WORKER_STATE_UPDATING)
    assert status_of(worker).state == pb.WORKER_STATE_CONSISTENT


def engine_load(
    monkeypatch: pytest.MonkeyPatch, adapter: object, load: Callable[[object], None]
) -> Callable[[object], None]:
    """Make ``load`` the engine's load, also where the worker uses a prepared load (views it keeps,
    ``views.batch_load``); returns the adapter's own load, for ``load`` to call."""
    prepare = adapter.prepare_load  # type: ignore[attr-defined]
    monkeypatch.setattr(adapter, "load", load)
    monkeypatch.setattr(adapter, "prepare_load", lambda named: lambda: load(named))
    return lambda named: prepare(named)()


def test_load_failure_is_internal_and_inconsistent(
    inproc_worker, segments: ShmSegments, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = inproc_worker()
    calls: list[int] = []

    def failing_load(named: object) -> None:
        calls.append(1)
        raise RuntimeError("device lost")

    engine_load(monkeypatch, worker.adapter, failing_load)
    ends: list[bool] = []
    monkeypatch.setattr(worker.adapter, "end_update", ends.append)
    out = push(worker.stub(), full_update_requests(1, full_checkpoint(worker.config, 1), segments))
    assert (out.code, out.reason) == (grpc.StatusCode.INTERNAL, "LOAD_FAILED")
    assert "device lost" in out.message
    assert calls == [1] and ends == [False]
    assert status_of(worker).state == pb.WORKER_STATE_INCONSISTENT


def test_adapter_hooks_called_in_order(
    inproc_worker, segments: ShmSegments, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = inproc_worker()
    events: list[str] = []
    monkeypatch.setattr(worker.adapter, "begin_update", lambda v: events.append(f"begin {v}"))
    real_load = engine_load(
        monkeypatch, worker.adapter, lambda named: (events.append(f"load {len(named)}"), real_load(named))
    )
    monkeypatch.setattr(worker.adapter, "end_update", lambda ok: events.append(f"end {ok}"))
    full = full_checkpoint(worker.config, 3)
    assert push(worker.stub(), full_update_requests(3, full, segments, buckets=2)).code == grpc.StatusCode.OK
    assert events == ["begin 3", f"load {len(full) - len(full) // 2}", f"load {len(full) // 2}", "end True"]


def test_manifest_rpc(inproc_worker) -> None:
    rank = ParallelRank(tp_rank=1, tp_size=2, pp_rank=0, pp_size=2)
    worker = inproc_worker(rank)
    m = worker.stub().GetManifest(pb.GetManifestRequest()).manifest
    local = worker.adapter.manifest()
    assert m.fingerprint == local.fingerprint and m.worker_id == "tp1-pp0"
    assert DeviceRef.from_proto(m.device) == DeviceRef.host()
    assert (m.rank.tp_rank, m.rank.tp_size, m.rank.pp_rank, m.rank.pp_size) == (1, 2, 0, 2)
    assert (m.layer_range.start_layer, m.layer_range.end_layer, m.layer_range.num_layers) == (0, 2, 4)
    assert {t.name: tuple(t.shape) for t in m.tensors} == {n: t.shape for n, t in local.tensors.items()}
    assert m.instance_id and m.engine == "torch"
    assert set(m.transports) == {
        pb.TRANSPORT_KIND_HOST_SHM,
        pb.TRANSPORT_KIND_TRANSFER_GROUP,
        pb.TRANSPORT_KIND_INLINE,
    }


def test_reflection_lists_services(inproc_worker) -> None:
    worker = inproc_worker()
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(worker.address))
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"weightwire.v1.WeightTransferService", "grpc.health.v1.Health"} <= names


def test_default_listener_is_a_unix_socket_in_a_private_directory(inproc_worker) -> None:
    worker = inproc_worker()
    assert worker.address.startswith("unix:/")
    path = worker.address.removeprefix("unix:")
    directory = os.path.dirname(path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    worker.server.stop(grace=0)
    assert not os.path.exists(directory)


def test_tcp_loopback_port_zero_reports_real_port(inproc_worker) -> None:
    worker = inproc_worker(listen="127.0.0.1:0")
    host, port = worker.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert worker.stub().GetStatus(pb.GetStatusRequest()).weights_version == 0


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "192.0.2.1:0"])
def test_non_loopback_needs_a_token(inproc_worker, listen: str) -> None:
    with pytest.raises(ValueError, match="requires a token"):
        inproc_worker(listen=listen)


def test_token_required_when_set(inproc_worker, segments: ShmSegments) -> None:
    worker = inproc_worker(listen="127.0.0.1:0", token="s3cret-token")
    stub = pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(worker.address))
    for md, reason in (
        (None, "MISSING_TOKEN"),
        ([("authorization", "Bearer wrong")], "INVALID_TOKEN"),
        ([("authorization", "s3cret-token")], "INVALID_TOKEN"),
    ):
        code, got, _ = unary_error(lambda md=md: stub.GetManifest(pb.GetManifestRequest(), metadata=md))
        assert (code, got) == (grpc.StatusCode.UNAUTHENTICATED, reason)
        code, got, _ = unary_error(lambda md=md: stub.GetStatus(pb.GetStatusRequest(), metadata=md))
        assert (code, got) == (grpc.StatusCode.UNAUTHENTICATED, reason)
        out = push(stub, full_update_requests(1, full_checkpoint(worker.config, 1), segments), metadata=md)
        assert (out.code, out.reason, out.acks) == (grpc.StatusCode.UNAUTHENTICATED, reason, [])
    good = [("authorization", "Bearer s3cret-token")]
    assert stub.GetManifest(pb.GetManifestRequest(), metadata=good).manifest.worker_id == "tp0-pp0"
    out = push(stub, full_update_requests(1, full_checkpoint(worker.config, 1), segments), metadata=good)
    assert out.code == grpc.StatusCode.OK, out.message
    # Refused calls never reached the service; health stays open for probes.
    assert stub.GetStatus(pb.GetStatusRequest(), metadata=good).updates_failed == 0
    assert health_of(worker) == health_pb2.HealthCheckResponse.SERVING


def test_token_on_non_loopback(inproc_worker) -> None:
    worker = inproc_worker(listen="0.0.0.0:0", token="t")
    port = worker.address.rsplit(":", 1)[1]
    stub = pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    assert unary_error(lambda: stub.GetStatus(pb.GetStatusRequest()))[1] == "MISSING_TOKEN"
    assert (
        stub.GetStatus(pb.GetStatusRequest(), metadata=[("authorization", "Bearer t")]).weights_version == 0
    )


def test_stop_fails_a_running_update_and_releases_mappings(inproc_worker, segments: ShmSegments) -> None:
    worker = inproc_worker()
    reqs = full_update_requests(1, full_checkpoint(worker.config, 1), segments, buckets=2)
    feed = RequestFeed()
    call = worker.stub().PushWeights(iter(feed), timeout=60)
    feed.send(reqs[0])
    feed.send(reqs[1])
    next(call)
    name = reqs[1].bucket.payloads[0].host_shm.name
    assert _worker_fds_of(name)
    done = threading.Event()
    threading.Thread(target=lambda: (worker.server.stop(grace=0), done.set()), daemon=True).start()
    assert done.wait(30)
    feed.end()
    assert _worker_fds_of(name) == []
    assert worker.server.service.state == pb.WORKER_STATE_INCONSISTENT


def test_a_new_update_waits_for_a_cancelled_one_to_end(
    inproc_worker, segments: ShmSegments, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A trainer retries right after its update failed elsewhere and it cancelled this worker's
    # stream; the engine is still inside a load of the cancelled update. The retry must wait for
    # that update to end, then land, instead of getting UPDATE_IN_PROGRESS for it.
    caplog.set_level(logging.INFO, logger="weightwire.server.worker.service")
    worker = inproc_worker()
    stub = worker.stub()
    full = full_checkpoint(worker.config, 1)
    reqs = full_update_requests(1, full, segments, buckets=2)
    in_load, let_go = threading.Event(), threading.Event()

    def slow_load(views):  # an engine whose load takes a while
        in_load.set()
        assert let_go.wait(60)
        real_load(views)

    real_load = engine_load(monkeypatch, worker.adapter, slow_load)
    feed = RequestFeed()
    call = stub.PushWeights(iter(feed), timeout=60)
    feed.send(reqs[0])
    feed.send(reqs[1])
    assert in_load.wait(30)
    call.cancel()
    feed.end()
    retry: dict[str, object] = {}
    thread = threading.Thread(target=lambda: retry.update(outcome=push(stub, reqs)), daemon=True)
    thread.start()
    assert wait_until(
        lambda: "waits for update 1, cancelled by its client" in caplog.text or "outcome" in retry
    )
    let_go.set()
    thread.join(60)
    outcome = retry["outcome"]
    assert outcome.code == grpc.StatusCode.OK, (outcome.code, outcome.reason, outcome.message)  # type: ignore[attr-defined]
    st = status_of(worker)
    assert (st.weights_version, st.state, st.open_mappings) == (1, pb.WORKER_STATE_CONSISTENT, 0)
    assert_holds(worker, full)


def test_the_last_version_a_worker_can_take_is_the_largest_int64(inproc_worker) -> None:
    # Decided: any positive int64 is a version; after 2^63-1 nothing is newer, so every later
    # update is STALE_VERSION (saying so) until the worker restarts at version 0.
    worker = inproc_worker()
    stub = worker.stub()
    full = full_checkpoint(worker.config, 1)
    last = 2**63 - 1
    assert push(stub, full_update_requests(last, full, None, buckets=1)).code == grpc.StatusCode.OK
    refused = push(stub, full_update_requests(last, full, None, buckets=1))
    assert (refused.code, refused.reason, refused.metadata["current_version"]) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "STALE_VERSION",
        str(last),
    )
    st = status_of(worker)
    assert (st.weights_version, st.state) == (last, pb.WORKER_STATE_CONSISTENT)
