"""Every server rule and every ErrorInfo reason, over the wire, against a real in-process server.

Requests are built from the generated stubs (not the client library). After every refused update
the weights version and the model's tensors are checked: unchanged, and INCONSISTENT only when
something had already been loaded.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable

import grpc
import pytest
import torch
from helpers import (
    Packed,
    ShmSegments,
    bucket,
    commit,
    full_update_requests,
    header,
    inline_payload,
    pack,
    push,
    shm_payload,
)
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.core.devices import DeviceRef
from weightwire.v1 import weight_transfer_pb2 as pb

NORM, HEAD = "model.norm.weight", "lm_head.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"
OTHER_GPU = pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid="0badc0de-0000-0000-0000-000000000000")
OTHER_HOST = pb.DeviceId(kind=pb.DEVICE_KIND_HOST, uuid="0badb007-0000-0000-0000-000000000000")


@dataclasses.dataclass
class Ctx:
    """What a case builds its requests from: the next version's checkpoint and shm segments."""

    full: dict[str, torch.Tensor]
    segments: ShmSegments
    fingerprint: str

    def packed(self, *names: str) -> Packed:
        return pack({n: self.full[n] for n in names})

    def shm_bucket(self, index: int, *names: str, **kw: object) -> pb.PushWeightsRequest:
        p = self.packed(*names)
        seg = self.segments.create(p.data)
        return bucket(index, p.specs, [shm_payload(seg, len(p.data))], **kw)

    def rest(self, start_index: int, *exclude: str) -> list[pb.PushWeightsRequest]:
        """One shm bucket with every tensor not in ``exclude``."""
        names = [n for n in self.full if n not in exclude]
        return [self.shm_bucket(start_index, *names)]


Case = Callable[[Ctx], list[pb.PushWeightsRequest]]


def with_spec(
    ctx: Ctx, mutate: Callable[[pb.TensorSpec], None], *, payload_size: int | None = None
) -> list[pb.PushWeightsRequest]:
    """header + one inline bucket (norm, lm_head) whose first spec is mutated, + commit."""
    p = ctx.packed(NORM, HEAD)
    mutate(p.specs[0])
    payload = inline_payload(p.data)
    if payload_size is not None:
        payload.size_bytes = payload_size
    return [header(1), bucket(0, p.specs, [payload]), commit(1)]


def with_payloads(ctx: Ctx, make: Callable[[Packed], list[pb.Payload]]) -> list[pb.PushWeightsRequest]:
    p = ctx.packed(NORM, HEAD)
    return [header(1), bucket(0, p.specs, make(p)), commit(1)]


def _set(**fields: object) -> Callable[[pb.TensorSpec], None]:
    def mutate(spec: pb.TensorSpec) -> None:
        for k, v in fields.items():
            if k == "shape":
                del spec.shape[:]
                spec.shape.extend(v)  # type: ignore[arg-type]
            else:
                setattr(spec, k, v)

    return mutate


def bad_second_bucket(ctx: Ctx) -> pb.PushWeightsRequest:
    p = ctx.packed(HEAD)
    _set(shape=[1])(p.specs[0])
    return bucket(1, p.specs, [inline_payload(p.data)])


def shm_name_case(bad_name: str) -> Case:
    return lambda c: with_payloads(c, lambda p: [shm_payload(bad_name, len(p.data))])


def _seg(ctx: Ctx, p: Packed, size: int | None = None) -> str:
    return ctx.segments.create(p.data, size=size).name


