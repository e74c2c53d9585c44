"""Start a worker's gRPC server: WeightTransferService, grpc.health.v1 and reflection.

``serve`` is the public entry (re-exported as ``weightwire.server.serve``); ``weightwire serve`` and
the SGLang plugin call it. Default listener: a Unix socket in a fresh private directory (mode 0700).
TCP only when asked; a non-loopback address needs a token.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.netutil import is_loopback
from weightwire.server.rpc.servicer import (
    SERVICE_NAME,
    TokenAuthInterceptor,
    WeightTransferServicer,
    to_rpc_status,
)
from weightwire.server.rpc.thread_pools import PoolRouter, SlotPool
from weightwire.server.transports.transfer_group_membership import default_group_host
from weightwire.server.worker.adapter import EngineAdapter
from weightwire.server.worker.service import CommitHook, WorkerService
from weightwire.server.worker.streams import DEFAULT_IDLE_TIMEOUT_S
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_SOCKET_NAME = "worker.sock"
# PushUpdate calls running at once: the update, and retries waiting for an update their client
# cancelled to end; one more is refused at once (a worker takes one update at a time anyway).
UPDATE_CALL_SLOTS = 4
# JoinTransferGroup / LeaveTransferGroup calls at once (joins form one after another).
GROUP_CALL_SLOTS = 4


def _busy(methods: str, what: str) -> Callable[[int], grpc.Status]:
    def refusal(slots: int) -> grpc.Status:
        return to_rpc_status(
            WeightwireError(
                Reason.UPDATE_IN_PROGRESS,
                f"{slots} {methods} calls are already running on this worker (one of them {what} that is still "
                "going on); this call was refused without waiting: retry once they ended",
                busy_calls=str(slots),
            )
        )

    return refusal


def split_host_port(address: str) -> tuple[str, int]:
    """``127.0.0.1:50051`` / ``[::1]:0`` / ``localhost:0`` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address {address!r} is neither 'unix:/path' nor 'HOST:PORT'")
    return host.strip("[]"), int(port)


def _check_unix_path(path: str) -> None:
    if not os.path.isabs(path):
        raise ValueError(f"unix socket path {path!r} must be absolute")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(f"directory {parent!r} of unix socket does not exist")


