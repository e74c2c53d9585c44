"""What every ``weightwire`` command line declares alike: its subcommands, and the kinds of option
more than one of them takes (durations, counts, PEM files, the device), each typed by
``weightwire.core.cli_types`` the same way everywhere, and the one-line refusal of input a
command cannot use.

Used by the worker's ``serve`` (``weightwire.server.cli``), the trainer's subcommands
(``weightwire.client.cli``) and ``discover`` (``weightwire.adapters.sglang.cli``); it sits in
``core`` because the worker's side may not import the trainer's.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable
from typing import Any

from weightwire.core import cli_types

Parser = argparse.ArgumentParser | argparse._ArgumentGroup
# Where a worker or a demo trainer keeps its tensors: this machine's memory, or its current GPU.
DEVICES = ("cpu", "cuda")


def add_command(
    subparsers: Any, name: str, run: Callable[[argparse.Namespace], int], help: str
) -> argparse.ArgumentParser:
    """The subcommand ``name`` (``help`` in the command list), which runs ``run(args)`` and exits
    with what it returns. Its own help opens with ``run``'s docstring: what a command does is said
    once, where it is done."""
    description = inspect.getdoc(run)
    if not description:
        raise TypeError(
            f"the command {name!r} runs {run.__qualname__}, which has no docstring to describe it"
        )
    parser: argparse.ArgumentParser = subparsers.add_parser(name, help=help, description=description)
    parser.set_defaults(func=run)
    return parser


def add_seconds(
    parser: Parser, flag: str, help: str, *, default: float, metavar: str = "S", zero_allowed: bool = False
) -> None:
    """A duration in seconds: finite, > 0 (>= 0 with ``zero_allowed``), at most ``MAX_SECONDS``."""
    kind = cli_types.seconds_or_zero if zero_allowed else cli_types.seconds
    parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=help)


def add_count(
    parser: Parser, flag: str, help: str, *, default: int | None, metavar: str | None = None
) -> None:
    """A whole number of things, at least 1 (a size of a parallel dimension, a number of workers)."""
    parser.add_argument(flag, type=cli_types.positive_int, default=default, metavar=metavar, help=help)


def add_pem_file(parser: Parser, flag: str, help: str, *, metavar: str | None = None) -> None:
    """The path of a PEM file (certificates or a key), refused while parsing when it cannot be read."""
    parser.add_argument(flag, type=cli_types.pem_file, default=None, metavar=metavar, help=help)


def add_device(parser: Parser, help: str) -> None:
    """``--device cpu|cuda`` (default cpu): where a command's own tensors live."""
    parser.add_argument("--device", choices=list(DEVICES), default=DEVICES[0], help=help)


def refuse(command: str, message: str) -> int:
    """Input ``command`` cannot use: ``message`` as one line on stderr, and exit status 2."""
    print(f"{command}: {message}", file=sys.stderr)
    return 2


__all__ = [
    "DEVICES",
    "Parser",
    "add_command",
    "add_count",
    "add_device",
    "add_pem_file",
    "add_seconds",
    "refuse",
]
