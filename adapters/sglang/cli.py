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
from weightwire.core import cli_common


def add_parser(subparsers: Any) -> None:
    p = cli_common.add_command(subparsers, "discover", run, "list the weightwire workers of an SGLang engine")
    p.add_argument("socket_dir", nargs="?", help="the engine's WEIGHTWIRE_SGLANG_SOCKET_DIR")
    p.add_argument(
        "--base-address", help="HOST:BASE_PORT of an engine started with WEIGHTWIRE_SGLANG_BASE_PORT"
    )
    cli_common.add_count(
        p, "--count", "expected number of workers (tp * pp * dp); required with --base-address", default=None
    )
    cli_common.add_seconds(
        p,
        "--wait",
        "wait this long for --count live workers",
        default=0.0,
        metavar="SECONDS",
        zero_allowed=True,
    )
    p.add_argument(
        "--no-check", action="store_true", help="do not connect to check that each worker is listening"
    )


def run(args: argparse.Namespace) -> int:
    """Print the gRPC target of every weightwire worker of one SGLang engine, ordered by (dp, pp,
    tp) rank. Give the engine's WEIGHTWIRE_SGLANG_SOCKET_DIR, or --base-address with --count."""
    if (args.socket_dir is None) == (args.base_address is None):
        return cli_common.refuse(
            "weightwire discover", "give a socket directory or --base-address (not both)"
        )
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
