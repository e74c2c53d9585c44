"""Which thread pool serves which RPC, so that long calls cannot starve short ones.

gRPC Python runs every call on one thread pool, and a stream holds its thread for as long as it is
open: a handful of PushWeights streams that opened and went quiet used to occupy every thread, and
GetStatus, GetManifest and the health check timed out. ``PoolRouter`` (a server interceptor that
``weightwire.server.rpc.grpc_server.serve`` installs) puts the long-lived calls on pools of their own,
through gRPC's per-method ``experimental_thread_pool`` (the attribute grpc's own health service uses
for its Watch stream); the unary calls keep the server's default pool, which no stream can occupy.

A ``SlotPool`` never queues: a call routed to it while every one of its slots is taken is answered
at once with the pool's refusal (a status with a reason) instead of waiting in the executor's queue
behind calls that may take minutes. The slot is taken when the call arrives (the interceptor runs on
gRPC's polling thread, before the call is handed to a pool) and given back when its handler returns.
A unary call on such a pool is served as a request stream (the wire is the same): gRPC would
otherwise receive its request on the pool's thread before any handler runs, and a handler that never
runs could not give its slot back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from typing import Any

import grpc

__all__ = ["PoolRouter", "SlotPool"]


class SlotPool(futures.ThreadPoolExecutor):
    """A pool of ``slots`` threads for calls that must never wait for a thread: one call more than
    ``slots`` gets ``refusal()`` at once (``PoolRouter``)."""

    def __init__(self, slots: int, thread_name_prefix: str, refusal: Callable[[int], grpc.Status]) -> None:
        if slots < 1:
            raise ValueError("a slot pool needs at least one slot")
        # One thread more than slots: a call that took a slot never waits for the thread of one that
        # gave its slot back and is still sending its status.
        super().__init__(max_workers=slots + 1, thread_name_prefix=thread_name_prefix)
        self.slots = slots
        self.refusal = refusal
        self._free = threading.BoundedSemaphore(slots)

    def take(self) -> bool:
        return self._free.acquire(blocking=False)

    def give_back(self) -> None:
        self._free.release()


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
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _on_slot(handler: grpc.RpcMethodHandler, pool: SlotPool) -> grpc.RpcMethodHandler:
    """A unary-unary handler on ``pool``, served as a request stream, giving its slot back when it
    returns (see the module docstring)."""
    inner = handler.unary_unary
    assert inner is not None

    def behavior(request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
        try:
            try:
                request = next(request_iterator, None)
            except Exception:  # the call broke before its request arrived: nobody to answer
                return None
            if request is None:
                if context.is_active():
                    context.abort(
                        grpc.StatusCode.UNIMPLEMENTED, "this method requires exactly one request message"
                    )
                return None
            return inner(request, context)
        finally:
            pool.give_back()

    setattr(behavior, "experimental_thread_pool", pool)  # noqa: B010 - a function attribute gRPC reads
    return grpc.stream_unary_rpc_method_handler(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _refusing(handler: grpc.RpcMethodHandler, status: grpc.Status) -> grpc.RpcMethodHandler:
    """Answers ``status`` without reading the request, on the server's default pool (it returns at once)."""

    def behavior(request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
        context.abort_with_status(status)

    return grpc.stream_unary_rpc_method_handler(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class PoolRouter(grpc.ServerInterceptor):
    """Runs each call whose full method name is in ``pools`` on that pool; the rest as they were.
    A unary-unary method on a ``SlotPool`` takes one of its slots or is refused at once."""

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
        slots = pool if isinstance(pool, SlotPool) and handler.unary_unary is not None else None
        if slots is not None and not slots.take():
            return _refusing(handler, slots.refusal(slots.slots))
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = _on_slot(handler, slots) if slots is not None else _on_pool(handler, pool)
        self._wrapped[method] = (handler, wrapped)
        return wrapped
