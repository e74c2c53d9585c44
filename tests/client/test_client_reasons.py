"""Every error a trainer sees carries a ``Reason``: the client's own refusals, a worker's ErrorInfo,
statuses gRPC produced without one, and an unexpected exception inside a worker's push (INTERNAL
with an ErrorInfo, the same as the worker's GetStatus records)."""

from __future__ import annotations

import grpc
import pytest
import torch
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.client import FlatBucket, PlanError, PushError, TensorSpec, WeightPusher
from weightwire.client.rpc.calls import error_from_rpc
from weightwire.core.errors import Reason, WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc


def test_client_refusals_carry_reason_members(inproc_worker) -> None:
    worker = inproc_worker()
    full = full_checkpoint(worker.config, 1)
    with WeightPusher([worker.address], transport="inline") as pusher:
        with pytest.raises(PlanError) as unknown:
            pusher.push({**full, "model.no_such.weight": torch.zeros(2)}, version=1)
        assert unknown.value.kind is Reason.UNKNOWN_TENSOR and unknown.value.code == "INVALID_ARGUMENT"
        norm = full["model.norm.weight"]
        strided = torch.zeros(norm.numel(), 2)[:, 0]  # the right size, but every other float
        with pytest.raises(PlanError) as flat:
            pusher.push_flat(
                [FlatBucket(strided, [TensorSpec("model.norm.weight", norm.dtype, tuple(norm.shape))])],
                version=1,
                scope="partial",
            )
        assert flat.value.kind is Reason.BUFFER_NOT_CONTIGUOUS and flat.value.code == "INVALID_ARGUMENT"
        assert pusher.status()[worker.address].weights_version == 0


def test_an_unexpected_error_in_a_push_is_internal_with_an_error_info(
    inproc_worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = inproc_worker()
    importer = worker.service.importers["host_shm"]  # type: ignore[attr-defined]

    def broken_check(payload: pb.Payload) -> None:
        raise RuntimeError("injected bug in the worker")

    monkeypatch.setattr(importer, "check", broken_check)
    with WeightPusher([worker.address], transport="host_shm") as pusher:
        with pytest.raises(PushError) as e:
            pusher.push(full_checkpoint(worker.config, 1), version=1)
        err = e.value.failures[worker.address]
        assert (err.code, err.kind) == ("INTERNAL", Reason.INTERNAL)
        assert "injected bug in the worker" in err.message
        status = pusher.status()[worker.address]
    assert status.weights_version == 0
    assert (status.last_error.code, status.last_error.reason) == ("INTERNAL", "INTERNAL")
    assert "injected bug in the worker" in status.last_error.message


def test_statuses_without_an_error_info_get_the_reason_of_their_code(inproc_worker) -> None:
    worker = inproc_worker()
    with grpc.insecure_channel("unix:/nonexistent/weightwire-test.sock") as channel:
        with pytest.raises(grpc.RpcError) as gone:
            pb_grpc.WeightTransferServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=5)
    unavailable = error_from_rpc(gone.value, worker="nowhere")
    assert (unavailable.code, unavailable.kind) == ("UNAVAILABLE", Reason.UNAVAILABLE)
    with grpc.insecure_channel(worker.address) as channel:
        unknown_method = channel.unary_unary("/weightwire.v1.WeightTransferService/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as unimplemented:
            unknown_method(b"", timeout=5)
    other = error_from_rpc(unimplemented.value)
    assert (other.code, other.kind) == ("UNIMPLEMENTED", Reason.RPC_FAILED)


def test_no_error_is_without_a_reason() -> None:
    assert WeightwireError("", "the client went away", code="CANCELLED").kind is Reason.CANCELLED
    assert WeightwireError("", "bug", code="INTERNAL").kind is Reason.INTERNAL
    assert WeightwireError("", "odd", code="RESOURCE_EXHAUSTED").reason == "RPC_FAILED"
    newer = WeightwireError("A_REASON_OF_A_NEWER_WORKER", "kept as sent", code="FAILED_PRECONDITION")
    assert (newer.reason, newer.kind, newer.code) == (
        "A_REASON_OF_A_NEWER_WORKER",
        None,
        "FAILED_PRECONDITION",
    )
    for reason in Reason:
        assert reason.name and WeightwireError(reason, "m").code == reason.code
