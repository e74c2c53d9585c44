"""Engine-side worker service: ``serve(adapter, ...)`` starts a worker's gRPC server.

``weightwire.server.worker.service.WorkerService`` is the grpc-free core; ``serve`` and ``RunningServer``
(in ``grpc_server``) are imported lazily so that importing the core or the adapter protocol does not
pull in gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightwire.server.rpc.grpc_server import RunningServer, serve

__all__ = ["RunningServer", "serve"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from weightwire.server.rpc import grpc_server

        return getattr(grpc_server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
