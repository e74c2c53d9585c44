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
