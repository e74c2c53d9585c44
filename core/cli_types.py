"""Argument types of every ``weightwire`` command line (``serve``, ``push``, ``status``, ``manifest``,
``demo``, ``discover``): a value the command could not honour is refused while the arguments are
parsed, as one line and exit status 2, instead of being accepted and failing later (a port taken
modulo 65536, a NaN deadline, a bucket of one byte).

Each function takes the argument's text and returns its value, or raises
``argparse.ArgumentTypeError`` with a message that names what is allowed (argparse prefixes the
option's name).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from weightwire.core.netutil import read_token_file

# Longest wait any option accepts (seconds, about 116 days): a larger one overflows the deadlines of
# threading and gRPC, and nobody means it (a worker that must never time out a stream is a bug).
MAX_SECONDS = 1e7
# Largest weights version the wire carries (int64).
MAX_VERSION = 2**63 - 1


def _number(text: str, kind: Callable[[str], float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _duration(text: str, *, zero_allowed: bool) -> float:
    value = _number(text, float)
    if value > MAX_SECONDS or value < 0 or (value == 0 and not zero_allowed):
        floor = ">= 0" if zero_allowed else "> 0"
        raise argparse.ArgumentTypeError(f"{text!r} must be {floor} and at most {MAX_SECONDS:g} seconds")
    return value


def _whole(text: str, low: int, high: int | None, out_of_range: str, what: str = "a whole number") -> int:
    """``text`` as an int in ``[low, high]`` (no upper bound for None); refusals say ``what`` it is
    not, or that it ``out_of_range``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{text!r} {out_of_range}")
    return value


def seconds(text: str) -> float:
    """A duration in seconds: finite, > 0, at most ``MAX_SECONDS``."""
    return _duration(text, zero_allowed=False)


def seconds_or_zero(text: str) -> float:
    """A duration in seconds that may be 0 (do not wait): finite, >= 0, at most ``MAX_SECONDS``."""
    return _duration(text, zero_allowed=True)


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    return _whole(text, 1, None, "must be at least 1")


def version(text: str) -> int:
    """A weights version: 1 .. 2^63-1."""
    value = positive_int(text)
    if value > MAX_VERSION:
        raise argparse.ArgumentTypeError(f"{text!r} is over the largest version, 2^63-1")
    return value


def seed(text: str) -> int:
    """A random seed: 0 .. 2^63-1 (what a torch generator takes)."""
    return _whole(text, 0, MAX_VERSION, "must be in 0..2^63-1")


def size(unit_bytes: int, name: str, max_bytes: int = 2**40) -> Callable[[str], int]:
    """A size given in ``name`` units (``unit_bytes`` each, fractions allowed), returned in bytes:
    at least one byte, at most ``max_bytes``."""

    def parse(text: str) -> int:
        value = _number(text, float)
        nbytes = int(value * unit_bytes) if value > 0 else 0
        if not 1 <= nbytes <= max_bytes:
            raise argparse.ArgumentTypeError(
                f"{text!r} must be > 0 and at most {max_bytes // unit_bytes} {name} (at least one byte)"
            )
        return nbytes

    return parse


def port(text: str) -> int:
    """A TCP port: 0 (pick a free one) .. 65535."""
    return _whole(text, 0, 65535, "is not a port (0 picks a free one, else 1..65535)", "a port number")


def listen_address(text: str) -> str:
    """``unix:/absolute/path.sock`` or ``HOST:PORT`` (``[v6]:PORT``) with a port of 0 .. 65535."""
    if text.startswith("unix:"):
        if not text[len("unix:") :].startswith("/"):
            raise argparse.ArgumentTypeError(
                f"{text!r}: a unix socket needs an absolute path (unix:/path.sock)"
            )
        return text
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'unix:/path.sock' or 'HOST:PORT'")
    try:
        port(port_text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return text


# A PEM file of certificates or a key is a few KiB; a larger one is not what was meant.
MAX_PEM_BYTES = 1024 * 1024


def pem_file(text: str) -> str:
    """The path of a PEM file (certificates or a key) that can be read now; gRPC would otherwise
    take anything and fail each connection later with a handshake error."""
    try:
        with open(text, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {e.strerror or e}") from None
    if len(data) > MAX_PEM_BYTES or b"-----BEGIN " not in data:
        raise argparse.ArgumentTypeError(f"{text} is not a PEM file (no '-----BEGIN ' block)")
    return text


def token_file(text: str) -> str:
    """The token stored in the file ``text`` (see ``netutil.read_token_file``)."""
    try:
        return read_token_file(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_token_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, token_help: str, file_help: str
) -> None:
    """``--token TOKEN`` or ``--token-file FILE`` (one of them at most), the way every command takes
    its bearer token; ``token_of`` reads the one given."""
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token", default=None, help=token_help)
    token.add_argument(
        "--token-file", dest="token_from_file", type=token_file, default=None, metavar="FILE", help=file_help
    )


def token_of(args: argparse.Namespace) -> str | None:
    """The bearer token of options added by ``add_token_options`` (None: neither was given)."""
    token: str | None = args.token_from_file or args.token
    return token


__all__ = [
    "MAX_PEM_BYTES",
    "MAX_SECONDS",
    "MAX_VERSION",
    "add_token_options",
    "listen_address",
    "pem_file",
    "port",
    "positive_int",
    "seconds",
    "seconds_or_zero",
    "seed",
    "size",
    "token_file",
    "token_of",
    "version",
]
