"""gRPC plumbing of the client: channels to workers, call metadata, and turning a failed call back
into a ``WeightwireError`` (status code + the ``google.rpc.ErrorInfo`` reason from the status details).

Used by ``weightwire.client.push.pusher`` and the CLI commands.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from weightwire.core.errors import ERROR_DOMAIN, PushError, Reason, WeightwireError
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# The workers accept up to 64 MiB; leave room for the specs around an inline payload.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024 + 1024 * 1024


def open_channel(address: str, *, tls_ca: bytes | None = None) -> grpc.Channel:
    """A channel to ``address`` (``unix:/path.sock`` or ``HOST:PORT``); TLS when ``tls_ca`` is given."""
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # A restarted worker must be reachable again at once, not after a reconnect backoff.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if tls_ca is not None:
        return grpc.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=tls_ca), options=options
        )
    return grpc.insecure_channel(address, options=options)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Worker:
    """One worker endpoint: its address, channel and stub."""

    def __init__(self, address: str, *, tls_ca: bytes | None = None) -> None:
        self.address = address
        self.channel = open_channel(address, tls_ca=tls_ca)
        self.stub = pb_grpc.WeightTransferServiceStub(self.channel)
        # False once the worker answered UNIMPLEMENTED to PushUpdate (older than that call).
        self.accepts_push_update = True

    def close(self) -> None:
        self.channel.close()


def close_workers(workers: Iterable[Worker], timeout_s: float = 5.0) -> None:
    """Close every worker's channel, giving up after ``timeout_s``.

    A channel whose call was interrupted inside gRPC (Ctrl-C while the pushing thread waited on a
    call) can block ``close`` forever on a lock that call still holds; closing must never hang the
    trainer's exit, so the closes run on a daemon thread and a stuck one is left behind.
    """
    pending = list(workers)

    def close_all() -> None:
        for w in pending:
            w.close()

    try:
        closer = threading.Thread(target=close_all, name="ww-close-channels", daemon=True)
        closer.start()
    except RuntimeError:  # no new threads at interpreter shutdown: close here
        close_all()
        return
    closer.join(timeout_s)
    if closer.is_alive():
        log.warning(
            "closing the channels to %d worker(s) did not finish within %.0f s; left to the process exit",
            len(pending),
            timeout_s,
        )


def start_unary(
    workers: Mapping[str, Worker],
    method: str,
    request: object,
    *,
    timeout_s: float,
    metadata: tuple[tuple[str, str], ...],
) -> dict[str, grpc.Future]:
    """Start the unary RPC ``method`` on every worker at once; ``collect_unary`` waits for the answers."""
    return {
        a: getattr(w.stub, method).future(request, timeout=timeout_s, metadata=metadata)
        for a, w in workers.items()
    }


def collect_unary(method: str, pending: Mapping[str, grpc.Future]) -> dict[str, object]:
    """Every answer of ``start_unary``, or one ``PushError`` naming each worker whose call failed."""
    out: dict[str, object] = {}
    failures: dict[str, WeightwireError] = {}
    for a, fut in pending.items():
        try:
            out[a] = fut.result()
        except grpc.RpcError as e:
            failures[a] = error_from_rpc(e, worker=a, context=method)
    if failures:
        raise PushError(failures)
    return out


_FALLBACK_HINTS = {
    grpc.StatusCode.UNAVAILABLE: "the worker is unreachable or went away (process exited, socket closed)",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the worker did not answer within the deadline (hung, stopped or overloaded)",
    grpc.StatusCode.CANCELLED: "the call was cancelled",
}


def is_unimplemented(err: grpc.RpcError) -> bool:
    """gRPC's own UNIMPLEMENTED (the server has no such method), not a worker's refusal."""
    if not isinstance(err, grpc.Call) or err.code() != grpc.StatusCode.UNIMPLEMENTED:
        return False
    try:
        return rpc_status.from_call(err) is None
    except ValueError:
        return True


def error_from_rpc(err: grpc.RpcError, *, worker: str | None = None, context: str = "") -> WeightwireError:
    """The ``WeightwireError`` a failed call carries: code, ErrorInfo reason and metadata, message.

    A status without an ErrorInfo (raised by gRPC itself: UNAVAILABLE, DEADLINE_EXCEEDED, ...), or
    with an empty reason, gets the reason of its code (``Reason.for_code``) and a hint about what it
    usually means.
    """
    code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (err.details() if isinstance(err, grpc.Call) else str(err)) or ""
    status = None
    if isinstance(err, grpc.Call):
        try:
            status = rpc_status.from_call(err)
        except ValueError:
            # The status message and the rich status disagree; keep the plain one.
            status = None
    if status is not None:
        for any_msg in status.details:
            if any_msg.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                any_msg.Unpack(info)
                if (info.domain and info.domain != ERROR_DOMAIN) or not info.reason:
                    continue
                return WeightwireError(
                    info.reason,
                    status.message or details,
                    code=code.name,
                    worker=worker,
                    **dict(info.metadata),
                )
    hint = _FALLBACK_HINTS.get(code)
    message = details
    if hint and hint not in message:
        message = f"{hint}: {details}" if details else hint
    if context:
        message = f"{context}: {message}"
    return WeightwireError(Reason.for_code(code.name), message, code=code.name, worker=worker)
