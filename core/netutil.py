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


# A bearer token travels in every call's metadata; a file larger than this is not a token file.
MAX_TOKEN_FILE_BYTES = 64 * 1024


def read_token_file(path: str) -> str:
    """The bearer token stored in ``path`` (surrounding whitespace and the final newline dropped).

    ``ValueError`` with the reason when the file cannot be read, is not UTF-8 text, is larger than
    ``MAX_TOKEN_FILE_BYTES`` or holds no token (an empty token would turn authentication off).
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read token file {path}: {e.strerror or e}") from None
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise ValueError(f"token file {path} is over {MAX_TOKEN_FILE_BYTES // 1024} KiB: not a token")
    try:
        token = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"token file {path} is not UTF-8 text") from None
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


__all__ = ["is_loopback", "read_token_file"]
