"""Which thread pool serves which RPC, so that long calls cannot starve short ones.

gRPC Python runs every call on one thread pool, and a stream holds its thread for as long as it is
open: a handful of PushWeights streams that opened and went quiet used to occupy every thread, and
GetStatus, GetManifest and the health check timed out. ``PoolRouter`` (a server interceptor that
``weightwire.server.rpc.grpc_server.serve`` installs) puts the long-lived calls on pools of their own,
through gRPC's per-method ``experimental_thread_pool`` (the attribute grpc's own health service uses
for its Watch stream); the unary calls keep the server's default pool, which no stream can occupy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any

import grpc

__all__ = ["PoolRouter"]


def _on_pool(handler: grpc.RpcMethodHandler, pool: futures.ThreadPoolExecutor) -> grpc.RpcMethodHandler:
    """The same handler, run on ``pool``."""
    if handler.request_streaming and handler.response_streaming:
        inner, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        inner, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        inner, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        inner, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    if inner is None:
        return handler

    def behavior(request: Any, context: grpc.ServicerContext) -> Any:
        return inner(request, context)

    setattr(behavior, "experimental_thread_pool", pool)  # noqa: B010 - a function attribute gRPC reads
    return make(behavior, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


class PoolRouter(grpc.ServerInterceptor):
    """Runs each call whose full method name is in ``pools`` on that pool; the rest as they were."""

    def __init__(self, pools: Mapping[str, futures.ThreadPoolExecutor]) -> None:
        self._pools = dict(pools)
        # The wrapped handler per method, for as long as the method's handler is the same object
        # (it is, call after call): wrapping is then not repeated on every update's path.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method or ""
        pool = self._pools.get(method)
        if handler is None or pool is None:
            return handler
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = _on_pool(handler, pool)
        self._wrapped[method] = (handler, wrapped)
        return wrapped
