"""The client's subcommands of the ``weightwire`` command line: ``manifest``, ``status``, ``push`` and
``demo``. ``weightwire.client.cli.main`` calls ``add_parser`` to register them.

``manifest`` and ``status`` print readable tables (``--json`` for programs; ``status --watch`` is the
live fleet view of ``weightwire.client.cli.fleet_view``); ``push`` sends a safetensors checkpoint to
running workers with a progress bar on stderr (``weightwire.client.cli.progress``); ``demo`` runs the
whole system on this machine (``weightwire.client.cli.demo``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from weightwire.client.cli.tables import format_table, human_bytes, results_table, short_device
from weightwire.core import cli_common, cli_types
from weightwire.core.errors import PushError, WeightwireError
from weightwire.core.transports.table import names as transport_names

_MB = 1024 * 1024
# --cast-to's names -> torch dtype attribute names (resolved when the push runs: torch loads late).
_CAST_TO = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# The library's refusals name its Python arguments; on the command line the same choice is a flag.
_FLAG_FOR_ARGUMENT = (
    ("pass cast_to=torch.bfloat16 (or a {from: to} map) to push", "pass --cast-to bf16 (or fp16, fp32)"),
    ("use scope='partial'", "use --partial"),
    ("Pass allow_unowned=True", "Pass --allow-unowned"),
    ("use transport='inline'", "use --transport inline"),
)


def as_cli_hint(message: str) -> str:
    """``message`` with the Python API's hints (``scope='partial'``) written as this CLI's flags."""
    for python, flag in _FLAG_FOR_ARGUMENT:
        message = message.replace(python, flag)
    return message


def add_parser(subparsers: Any) -> None:
    p = cli_common.add_command(
        subparsers, "manifest", cmd_manifest, "show what one worker owns (its shard manifest)"
    )
    p.add_argument(
        "address",
        nargs=1,
        action=_Addresses,
        metavar="ADDR",
        help="worker address: unix:/path.sock or HOST:PORT",
    )
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    _connection_args(p)

    p = cli_common.add_command(subparsers, "status", cmd_status, "show weights version and state of workers")
    p.add_argument("addresses", nargs="+", action=_Addresses, metavar="ADDR", help="worker addresses")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the statuses as JSON (with --watch: one JSON object per refresh)",
    )
    p.add_argument(
        "--watch", action="store_true", help="keep polling: a live table redrawn in place until Ctrl-C"
    )
    cli_common.add_seconds(p, "--interval", "seconds between refreshes with --watch (default 2)", default=2.0)
    cli_common.add_count(p, "--count", "with --watch: stop after N refreshes", default=None, metavar="N")
    _connection_args(p)

    p = cli_common.add_command(
        subparsers, "push", cmd_push, "push a safetensors checkpoint to running workers"
    )
    p.add_argument(
        "--from",
        dest="checkpoint",
        required=True,
        metavar="CHECKPOINT",
        help=".safetensors file or directory",
    )
    p.add_argument(
        "--to",
        dest="addresses",
        required=True,
        nargs="+",
        action=_Addresses,
        metavar="ADDR",
        help="worker addresses",
    )
    p.add_argument(
        "--version",
        type=cli_types.version,
        required=True,
        metavar="N",
        help="weights version to install (> current; at most 2^63-1)",
    )
    p.add_argument(
        "--partial", action="store_true", help="a PARTIAL update (default FULL: every owned tensor)"
    )
    p.add_argument(
        "--bucket-mb",
        dest="bucket_bytes",
        type=cli_types.size(_MB, "MiB"),
        default=64 * _MB,
        metavar="MB",
        help="staging bucket size in MiB (default 64; fractions allowed)",
    )
    p.add_argument(
        "--transport",
        default="auto",
        choices=["auto", *transport_names()],
        metavar="NAME",
        help=f"auto (default) or one of: {', '.join(transport_names())}",
    )
    p.add_argument(
        "--cast-to",
        choices=sorted(_CAST_TO),
        default=None,
        metavar="DTYPE",
        help="convert every floating-point tensor to this dtype on the way: bf16, fp16 or fp32 "
        "(default: none; a dtype the workers do not hold is refused)",
    )
    p.add_argument("--allow-unowned", action="store_true", help="skip checkpoint tensors no worker owns")
    p.add_argument("--verify-checksums", action="store_true", help="send CRC-32 per bucket; workers verify")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar on stderr (there is none when stderr is not a terminal)",
    )
    _connection_args(p)

    from weightwire.client.cli import demo

    demo.add_parser(subparsers)


# sockaddr_un.sun_path holds 108 bytes with the terminating NUL; gRPC refuses longer paths with a
# multi-line log on stderr instead of an error.
_MAX_UNIX_PATH = 107
# Targets gRPC resolves by a scheme of its own; anything else must be unix:PATH or HOST:PORT.
_GRPC_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def address_problem(text: str) -> str | None:
    """Why ``text`` cannot be a worker's address, or None. gRPC would take a socket path without
    ``unix:`` as a host name and a host without a port as port 443, and report either much later as
    a worker that went away; the command refuses them before connecting, as ``serve`` does."""
    if (
        text.startswith("unix:")
        and len(text.removeprefix("unix:").removeprefix("//").encode()) > _MAX_UNIX_PATH
    ):
        return f"{text!r}: a Unix socket path is at most {_MAX_UNIX_PATH} bytes (sun_path); use a shorter directory"
    if text.startswith(_GRPC_SCHEMES):
        return None if text.partition(":")[2] else f"{text!r}: nothing after the scheme"
    if text.startswith("[") and text.endswith("]"):
        return f"{text!r} has no port: a worker address is HOST:PORT or unix:/path.sock"
    if "/" in text or text.endswith(".sock"):
        return f"{text!r} looks like a socket path: a Unix socket address starts with unix: (unix:{text})"
    host, sep, port = text.rpartition(":")
    if not sep or not host or host.endswith(":"):  # no port, or a bare IPv6 address
        return f"{text!r} has no port: a worker address is HOST:PORT or unix:/path.sock"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{text!r}: port {port!r} is not 1..65535"
    return None


class _Addresses(argparse.Action):
    """Worker addresses, each at most once (a worker named twice would get the update twice), each
    one gRPC will read as meant (``address_problem``)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option: str | None = None,
    ) -> None:
        for value in values:
            problem = address_problem(value)
            if problem:
                parser.error(f"{option or 'ADDR'}: {problem}")
        twice = sorted(a for a, n in collections.Counter(values).items() if n > 1)
        if twice:
            parser.error(f"{option or 'ADDR'}: {', '.join(twice)} given more than once")
        setattr(namespace, self.dest, list(values))


