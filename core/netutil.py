"""Small helpers about addresses and secrets that the worker, the client and the adapters share:
whether a host is loopback (a non-loopback listener needs a token), and reading a token file."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name, an IPv4 or IPv6 address, brackets allowed) only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token_file(path: str) -> str:
    """The bearer token stored in ``path`` (surrounding whitespace and the final newline dropped)."""
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


__all__ = ["is_loopback", "read_token_file"]
