"""The rendezvous store of a transfer group: the trainer's ``StoreServer``, every member's
``connect_store`` (both speak ``transfer_group_wire``: bounded reads, a deadline for each step), and
how a stuck connection is ended from outside (its sockets found and shut down). No gRPC.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import threading

import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports.transfer_group_plan import clip, split_address
from weightwire.core.transports.transfer_group_wire import (
    LocalStore,
    StoreProtocolError,
    StoreTable,
    WireStore,
    WireStoreServer,
)

# ---------------------------------------------------------------------------------------------
# The rendezvous store
# ---------------------------------------------------------------------------------------------


def as_timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class StoreServer:
    """The rendezvous store of the groups a trainer forms, served on a socket bound to exactly
    ``host:port`` (port 0 picks one), so it listens only where the operator says. It speaks
    weightwire's own store protocol (``transfer_group_wire``: every length bounded before anything
    is allocated, every step with a deadline); ``store`` is the same table for this process.

    The store has no authentication of its own: anyone who reaches the port can read and write
    keys. Bind it to the interface the workers use, and let only them reach it; group ids are
    random, new per formation, and every key lives under one.
    """

    def __init__(self, host: str, port: int = 0, *, timeout_s: float = 60.0) -> None:
        family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(256)
        except OSError as e:
            sock.close()
            raise WeightwireError(
                Reason.GROUP_STORE_UNREACHABLE,
                f"cannot listen for the rendezvous store on {host}:{port}: {e.strerror or e}",
            ) from None
        self.host = host
        self.port: int = sock.getsockname()[1]
        table = StoreTable()
        self._server: WireStoreServer | None = WireStoreServer(sock, table, timeout_s)
        self.store: torch.distributed.Store = LocalStore(table, timeout_s)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop listening for new connections and drop this reference to the store. Formed groups
        keep working: they no longer need it (open connections are served until their members
        hang up)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self.store = None  # type: ignore[assignment]


class SharedStore:
    """One ``StoreServer`` for every group a pusher forms, made at the first that needs it: the
    single-source and the every-rank-a-source groups of one pusher both form on it, so a fixed
    ``port`` is listened on once instead of once per kind of group (which failed the second with
    "Address already in use")."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._server: StoreServer | None = None
        self._lock = threading.Lock()

    def server(self) -> StoreServer:
        """The store, listening from now on; GROUP_STORE_UNREACHABLE if it cannot listen."""
        with self._lock:
            if self._server is None:
                self._server = StoreServer(self.host, self.port, timeout_s=self.timeout_s)
            return self._server

    def close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def connect_store(address: str, timeout_s: float) -> torch.distributed.Store:
    """A client of the store at ``address``; GROUP_STORE_UNREACHABLE if it does not answer in time
    or does not speak weightwire's store protocol. Every later read through it is bounded
    (``transfer_group_wire.MAX_VALUE_BYTES``) and has a deadline."""
    host, port = split_address(address)
    try:
        return WireStore(host, port, timeout_s)
    except StoreProtocolError as e:
        raise _unreachable(address, timeout_s, str(e)) from None


def _unreachable(address: str, timeout_s: float, why: str) -> WeightwireError:
    return WeightwireError(
        Reason.GROUP_STORE_UNREACHABLE,
        f"the transfer group's store at {address} did not answer within {timeout_s:.1f} s "
        f"({clip(why, 160)}); check the address, that the trainer is up and that this machine can reach that port",
        store_address=address,
    )


def store_sockets(address: str) -> set[int]:
    """File descriptors of this process's TCP sockets connected to ``address`` (``host:port``;
    Linux, elsewhere none): compared before and after a step, the ones that step opened."""
    try:
        host, port = split_address(address)
    except WeightwireError:
        return set()
    found: set[int] = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in fds:
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            peer = probe.getpeername()
            if (
                probe.type == socket.SOCK_STREAM
                and isinstance(peer, tuple)
                and peer[1] == port
                and _same_host(peer[0], host)
            ):
                found.add(fd)
        except OSError:
            pass
        finally:
            probe.close()  # the duplicate only
    return found


def _same_host(a: str, b: str) -> bool:
    try:
        ia, ib = (ipaddress.ip_address(x.split("%")[0]) for x in (a, b))
    except ValueError:
        return a == b
    # A dual-stack socket names an IPv4 peer as ::ffff:a.b.c.d.
    ia = getattr(ia, "ipv4_mapped", None) or ia
    ib = getattr(ib, "ipv4_mapped", None) or ib
    return ia == ib


def shut_down_sockets(fds: set[int]) -> None:
    """Shut the sockets under ``fds`` down (both directions) without closing the descriptors, whose
    owner (torch) closes them when its blocked call returns with an error."""
    for fd in fds:
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            probe.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            probe.close()
