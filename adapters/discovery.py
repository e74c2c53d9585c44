"""Trainer side: list the worker endpoints of one engine from its socket directory or base port.

The engine's ranks listen where ``weightwire.adapters.endpoints`` says (``<dir>/<worker_id>.sock``
or ``HOST:BASE_PORT + index``); this finds all of them, ordered by (dp, pp, tp) rank, without
knowing the engine's topology. Needs neither an engine nor gRPC.
"""

from __future__ import annotations

import os
import socket
import stat
import time

from weightwire.adapters.endpoints import SOCKET_SUFFIX, parse_worker_id, unix_socket_alive


class DiscoveryError(RuntimeError):
    """The engine's workers could not all be found (none yet, stale sockets, wrong count)."""


def discover(
    socket_dir: str | None = None,
    *,
    base_address: str | None = None,
    count: int | None = None,
    timeout_s: float = 0.0,
    check_alive: bool = True,
) -> list[str]:
    """gRPC targets of all workers of one engine, ordered by (dp, pp, tp) rank.

    ``socket_dir``: the engine's socket directory; every ``<worker_id>.sock`` in it is a worker.
    ``base_address``: ``HOST:BASE_PORT`` of an engine whose workers listen on TCP; then ``count``
    (tp_size * pp_size * dp replicas) is required. With ``count`` set, waits up to ``timeout_s`` for
    that many live workers (the engine may still be loading) and fails if there are more or fewer.
    With ``check_alive``, a socket nobody listens on (a worker of a dead engine) is an error rather
    than an endpoint the first push would fail on.
    """
    if (socket_dir is None) == (base_address is None):
        raise ValueError("pass exactly one of socket_dir or base_address")
    if count is not None and count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        try:
            if socket_dir is not None:
                return _from_socket_dir(socket_dir, count=count, check_alive=check_alive)
            if count is None:
                raise ValueError("base_address needs count (tp_size * pp_size * dp replicas)")
            return _from_base_address(base_address or "", count, check_alive=check_alive)
        except DiscoveryError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def _from_socket_dir(socket_dir: str, *, count: int | None, check_alive: bool) -> list[str]:
    directory = os.path.abspath(socket_dir)
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        raise DiscoveryError(
            f"{directory} does not exist: is the engine up, with weightwire installed and its socket "
            "directory setting pointing there?"
        ) from None
    found: list[tuple[tuple[int, int, int, int], str]] = []
    for entry in entries:
        if not entry.endswith(SOCKET_SUFFIX):
            continue
        key = parse_worker_id(entry[: -len(SOCKET_SUFFIX)])
        path = os.path.join(directory, entry)
        if key is None or not stat.S_ISSOCK(os.lstat(path).st_mode):
            continue
        found.append((key, path))
    found.sort()
    if not found:
        raise DiscoveryError(f"no weightwire worker sockets (tpN-ppM.sock) in {directory} yet")
    if check_alive:
        dead = [path for _, path in found if not unix_socket_alive(path)]
        if dead:
            raise DiscoveryError(
                f"{len(dead)} socket(s) in {directory} have no worker listening (left by an engine that "
                f"exited?): {', '.join(os.path.basename(p) for p in dead)}"
            )
    if count is not None and len(found) != count:
        raise DiscoveryError(
            f"expected {count} workers in {directory}, found {len(found)}: "
            + ", ".join(os.path.basename(p) for _, p in found)
        )
    return ["unix:" + path for _, path in found]


def _from_base_address(base_address: str, count: int, *, check_alive: bool) -> list[str]:
    host, sep, port_text = base_address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"base_address must be HOST:PORT, got {base_address!r}")
    base = int(port_text)
    if base + count - 1 > 65535:
        raise ValueError(f"{count} workers from port {base} run past 65535")
    endpoints = [f"{host}:{base + i}" for i in range(count)]
    if check_alive:
        dead = [e for e in endpoints if not _tcp_alive(host.strip("[]"), int(e.rpartition(":")[2]))]
        if dead:
            raise DiscoveryError(f"no worker listening at {', '.join(dead)}")
    return endpoints


def _tcp_alive(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False