# (case, code, reason, loaded_before_failure)
REFUSALS: dict[str, tuple[Case, grpc.StatusCode, str, bool]] = {
    # --- the stream itself
    "bucket-before-header": (
        lambda c: [c.shm_bucket(0, NORM), commit(1)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_STREAM",
        False,
    ),
    "commit-before-header": (
        lambda c: [commit(0)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_STREAM",
        False,
    ),
    "empty-message": (
        lambda c: [header(1), pb.PushWeightsRequest()],
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_STREAM",
        False,
    ),
    "second-header": (
        lambda c: [header(1), header(2)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_STREAM",
        False,
    ),
    "no-commit": (
        lambda c: [header(1), c.shm_bucket(0, NORM)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_STREAM",
        True,
    ),
    "negative-bucket-index": (
        lambda c: [header(1), c.shm_bucket(-1, NORM)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_STREAM",
        False,
    ),
    # --- the header
    "scope-unspecified": (
        lambda c: [header(1, scope=pb.UPDATE_SCOPE_UNSPECIFIED), commit(0)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "SCOPE_UNSPECIFIED",
        False,
    ),
    "version-zero": (
        lambda c: [header(0), commit(0)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_VERSION",
        False,
    ),
    "version-negative": (
        lambda c: [header(-5), commit(0)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_VERSION",
        False,
    ),
    "manifest-changed": (
        lambda c: [header(1, manifest_fingerprint="0" * 32), commit(0)],
        grpc.StatusCode.FAILED_PRECONDITION,
        "MANIFEST_CHANGED",
        False,
    ),
    # --- tensor specs
    "empty-name": (
        lambda c: with_spec(c, _set(name="")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_STREAM",
        False,
    ),
    "dtype-unspecified": (
        lambda c: with_spec(c, _set(dtype=pb.DTYPE_UNSPECIFIED)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "DTYPE_UNSPECIFIED",
        False,
    ),
    "negative-dim": (
        lambda c: with_spec(c, _set(shape=[-64])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_SHAPE",
        False,
    ),
    "huge-shape": (
        lambda c: with_spec(c, _set(shape=[2**40, 2**40, 2**40])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_SHAPE",
        False,
    ),
    "negative-offset": (
        lambda c: with_spec(c, _set(offset_bytes=-4)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_OFFSET",
        False,
    ),
    "out-of-bounds": (
        lambda c: with_spec(c, _set(offset_bytes=1 << 20)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "TENSOR_OUT_OF_BOUNDS",
        False,
    ),
    "payload-too-small": (
        lambda c: with_spec(c, lambda s: None, payload_size=8),
        grpc.StatusCode.INVALID_ARGUMENT,
        "TENSOR_OUT_OF_BOUNDS",
        False,
    ),
    "shape-mismatch": (
        lambda c: with_spec(c, _set(shape=[32])),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SHAPE_MISMATCH",
        False,
    ),
    "dtype-mismatch": (
        lambda c: with_spec(c, _set(dtype=pb.DTYPE_INT32)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "DTYPE_MISMATCH",
        False,
    ),
    "duplicate-in-bucket": (
        lambda c: [
            header(1),
            bucket(0, [*c.packed(NORM).specs, *c.packed(NORM).specs], [inline_payload(c.packed(NORM).data)]),
            commit(1),
        ],
        grpc.StatusCode.INVALID_ARGUMENT,
        "DUPLICATE_TENSOR",
        False,
    ),
    "duplicate-across-buckets": (
        lambda c: [header(1), c.shm_bucket(0, NORM), c.shm_bucket(1, NORM), commit(2)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "DUPLICATE_TENSOR",
        True,
    ),
    "duplicate-bucket-index": (
        lambda c: [header(1), c.shm_bucket(0, NORM), c.shm_bucket(0, HEAD), commit(2)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "DUPLICATE_BUCKET",
        True,
    ),
    # --- payloads and labels
    "no-payload": (
        lambda c: with_payloads(c, lambda p: []),
        grpc.StatusCode.INVALID_ARGUMENT,
        "PAYLOAD_COUNT_MISMATCH",
        False,
    ),
    "label-missing": (
        lambda c: with_payloads(c, lambda p: [pb.Payload(size_bytes=len(p.data), inline_data=bytes(p.data))]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "PAYLOAD_LABEL_MISSING",
        False,
    ),
    "kind-unspecified": (
        lambda c: with_payloads(
            c, lambda p: [inline_payload(p.data, device=pb.DeviceId(uuid=DeviceRef.host().uuid))]
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "DEVICE_KIND_UNSPECIFIED",
        False,
    ),
    "duplicate-label": (
        lambda c: with_payloads(c, lambda p: [inline_payload(p.data), inline_payload(p.data)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "DUPLICATE_PAYLOAD_LABEL",
        False,
    ),
    "handle-missing": (
        lambda c: with_payloads(
            c, lambda p: [pb.Payload(device=DeviceRef.host().to_proto(), size_bytes=len(p.data))]
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "HANDLE_MISSING",
        False,
    ),
    "negative-size": (
        lambda c: with_payloads(c, lambda p: [inline_payload(p.data, size_bytes=-1)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_SIZE",
        False,
    ),
    "inline-length-differs": (
        lambda c: with_payloads(c, lambda p: [inline_payload(p.data + b"\0" * 8, size_bytes=len(p.data))]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_SIZE",
        False,
    ),
    "size-beyond-real-storage": (
        # The spec fits size_bytes, but the segment behind it is smaller: caught after opening.
        lambda c: with_payloads(c, lambda p: [shm_payload(_seg(c, p, size=64), len(p.data))]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_SIZE",
        False,
    ),
    **{
        f"shm-name-{i}": (
            shm_name_case(bad),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_SHM_NAME",
            False,
        )
        for i, bad in enumerate(
            ["psm_12345", "/ww-../etc/passwd", "ww-a/b", "../ww-x", "", "ww-", "ww-\u00e9"]
        )
    },
    "no-payload-for-device": (
        lambda c: with_payloads(
            c, lambda p: [inline_payload(p.data, device=OTHER_GPU), inline_payload(p.data, device=OTHER_HOST)]
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "NO_PAYLOAD_FOR_DEVICE",
        False,
    ),
    "peer-unavailable": (
        lambda c: [
            header(1, allow_peer_device_import=True),
            bucket(0, c.packed(NORM).specs, [inline_payload(c.packed(NORM).data, device=OTHER_GPU)]),
            commit(1),
        ],
        grpc.StatusCode.FAILED_PRECONDITION,
        "PEER_DEVICE_UNAVAILABLE",
        False,
    ),
    "cuda-handle-on-host-label": (
        lambda c: with_payloads(
            c,
            lambda p: [
                pb.Payload(
                    device=DeviceRef.host().to_proto(),
                    size_bytes=len(p.data),
                    cuda_ipc=pb.CudaIpcHandle(memory_handle=b"x"),
                )
            ],
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "TRANSPORT_UNAVAILABLE",
        False,
    ),
    "shm-segment-missing": (
        lambda c: with_payloads(c, lambda p: [shm_payload("ww-test-no-such-segment", len(p.data))]),
        grpc.StatusCode.FAILED_PRECONDITION,
        "HANDLE_OPEN_FAILED",
        False,
    ),
    # --- checksums
    "checksum-algorithm-unspecified": (
        lambda c: [
            header(1, verify_checksums=True),
            c.shm_bucket(0, NORM, checksum=pb.Checksum(value=1)),
            commit(1),
        ],
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_CHECKSUM",
        False,
    ),
    "checksum-mismatch": (
        lambda c: [
            header(1, verify_checksums=True),
            c.shm_bucket(0, NORM, checksum=pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32, value=12345)),
            commit(1),
        ],
        grpc.StatusCode.DATA_LOSS,
        "CHECKSUM_MISMATCH",
        False,
    ),
    # --- commit
    "bucket-count-mismatch": (
        lambda c: [header(1), *c.rest(0), commit(2)],
        grpc.StatusCode.FAILED_PRECONDITION,
        "BUCKET_COUNT_MISMATCH",
        True,
    ),
    "incomplete-full": (
        lambda c: [header(1), *c.rest(0, Q0, HEAD), commit(1)],
        grpc.StatusCode.FAILED_PRECONDITION,
        "INCOMPLETE_UPDATE",
        True,
    ),
    "second-bucket-bad": (
        lambda c: [header(1), c.shm_bucket(0, NORM), bad_second_bucket(c), commit(2)],
        grpc.StatusCode.FAILED_PRECONDITION,
        "SHAPE_MISMATCH",
        True,
    ),
}


@pytest.mark.parametrize("rpc", ["stream", "whole"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_update(case: str, rpc: str, inproc_worker, segments: ShmSegments) -> None:
    """Each refusal, on a PushWeights stream and as the same messages in one PushUpdate call."""
    make, code, reason, loaded = REFUSALS[case]
    worker = inproc_worker(seed=0)
    before = worker.state()
    stub = worker.stub()
    fingerprint = stub.GetManifest(pb.GetManifestRequest()).manifest.fingerprint
    ctx = Ctx(full_checkpoint(worker.config, 1), segments, fingerprint)

    out = push(stub, make(ctx), whole=rpc == "whole")

    assert (out.code, out.reason, out.domain) == (code, reason, "weightwire"), out.message
    assert out.message  # a person can act on it
    assert out.result is None
    status = stub.GetStatus(pb.GetStatusRequest())
    assert status.weights_version == 0
    assert status.updates_failed == 1 and status.updates_succeeded == 0
    assert (status.last_error.reason, status.last_error.code) == (reason, code.name)
    assert status.open_mappings == 0
    expected_state = pb.WORKER_STATE_INCONSISTENT if loaded else pb.WORKER_STATE_CONSISTENT
    assert status.state == expected_state
    if not loaded:
        after = worker.state()
        assert all(torch.equal(after[k], before[k]) for k in before)


def test_stale_version_after_a_good_update(inproc_worker, segments: ShmSegments) -> None:
    worker = inproc_worker()
    stub = worker.stub()
    assert (
        push(stub, full_update_requests(3, full_checkpoint(worker.config, 3), segments)).code
        == grpc.StatusCode.OK
    )
    for version in (3, 2):
        out = push(stub, full_update_requests(version, full_checkpoint(worker.config, 9), segments))
        assert (out.code, out.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "STALE_VERSION")
        assert out.metadata == {"current_version": "3", "received_version": str(version)}
    assert stub.GetStatus(pb.GetStatusRequest()).weights_version == 3
    want = full_checkpoint(worker.config, 3)
    assert all(torch.equal(t, want[k]) for k, t in worker.state().items())


def test_incomplete_update_lists_what_is_missing(inproc_worker, segments: ShmSegments) -> None:
    worker = inproc_worker()
    stub = worker.stub()
    full = full_checkpoint(worker.config, 1)
    layer_names = [n for n in full if n.startswith("model.layers.")]
    sent = {n: t for n, t in full.items() if n not in layer_names}
    out = push(stub, full_update_requests(1, sent, segments, buckets=1))
    assert out.reason == "INCOMPLETE_UPDATE"
    assert len(out.acks) == 1  # the bucket was loaded before the commit found the gap
    assert out.metadata["missing_count"] == str(len(layer_names))
    assert out.metadata["missing"].split(",") == sorted(layer_names)
    assert f"{len(layer_names)} of {len(full)} missing" in out.message
    assert "and 26 more" in out.message  # 36 missing, 10 named in the message


def test_no_payload_for_device_names_own_device_and_labels(inproc_worker) -> None:
    worker = inproc_worker()
    stub = worker.stub()
    own = DeviceRef.host()
    p = pack({NORM: torch.zeros(64)})
    out = push(
        stub,
        [
            header(1),
            bucket(
                0,
                p.specs,
                [inline_payload(p.data, device=OTHER_GPU), inline_payload(p.data, device=OTHER_HOST)],
            ),
            commit(1),
        ],
    )
    assert out.reason == "NO_PAYLOAD_FOR_DEVICE"
    assert own.uuid in out.message and OTHER_GPU.uuid in out.message and OTHER_HOST.uuid in out.message
    assert out.metadata["own_device"] == str(own)
    assert out.metadata["labels"] == f"cuda:{OTHER_GPU.uuid},host:{OTHER_HOST.uuid}"


def test_checksum_verified_update_succeeds(inproc_worker, segments: ShmSegments) -> None:
    worker = inproc_worker()
    full = full_checkpoint(worker.config, 1)
    p = pack(full)
    seg = segments.create(p.data)
    crc = pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32, value=zlib.crc32(p.data))
    out = push(
        worker.stub(),
        [
            header(1, verify_checksums=True),
            bucket(0, p.specs, [shm_payload(seg, len(p.data))], checksum=crc),
            commit(1),
        ],
    )
    assert out.code == grpc.StatusCode.OK, out.message
    assert all(torch.equal(t, full[k]) for k, t in worker.state().items())
