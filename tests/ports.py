"""A free loopback port for a test to give a server or a rendezvous store it starts later.

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the same range every
outgoing connection of the machine takes its local port from, so in the seconds before the server
listens another process's connection may take it ("Address already in use" under load). Ports
below that range are never handed out that way: the one picked here is free now and only an
explicit bind can take it."""

from __future__ import annotations

import random
import socket

_FALLBACK_EPHEMERAL_LOW = 32768
_LOWEST = 10000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive loopback ports that are free now, below the ephemeral range."""
    high = _ephemeral_low() - count
    if high <= _LOWEST:
        raise RuntimeError("no room below the ephemeral port range")
    for _ in range(200):
        base = random.randint(_LOWEST, high)
        if all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found below the ephemeral range")


def free_port() -> int:
    """A loopback port that is free now, below the ephemeral range."""
    return free_ports(1)
