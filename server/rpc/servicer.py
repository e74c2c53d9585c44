"""The thin gRPC layer over ``WorkerService``: messages in and out, errors mapped in one place.

``to_rpc_status`` is the only place a ``WeightwireError`` becomes a gRPC status (code + one
``google.rpc.ErrorInfo``, domain "weightwire"); ``TokenAuthInterceptor`` checks bearer tokens. Used by
``weightwire.server.rpc.grpc_server.serve``.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status
from weightwire.core.errors import ERROR_DOMAIN, Reason, WeightwireError
from weightwire.core.text import MAX_MESSAGE_BYTES, clip_utf8
from weightwire.server.worker.service import WorkerService
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_Response = TypeVar("_Response")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightTransferService"].full_name
# A status travels in the trailers: grpc-message (the message, percent-encoded: a non-ASCII byte
# takes three) and grpc-status-details-bin (the Status with its ErrorInfo, base64: four bytes per
# three). A client refuses trailers over 8 KiB by default (RESOURCE_EXHAUSTED instead of the status,
# at random between 8 and 16 KiB), so both together stay below this, with room for the rest.
TRAILER_BUDGET_BYTES = 6144
_MAX_METADATA_ENTRIES = 16
_MAX_METADATA_KEY_BYTES = 64
# How long a stream that ended without a commit waits to learn whether the client cancelled it.
_CANCEL_GRACE_S = 0.5


def _percent_encoded_len(text: str) -> int:
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode("utf-8"))


def _status_of(code: int, message: str, reason: str, metadata: dict[str, str]) -> status_pb2.Status:
    status = status_pb2.Status(code=code, message=message)
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata))
    status.details.append(detail)
    return status


def _trailer_bytes(status: status_pb2.Status) -> int:
    return _percent_encoded_len(status.message) + -(-status.ByteSize() // 3) * 4


def to_rpc_status(err: WeightwireError) -> grpc.Status:
    """gRPC status for ``err``: its code, its message and one ErrorInfo(reason, metadata), cut (in
    UTF-8 bytes, at character boundaries; the longest text first) to fit ``TRAILER_BUDGET_BYTES``."""
    code = code_pb2.Code.Value(err.code) if err.code in code_pb2.Code.keys() else code_pb2.UNKNOWN
    message = clip_utf8(err.message, MAX_MESSAGE_BYTES)
    metadata = {
        clip_utf8(k, _MAX_METADATA_KEY_BYTES): v
        for k, v in list(err.metadata.items())[:_MAX_METADATA_ENTRIES]
    }
    status = _status_of(code, message, err.reason, metadata)
    while _trailer_bytes(status) > TRAILER_BUDGET_BYTES and (message or any(metadata.values())):
        # Halve the longest text (each halving shrinks it, down to empty: this ends).
        longest = max(metadata, key=lambda k: len(metadata[k].encode()), default=None)
        if longest is not None and len(metadata[longest].encode()) > len(message.encode()):
            metadata[longest] = clip_utf8(metadata[longest], len(metadata[longest].encode()) // 2)
        else:
            message = clip_utf8(message, len(message.encode()) // 2)
        status = _status_of(code, message, err.reason, metadata)
    return rpc_status.to_status(status)


class WeightTransferServicer(pb_grpc.WeightTransferServiceServicer):
    """Converts requests for ``WorkerService`` and its errors into statuses."""

    def __init__(self, service: WorkerService) -> None:
        self.service = service

    def GetManifest(
        self, request: pb.GetManifestRequest, context: grpc.ServicerContext
    ) -> pb.GetManifestResponse:
        return self.service.get_manifest()

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusResponse:
        return self.service.get_status()

    def JoinTransferGroup(
        self, request: pb.JoinTransferGroupRequest, context: grpc.ServicerContext
    ) -> pb.JoinTransferGroupResponse:
        return _answered(context, lambda: self.service.join_transfer_group(request))

    def LeaveTransferGroup(
        self, request: pb.LeaveTransferGroupRequest, context: grpc.ServicerContext
    ) -> pb.LeaveTransferGroupResponse:
        return _answered(context, lambda: self.service.leave_transfer_group(request))

    def PushWeights(
        self, request_iterator: Iterator[pb.PushWeightsRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.PushWeightsResponse]:
        # A cancelled stream can reach us as a plain end of the request iterator, slightly before
        # gRPC marks the RPC inactive. The termination callback fires on cancellation, so on an
        # early end we wait briefly for it before calling the stream malformed.
        terminated = threading.Event()
        context.add_callback(terminated.set)

        def client_gone() -> bool:
            return terminated.wait(_CANCEL_GRACE_S) or not context.is_active()

        try:
            yield from self.service.push(request_iterator, client_gone=client_gone, rpc_ended=terminated)
        except WeightwireError as err:
            context.abort_with_status(to_rpc_status(err))
        except Exception as e:
            _abort_unexpected(context, e)

    def PushUpdate(
        self, request: pb.PushUpdateRequest, context: grpc.ServicerContext
    ) -> pb.PushUpdateResponse:
        # Every message is here already, so nothing waits for the client: whether it went away is
        # simply whether the call is still active.
        ended = threading.Event()
        context.add_callback(ended.set)
        try:
            responses = self.service.push_update(
                request.messages, client_gone=lambda: not context.is_active(), rpc_ended=ended
            )
        except WeightwireError as err:
            context.abort_with_status(to_rpc_status(err))
            raise  # unreachable: abort_with_status raises
        except Exception as e:
            _abort_unexpected(context, e)
            return pb.PushUpdateResponse()  # the client went away: nobody reads this
        return pb.PushUpdateResponse(messages=responses)


def _answered(context: grpc.ServicerContext, call: Callable[[], _Response]) -> _Response:
    """``call()``'s response; a ``WeightwireError`` aborts the RPC with its status instead."""
    try:
        return call()
    except WeightwireError as err:
        context.abort_with_status(to_rpc_status(err))
        raise  # unreachable: abort_with_status raises


