"""``weightwire discover``: list the worker endpoints of one SGLang engine, one per line.

For shell use (``weightwire push --to $(weightwire discover DIR) ...``) and for checking that an
engine's workers are up. Registered in ``weightwire.client.cli.main``'s subcommand list; needs neither
sglang nor a running trainer.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from weightwire.adapters.sglang.discovery import DiscoveryError, discover
from weightwire.core import cli_types


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "discover",
        help="list the weightwire workers of an SGLang engine",
        description="Print the gRPC target of every weightwire worker of one SGLang engine, ordered by "
        "(dp, pp, tp) rank. Give the engine's WEIGHTWIRE_SGLANG_SOCKET_DIR, or --base-address with --count.",
    )
    p.add_argument("socket_dir", nargs="?", help="the engine's WEIGHTWIRE_SGLANG_SOCKET_DIR")
    p.add_argument(
        "--base-address", help="HOST:BASE_PORT of an engine started with WEIGHTWIRE_SGLANG_BASE_PORT"
    )
    p.add_argument(
        "--count",
        type=cli_types.positive_int,
        help="expected number of workers (tp * pp * dp); required with --base-address",
    )
    p.add_argument(
        "--wait",
        type=cli_types.seconds_or_zero,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for --count live workers",
    )
    p.add_argument(
        "--no-check", action="store_true", help="do not connect to check that each worker is listening"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.socket_dir is None) == (args.base_address is None):
        print("weightwire discover: give a socket directory or --base-address (not both)", file=sys.stderr)
        return 2
    try:
        endpoints = discover(
            args.socket_dir,
            base_address=args.base_address,
            count=args.count,
            timeout_s=args.wait,
            check_alive=not args.no_check,
        )
    except (DiscoveryError, ValueError) as e:
        print(f"weightwire discover: {e}", file=sys.stderr)
        return 1
    for endpoint in endpoints:
        print(endpoint)
    return 0
