"""The ``weightwire`` command line. Each subcommand lives with the code it drives and registers
itself here: ``serve`` (weightwire.server.cli), ``manifest``/``status``/``push``/``demo``
(weightwire.client).

Registering a subcommand must not import torch (seconds): ``--version``, ``status`` and ``manifest``
never need it, and each command imports what it uses when it runs. Ctrl-C anywhere exits 130 with
one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from weightwire import __version__
from weightwire.core.optional import load_optional

# module providing add_parser(subparsers) for each subcommand; modules arrive with their issues.
_SUBCOMMAND_MODULES = (
    "weightwire.server.cli",
    "weightwire.client.cli.commands",
    "weightwire.client.cli.plan",
    "weightwire.adapters.sglang.cli",
)


class _Parser(argparse.ArgumentParser):
    """Refuses bad arguments with one line (what is wrong and where to read more) and exit status 2,
    not argparse's usage block, which for ``push`` is longer than the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="weightwire", description="Move fresh weights from a trainer into engine workers.")
    parser.add_argument("--version", action="version", version=f"weightwire {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for mod_name in _SUBCOMMAND_MODULES:
        add_parser = load_optional(f"{mod_name}:add_parser")
        if callable(add_parser):
            add_parser(sub)
    return parser


# The shell's status for a process ended by SIGINT (128 + 2), which scripts test for.
INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C lands wherever the main thread is (an import of torch, a gRPC wait): the user asked
        # to stop, not for that frame's traceback. Nothing is left half-done: a push that did not
        # commit leaves every worker's version where it was.
        print("weightwire: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # Output piped into a reader that left early (`weightwire manifest ADDR | head`): not an
        # error of ours; point stdout at /dev/null so the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
