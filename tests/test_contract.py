"""The generated contract: service shape, streaming kinds, enum conventions, reason table."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor
from weightwire.core.errors import Reason
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

FILE = pb.DESCRIPTOR


def test_package_and_service() -> None:
    assert FILE.package == "weightwire.v1"
    assert list(FILE.services_by_name) == ["WeightTransferService"]
    service = FILE.services_by_name["WeightTransferService"]
    assert service.full_name == "weightwire.v1.WeightTransferService"
    assert sorted(m.name for m in service.methods) == [
        "GetManifest",
        "GetStatus",
        "JoinTransferGroup",
        "LeaveTransferGroup",
        "PushUpdate",
        "PushWeights",
    ]


@pytest.mark.parametrize(
    ("method", "client_streaming", "server_streaming", "request_type", "response_type"),
    [
        ("GetManifest", False, False, "GetManifestRequest", "GetManifestResponse"),
        ("PushWeights", True, True, "PushWeightsRequest", "PushWeightsResponse"),
        ("PushUpdate", False, False, "PushUpdateRequest", "PushUpdateResponse"),
        ("GetStatus", False, False, "GetStatusRequest", "GetStatusResponse"),
        ("JoinTransferGroup", False, False, "JoinTransferGroupRequest", "JoinTransferGroupResponse"),
        ("LeaveTransferGroup", False, False, "LeaveTransferGroupRequest", "LeaveTransferGroupResponse"),
    ],
)
def test_rpc_kinds(
    method: str, client_streaming: bool, server_streaming: bool, request_type: str, response_type: str
) -> None:
    m = FILE.services_by_name["WeightTransferService"].methods_by_name[method]
    assert m.client_streaming is client_streaming
    assert m.server_streaming is server_streaming
    assert m.input_type.name == request_type
    assert m.output_type.name == response_type


def test_grpc_stubs_exist() -> None:
    assert hasattr(pb_grpc, "WeightTransferServiceStub")
    assert hasattr(pb_grpc, "WeightTransferServiceServicer")
    assert hasattr(pb_grpc, "add_WeightTransferServiceServicer_to_server")


def _all_enums() -> list[descriptor.EnumDescriptor]:
    enums = list(FILE.enum_types_by_name.values())
    stack = list(FILE.message_types_by_name.values())
    while stack:
        msg = stack.pop()
        enums.extend(msg.enum_types)
        stack.extend(msg.nested_types)
    return enums


@pytest.mark.parametrize("enum", _all_enums(), ids=lambda e: e.name)
def test_enum_zero_is_unspecified(enum: descriptor.EnumDescriptor) -> None:
    zero = enum.values_by_number[0]
    assert zero.name.endswith("_UNSPECIFIED"), f"{enum.name} zero value is {zero.name}"


def test_no_unsigned_integers() -> None:
    unsigned = {
        descriptor.FieldDescriptor.TYPE_UINT32,
        descriptor.FieldDescriptor.TYPE_UINT64,
        descriptor.FieldDescriptor.TYPE_FIXED32,
        descriptor.FieldDescriptor.TYPE_FIXED64,
    }
    for msg in FILE.message_types_by_name.values():
        for field in msg.fields:
            assert field.type not in unsigned, f"{msg.name}.{field.name} is unsigned"


def test_payload_handle_is_oneof() -> None:
    oneof = pb.Payload.DESCRIPTOR.oneofs_by_name["handle"]
    assert sorted(f.name for f in oneof.fields) == ["cuda_ipc", "host_shm", "inline_data", "transfer_group"]
    push = pb.PushWeightsRequest.DESCRIPTOR.oneofs_by_name["message"]
    assert sorted(f.name for f in push.fields) == ["bucket", "commit", "header"]


def test_error_reasons_match_proto() -> None:
    proto_reasons = {n.removeprefix("ERROR_REASON_") for n in pb.ErrorReason.keys()} - {"UNSPECIFIED"}
    assert proto_reasons == set(Reason.__members__)


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        (Reason.NO_PAYLOAD_FOR_DEVICE, "FAILED_PRECONDITION"),
        (Reason.UPDATE_IN_PROGRESS, "ABORTED"),
        (Reason.CHECKSUM_MISMATCH, "DATA_LOSS"),
        (Reason.TENSOR_OUT_OF_BOUNDS, "INVALID_ARGUMENT"),
        (Reason.INVALID_TOKEN, "UNAUTHENTICATED"),
        (Reason.LOAD_FAILED, "INTERNAL"),
        (Reason.GROUP_DUPLICATE_RANK, "FAILED_PRECONDITION"),
        (Reason.TRANSFER_FAILED, "UNAVAILABLE"),
        (Reason.GROUP_TIMEOUT, "DEADLINE_EXCEEDED"),
        (Reason.INTERNAL, "INTERNAL"),
        (Reason.UNKNOWN_TENSOR, "INVALID_ARGUMENT"),
        (Reason.CANCELLED, "CANCELLED"),
        (Reason.UNAVAILABLE, "UNAVAILABLE"),
        (Reason.RPC_FAILED, "UNKNOWN"),
        (Reason.INVALID_DELTA, "INVALID_ARGUMENT"),
        (Reason.DELTA_BASE_MISMATCH, "FAILED_PRECONDITION"),
        (Reason.DELTA_RESULT_MISMATCH, "DATA_LOSS"),
    ],
)
def test_reason_codes(reason: Reason, code: str) -> None:
    assert reason.code == code


def test_every_reason_is_documented_on_an_rpc() -> None:
    text = open(FILE.name and "proto/weightwire/v1/weight_transfer.proto", encoding="utf-8").read()
    # The service block: every RPC's comment lists the codes and reasons it may answer with.
    service_doc = text.split("service WeightTransferService {")[1].split("\n}\n")[0]
    for reason in Reason:
        assert reason.name in service_doc, f"{reason.name} is not documented on any RPC"


def test_delta_update_messages() -> None:
    """Delta updates are additive: new fields and enums, no existing field renumbered."""
    assert dict(pb.DeltaEncoding.items()) == {
        "DELTA_ENCODING_UNSPECIFIED": 0,
        "DELTA_ENCODING_INDICES": 1,
        "DELTA_ENCODING_BITMAP": 2,
        "DELTA_ENCODING_DENSE": 3,
    }
    assert [n for n, _ in pb.UpdateEncoding.items()] == [
        "UPDATE_ENCODING_UNSPECIFIED",
        "UPDATE_ENCODING_FULL",
        "UPDATE_ENCODING_DELTA",
    ]
    assert pb.DeltaFallback.Name(4) == "DELTA_FALLBACK_TRANSPORT"
    assert pb.ChecksumAlgorithm.Name(1) == "CHECKSUM_ALGORITHM_CRC32"
    assert pb.ChecksumAlgorithm.Name(2) == "CHECKSUM_ALGORITHM_WEIGHTED_SUM64"

    def numbers(msg: type) -> dict[str, int]:
        return {f.name: f.number for f in msg.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert numbers(pb.TensorSpec) == {"name": 1, "dtype": 2, "shape": 3, "offset_bytes": 4, "delta": 5}
    assert numbers(pb.SliceTransfer) == {"tensor": 1, "source_rank": 2, "start": 3, "stop": 4, "delta": 5}
    assert numbers(pb.TensorDelta) == {
        "encoding": 1,
        "changed_count": 2,
        "index_dtype": 3,
        "values_offset_bytes": 4,
        "result_checksums": 5,
    }
    assert numbers(pb.DeltaChecksum) == {"piece": 1, "checksum": 2}
    header = numbers(pb.UpdateHeader)
    assert header["update_id"] == 6 and header["delta_base"] == 7 and header["delta_fallback"] == 8
    result = numbers(pb.UpdateResult)
    assert result["bytes_received"] == 12
    assert {k: result[k] for k in ("encoding", "base_version", "delta_fallback")} == {
        "encoding": 13,
        "base_version": 14,
        "delta_fallback": 15,
    }
    assert {"delta_tensors", "changed_elements", "result_checksums_verified"} <= set(result)


def test_a_header_without_a_base_is_not_a_delta() -> None:
    """A FULL header of a trainer before delta updates reads as no base and no fallback said; a delta
    header round-trips its base, and a TensorSpec its delta, through the wire bytes."""
    old = pb.UpdateHeader(version=3, scope=pb.UPDATE_SCOPE_FULL).SerializeToString()
    header = pb.UpdateHeader.FromString(old)
    assert not header.HasField("delta_base")
    assert header.delta_fallback == pb.DELTA_FALLBACK_UNSPECIFIED
    delta = pb.UpdateHeader(version=4, scope=pb.UPDATE_SCOPE_FULL, delta_base=pb.DeltaBase(base_version=3))
    assert pb.UpdateHeader.FromString(delta.SerializeToString()).delta_base.base_version == 3
    spec = pb.TensorSpec(
        name="w",
        dtype=pb.DTYPE_BFLOAT16,
        shape=[4, 4],
        offset_bytes=0,
        delta=pb.TensorDelta(
            encoding=pb.DELTA_ENCODING_INDICES,
            changed_count=1,
            index_dtype=pb.DTYPE_INT32,
            values_offset_bytes=4,
            result_checksums=[
                pb.DeltaChecksum(
                    checksum=pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64, value=-5)
                )
            ],
        ),
    )
    back = pb.TensorSpec.FromString(spec.SerializeToString())
    assert back == spec and back.delta.result_checksums[0].checksum.value == -5
    assert not back.delta.result_checksums[0].HasField("piece")
    assert not pb.TensorSpec(name="w").HasField("delta")