def _abort_unexpected(context: grpc.ServicerContext, e: Exception) -> None:
    """A bug, or the request stream broke, during an update: the service has already ended the
    update (and recorded it for GetStatus); the client gets INTERNAL with an ErrorInfo instead of
    gRPC's bare UNKNOWN. A client that went away needs no answer (this then returns)."""
    if not context.is_active():
        return
    log.exception("push failed unexpectedly")
    context.abort_with_status(
        to_rpc_status(WeightwireError(Reason.INTERNAL, f"internal error in the worker: {e!r}"))
    )


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on WeightTransferService calls.

    Health checks and reflection stay open (probes and ``grpcurl list`` carry no secrets).
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty token would accept every caller")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method or ""
        if not method.startswith(f"/{SERVICE_NAME}/"):
            return continuation(handler_call_details)
        received = _bearer(handler_call_details.invocation_metadata)
        if received is None:
            err = WeightwireError(
                Reason.MISSING_TOKEN,
                "this worker requires 'authorization: Bearer <token>' metadata on every call",
            )
        elif hmac.compare_digest(received.encode(), self._expected):
            return continuation(handler_call_details)
        else:
            err = WeightwireError(Reason.INVALID_TOKEN, "the bearer token does not match this worker's token")
        handler = continuation(handler_call_details)
        return _rejecting_handler(handler, to_rpc_status(err))


def _rejecting_handler(handler: grpc.RpcMethodHandler | None, status: grpc.Status) -> grpc.RpcMethodHandler:
    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort_with_status(status)

    def streaming(request_iterator: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        context.abort_with_status(status)
        yield  # pragma: no cover - makes this a generator for stream responses

    req_stream = bool(handler and handler.request_streaming)
    resp_stream = bool(handler and handler.response_streaming)
    deser = handler.request_deserializer if handler else None
    ser = handler.response_serializer if handler else None
    if req_stream and resp_stream:
        return grpc.stream_stream_rpc_method_handler(streaming, deser, ser)
    if req_stream:
        return grpc.stream_unary_rpc_method_handler(unary, deser, ser)
    if resp_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, deser, ser)
    return grpc.unary_unary_rpc_method_handler(unary, deser, ser)