def _connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection")
    cli_types.add_token_options(g, "bearer token the workers require", "read the token from this file")
    cli_common.add_pem_file(g, "--tls-ca", "CA certificate(s) to verify the workers' TLS", metavar="PEM")
    cli_common.add_seconds(g, "--timeout", "deadline of every call in seconds (default 60)", default=60.0)


def _pusher(args: argparse.Namespace, addresses: Sequence[str], **kw: Any) -> Any:
    from weightwire.client.push.pusher import WeightPusher

    return WeightPusher(
        addresses, token=cli_types.token_of(args), tls_ca=args.tls_ca, timeout_s=args.timeout, **kw
    )


def _fail(err: BaseException) -> int:
    print(f"weightwire: {as_cli_hint(str(err))}", file=sys.stderr)
    return 1


def _bad_input(err: BaseException) -> int:
    """Input the command cannot use (a checkpoint that is not one): one line, exit status 2."""
    return cli_common.refuse("weightwire", str(err))


def _ranks(rank: Any) -> str:
    from weightwire.core.manifest import ParallelRank

    try:
        return ParallelRank.from_proto(rank).short()
    except ValueError as e:  # a worker reporting ranks out of range: show what it said
        return f"({e})"


# --------------------------------------------------------------------------------------------
# manifest
# --------------------------------------------------------------------------------------------


def cmd_manifest(args: argparse.Namespace) -> int:
    """Print a worker's device, parallel ranks, layer range and every checkpoint tensor it consumes."""
    import grpc
    from google.protobuf import json_format
    from weightwire.client.rpc.calls import Worker, call_metadata, error_from_rpc
    from weightwire.core import dtypes
    from weightwire.core.transports import table as transport_table
    from weightwire.v1 import weight_transfer_pb2 as pb

    (address,) = args.address
    worker = Worker(address, tls_ca=_read(args.tls_ca))
    try:
        resp = worker.stub.GetManifest(
            pb.GetManifestRequest(), timeout=args.timeout, metadata=call_metadata(cli_types.token_of(args))
        )
    except grpc.RpcError as e:
        return _fail(error_from_rpc(e, worker=address, context="GetManifest"))
    finally:
        worker.close()
    m = resp.manifest
    if args.json:
        print(json_format.MessageToJson(m, preserving_proto_field_name=True))
        return 0
    total = 0
    rows = []
    for t in m.tensors:
        n = 1
        for d in t.shape:
            n *= d
        nbytes = n * dtypes.itemsize(t.dtype) if t.dtype else 0
        total += nbytes
        rows.append(
            (t.name, dtypes.name(t.dtype), "x".join(map(str, t.shape)) or "scalar", human_bytes(nbytes))
        )
    lr = m.layer_range
    transports = ", ".join(transport_table.kind_name(k) for k in m.transports)
    print(f"worker       {m.worker_id or '?'}  ({address})")
    print(f"device       {short_device(m.device.kind, m.device.uuid)}  (uuid {m.device.uuid})")
    print(f"ranks        {_ranks(m.rank)}")
    print(f"layers       [{lr.start_layer}, {lr.end_layer}) of {lr.num_layers}")
    print(f"engine       {m.engine}   transports: {transports or '-'}")
    print(f"fingerprint  {m.fingerprint}   instance {m.instance_id}")
    print(f"tensors      {len(m.tensors)} ({human_bytes(total)}; full checkpoint shapes)")
    print()
    print(format_table(("name", "dtype", "shape", "bytes"), rows, right=(3,)))
    return 0


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