@dataclasses.dataclass(eq=False)
class RunningServer:
    """A started worker server. ``address`` is a gRPC target (``unix:/...`` or ``HOST:PORT``);
    ``stop`` also shuts down ``pools`` and removes ``private_dir`` (the Unix socket's, if made)."""

    server: grpc.Server
    service: WorkerService
    address: str
    private_dir: str | None
    pools: tuple[futures.ThreadPoolExecutor, ...] = dataclasses.field(default=(), repr=False)
    _stopped: threading.Event = dataclasses.field(default_factory=threading.Event, init=False, repr=False)
    _stop_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)

    def stop(self, grace: float | None = 2.0) -> None:
        """Stop accepting, let running calls finish for ``grace`` seconds, release every mapping."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            self.server.stop(grace).wait()
            self.service.close()
            for pool in self.pools:
                pool.shutdown(wait=False)
            if self.private_dir:
                shutil.rmtree(self.private_dir, ignore_errors=True)
            self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ``stop`` finished (or ``timeout``); True when stopped."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    adapter: EngineAdapter,
    *,
    listen: str | None = None,
    token: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    own_device: DeviceRef | None = None,
    on_commit: CommitHook | None = None,
    max_workers: int = 8,
    max_streams: int = 8,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    group_host: str | None = None,
) -> RunningServer:
    """Serve ``adapter`` over gRPC and return once the server accepts requests.

    ``listen``: ``unix:/abs/path.sock`` or ``HOST:PORT`` (port 0 picks one; ``.address`` has it);
    None means a Unix socket in a fresh private directory. A non-loopback TCP address requires
    ``token``. ``tls_cert``/``tls_key``: PEM files to serve TLS on TCP. ``own_device`` defaults to the
    adapter manifest's device. ``max_workers`` threads answer the unary calls (status, manifest,
    health), ``max_streams`` others the PushWeights streams, two the reflection streams: an open or
    stuck stream never delays a status or a health check. PushUpdate calls and transfer-group joins
    and leaves have slots of their own (``UPDATE_CALL_SLOTS``, ``GROUP_CALL_SLOTS``): one that finds
    them all taken is refused at once (UPDATE_IN_PROGRESS), never queued behind streams. A stream
    that sends nothing for ``idle_timeout_s`` ends with DEADLINE_EXCEEDED. ``group_host``: the address of this machine that transfer groups'
    sockets listen on (default: the TCP listen host, or 127.0.0.1 for a unix socket or a wildcard).
    """
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("TLS needs both a certificate and a key file")
    private_dir = None
    if listen is None:
        private_dir = tempfile.mkdtemp(prefix="weightwire-")  # mkdtemp creates it with mode 0700
        listen = f"unix:{os.path.join(private_dir, _SOCKET_NAME)}"
    is_unix = listen.startswith("unix:")
    if is_unix:
        if tls_cert is not None:
            raise ValueError(
                "TLS is for TCP listeners; a unix socket is protected by its directory's permissions"
            )
        _check_unix_path(listen.removeprefix("unix:").removeprefix("//"))
    else:
        host, _ = split_host_port(listen)
        if not is_loopback(host) and not token:
            raise ValueError(
                f"listening on non-loopback address {listen!r} requires a token (--token); "
                "use a unix socket or 127.0.0.1 for local use"
            )
        if not is_loopback(host) and tls_cert is None:
            log.warning("serving %s with a token but without TLS: the token travels in clear text", listen)

    service = WorkerService(
        adapter,
        own_device=own_device or adapter.manifest().device,
        on_commit=on_commit,
        idle_timeout_s=idle_timeout_s,
    )
    if service.transfer_group is not None:
        # Transfer-group sockets listen on this address only (docs/distributed.md).
        service.transfer_group.configure(listen_host=group_host or default_group_host(listen))
    # Streams on pools of their own; the default pool (unary calls) is never held by a stream. The
    # unary update and group calls each on a pool of slots of their own: one that finds every slot
    # taken is refused at once, never queued behind idle streams or other slow calls.
    stream_pool = futures.ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="weightwire-push")
    update_pool = SlotPool(UPDATE_CALL_SLOTS, "weightwire-update", _busy("PushUpdate", "an update"))
    group_pool = SlotPool(
        GROUP_CALL_SLOTS, "weightwire-group", _busy("JoinTransferGroup/LeaveTransferGroup", "a join")
    )
    reflection_pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="weightwire-reflection")
    service_prefix = f"/{SERVICE_NAME}/"
    router = PoolRouter(
        {
            service_prefix + "PushWeights": stream_pool,
            # An update (and the wait for an abandoned one) holds its thread for as long as its loads take.
            service_prefix + "PushUpdate": update_pool,
            service_prefix + "JoinTransferGroup": group_pool,
            service_prefix + "LeaveTransferGroup": group_pool,
            f"/{reflection.SERVICE_NAME}/ServerReflectionInfo": reflection_pool,
        }
    )
    # The router first: a call refused for its token still passes through its slot and gives it back.
    interceptors: list[grpc.ServerInterceptor] = [router]
    if token:
        interceptors.append(TokenAuthInterceptor(token))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="weightwire-rpc"),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # A second process on the same port would split traffic silently.
            ("grpc.so_reuseport", 0),
            # Notice a trainer that vanished mid-update (its stream would otherwise hold the update).
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ],
    )
    pb_grpc.add_WeightTransferServiceServicer_to_server(WeightTransferServicer(service), server)

    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    def on_state(serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        health_servicer.set("", status)
        health_servicer.set(SERVICE_NAME, status)

    service.add_state_listener(on_state)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )

    if tls_cert is not None and tls_key is not None:
        with open(tls_key, "rb") as f:
            key = f.read()
        with open(tls_cert, "rb") as f:
            cert = f.read()
        port = server.add_secure_port(listen, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(listen)
    if not is_unix and port == 0:
        raise OSError(f"cannot listen on {listen!r} (address in use or not available)")
    if is_unix:
        address = listen
    else:
        host, _ = split_host_port(listen)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    server.start()
    log.info("worker %s serving on %s", adapter.manifest().worker_id, address)
    return RunningServer(
        server, service, address, private_dir, (stream_pool, update_pool, group_pool, reflection_pool)
    )