# --------------------------------------------------------------------------------------------
# status
# --------------------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    """One row per worker: device, ranks, weights version, state, last update and last error."""
    from weightwire.client.cli import fleet_view
    from weightwire.client.rpc.calls import Worker, call_metadata, close_workers
    from weightwire.v1 import weight_transfer_pb2 as pb

    metadata = call_metadata(cli_types.token_of(args))
    workers = [Worker(a, tls_ca=_read(args.tls_ca)) for a in args.addresses]
    if args.watch:
        try:
            return fleet_view.watch(
                workers,
                interval_s=args.interval,
                timeout_s=args.timeout,
                metadata=metadata,
                as_json=args.json,
                count=args.count,
            )
        finally:
            # Ctrl-C may have landed inside a call, whose lock a plain close would then wait on forever.
            close_workers(workers)
    try:
        statuses = fleet_view.poll_statuses(workers, timeout_s=args.timeout, metadata=metadata)
    finally:
        close_workers(workers)
    if args.json:
        print(json.dumps(fleet_view.fleet_json(statuses), indent=2))
        return 0 if not any(isinstance(s, WeightwireError) for s in statuses.values()) else 1
    rows = []
    bad = False
    for addr, s in statuses.items():
        if isinstance(s, WeightwireError):
            bad = True
            # The whole reason and message: this table is the place a user reads why.
            rows.append((addr, "-", "-", "-", "UNREACHABLE", "-", f"{s.reason}: {s.message}"))
            continue
        state = fleet_view.state_of(s)
        bad |= s.state != pb.WORKER_STATE_CONSISTENT
        rows.append(
            (
                f"{s.worker_id or '?'} {addr}",
                short_device(s.device.kind, s.device.uuid),
                _ranks(s.rank),
                s.weights_version,
                state,
                fleet_view.last_update(s),
                fleet_view.last_error(s),
            )
        )
    print(
        format_table(
            ("worker", "device", "ranks", "version", "state", "last update", "last error"), rows, right=(3,)
        )
    )
    return 1 if bad else 0


# --------------------------------------------------------------------------------------------
# push
# --------------------------------------------------------------------------------------------


def load_checkpoint(path: str) -> dict[str, Any]:
    """Every tensor of a .safetensors file, or of all .safetensors files in a directory (sorted).

    ``OSError`` for a path that cannot be read, ``ValueError`` naming the file for one that is not
    a readable safetensors file (text, random bytes, truncated, a header that lies).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    tensors: dict[str, Any] = {}
    for f in files:
        try:
            loaded = load_file(f)
        except (
            SafetensorError,
            RuntimeError,
            ValueError,
        ) as e:  # the parser's error, or torch's for the bytes it describes
            raise ValueError(f"{f} is not a readable .safetensors file: {e}") from None
        for name, t in loaded.items():
            if name in tensors:
                raise ValueError(f"tensor {name} appears in more than one file of {path}")
            tensors[name] = t
    return tensors


def _cast_to(name: str | None) -> Any:
    if name is None:
        return None
    import torch

    return getattr(torch, _CAST_TO[name])


def cmd_push(args: argparse.Namespace) -> int:
    """Load a .safetensors file (or every .safetensors file of a directory) and push it to the
    workers as weights version N. Names must be checkpoint names; every check runs before anything
    is sent."""
    from weightwire.client.inputs.plan import PlanError

    try:
        tensors = load_checkpoint(args.checkpoint)
    except (OSError, ValueError) as e:
        return _bad_input(e)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(
        f"weightwire push: {len(tensors)} tensors ({human_bytes(total)}) from {args.checkpoint} -> "
        f"{len(args.addresses)} worker(s) as version {args.version}",
        file=sys.stderr,
    )
    from weightwire.client.cli.progress import PushProgressBar

    try:
        with (
            _pusher(
                args, args.addresses, bucket_size_bytes=args.bucket_bytes, transport=args.transport
            ) as pusher,
            PushProgressBar(f"v{args.version}") as bar,
        ):
            manifests = pusher.manifests()
            results = pusher.push(
                tensors,
                version=args.version,
                cast_to=_cast_to(args.cast_to),
                scope="partial" if args.partial else "full",
                allow_unowned=args.allow_unowned,
                verify_checksums=args.verify_checksums,
                progress=None if args.no_progress else bar,
            )
    except PlanError as e:
        return _fail(e)
    except PushError as e:
        return _fail(e)
    except WeightwireError as e:
        return _fail(e)
    print(results_table(results, manifests))
    return 0
