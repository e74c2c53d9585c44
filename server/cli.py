"""``weightwire serve``: run one engine worker (the built-in demo model) as a gRPC server.

Registered into the ``weightwire`` command line by ``weightwire.client.cli.main``. Prints
``weightwire-serve listening <ADDR>`` as its first stdout line once it accepts requests, runs until
SIGTERM/SIGINT, then stops the server and releases every mapping.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from weightwire.core import cli_common, cli_types
from weightwire.core.manifest import ParallelRank
from weightwire.server.worker.streams import DEFAULT_IDLE_TIMEOUT_S

log = logging.getLogger("weightwire.serve")


def add_parser(subparsers: Any) -> None:
    p = cli_common.add_command(
        subparsers, "serve", run, "run an engine worker (demo model) serving WeightTransferService"
    )
    p.add_argument("--model", choices=["demo"], default="demo", help="model to serve (default: demo)")
    for axis in ("tp", "pp", "dp", "sp"):
        p.add_argument(
            f"--{axis}-rank", type=int, default=0, metavar="R", help=f"{axis.upper()} rank of this worker"
        )
        cli_common.add_count(
            p, f"--{axis}-size", f"{axis.upper()} size of the engine", default=1, metavar="N"
        )
    p.add_argument(
        "--listen",
        type=cli_types.listen_address,
        default=None,
        metavar="ADDR",
        help="'unix:/abs/path.sock' or 'HOST:PORT' (port 0 picks one); default: a unix socket in a private directory",
    )
    p.add_argument(
        "--seed",
        type=cli_types.seed,
        default=0,
        help="initial weights = demo checkpoint of this seed (default 0)",
    )
    cli_common.add_device(p, "cpu, or cuda (the current visible GPU)")
    cli_types.add_token_options(
        p,
        "require 'authorization: Bearer TOKEN' (needed on non-loopback TCP)",
        "read the token from this file instead of the command line",
    )
    cli_common.add_pem_file(p, "--tls-cert", "PEM certificate chain for TLS on TCP")
    cli_common.add_pem_file(p, "--tls-key", "PEM private key for TLS on TCP")
    p.add_argument("--worker-id", default=None, help="worker name (default e.g. tp0-pp1)")
    p.add_argument(
        "--dump-dir",
        default=None,
        metavar="DIR",
        help="after each committed update write the local shard to DIR/<worker_id>-v<version>.safetensors",
    )
    p.add_argument(
        "--metrics-port",
        type=cli_types.port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a port; printed as "
        "'weightwire-serve metrics URL' after the listening line); default: no metrics endpoint",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address of the metrics endpoint (default 127.0.0.1)",
    )
    cli_common.add_seconds(
        p,
        "--idle-timeout-s",
        f"end a PushWeights stream that sends nothing for S seconds (default {DEFAULT_IDLE_TIMEOUT_S:g})",
        default=DEFAULT_IDLE_TIMEOUT_S,
    )
    p.add_argument(
        "--group-host",
        default=None,
        metavar="ADDR",
        help="address of this machine that transfer-group sockets listen on, reachable by the trainer "
        "(default: the --listen TCP host, else 127.0.0.1); see docs/distributed.md",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


# The options ``serve`` takes as the command line gave them: each flag's value is the keyword
# argument of the same name.
_SERVE_FLAGS = ("listen", "tls_cert", "tls_key", "idle_timeout_s", "group_host")


def _serve_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in _SERVE_FLAGS}


def _dump(adapter: Any, dump_dir: str, version: int) -> None:
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in adapter.state().items()}
    path = os.path.join(dump_dir, f"{adapter.worker_id}-v{version}.safetensors")
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata={"version": str(version), "worker_id": adapter.worker_id})
    os.replace(tmp, path)  # readers never see a half-written file


def _refuse(message: str) -> int:
    """Bad input on the command line: one line on stderr, exit status 2."""
    return cli_common.refuse("weightwire serve", message)


def _writable_dir(path: str) -> str | None:
    """Why ``path`` cannot take the dump files (created if missing), or None when it can: checked by
    writing a file there, which is what the dumps do (permission bits say nothing for root)."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"--dump-dir {path}: cannot write there: {e.strerror or e}"
    return None


def _bind_problem(listen: str) -> str | None:
    """Why the TCP address ``listen`` cannot be listened on, found by binding it the way gRPC will
    (SO_REUSEADDR: a port some listener holds is refused, one in TIME_WAIT is not), or None when
    the probe could bind it. Asked first so that a port in use is one line with its reason, not
    gRPC's log and a "failed to bind" without one."""
    import errno
    import socket

    from weightwire.server.rpc.grpc_server import split_host_port

    try:
        host, port = split_host_port(listen)
    except ValueError as e:
        return str(e)
    if port == 0:
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as e:
        # Only the answers gRPC would get as well; a name it resolves otherwise is left to it.
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            return e.strerror or str(e)
    return None


def run(args: argparse.Namespace) -> int:  # noqa: C901 - known; split when next changed
    """Run one engine worker with the built-in demo model. Prints 'weightwire-serve listening ADDR'
    once it accepts requests."""
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import torch
    from weightwire.adapters.torch import TorchAdapter
    from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model
    from weightwire.core.devices import DeviceRef, cuda_device_uuid
    from weightwire.server import serve

    try:
        rank = ParallelRank(
            tp_rank=args.tp_rank,
            tp_size=args.tp_size,
            pp_rank=args.pp_rank,
            pp_size=args.pp_size,
            dp_rank=args.dp_rank,
            dp_size=args.dp_size,
            sp_rank=args.sp_rank,
            sp_size=args.sp_size,
        )
    except ValueError as e:
        return _refuse(str(e))
    if args.listen is not None and not args.listen.startswith("unix:"):
        problem = _bind_problem(args.listen)
        if problem is not None:
            return _refuse(f"cannot listen on {args.listen}: {problem}")
    token = cli_types.token_of(args)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            return _refuse("--device cuda but no CUDA device is visible")
        index = torch.cuda.current_device()
        device = torch.device("cuda", index)
        own_device = DeviceRef.cuda(cuda_device_uuid(index))
    else:
        device = torch.device("cpu")
        own_device = DeviceRef.host()
    config = DemoConfig()
    try:
        model = build_demo_model(config, rank, device, args.seed)
    except (
        ValueError
    ) as e:  # a layout the demo model cannot take (more stages than layers, a TP size that does not divide)
        return _refuse(f"the demo model cannot be served as {rank.short()}: {e}")
    adapter = TorchAdapter(
        model,
        rank=rank,
        device=device,
        own_device=own_device,
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
        engine="torch-demo",
        worker_id=args.worker_id,
    )
    on_commit = None
    if args.dump_dir:
        problem = _writable_dir(args.dump_dir)
        if problem is not None:
            return _refuse(problem)
        dump_dir = args.dump_dir

        def on_commit(result: Any) -> None:
            _dump(adapter, dump_dir, result.version)

    try:
        server = serve(adapter, token=token, own_device=own_device, on_commit=on_commit, **_serve_flags(args))
    except (ValueError, OSError) as e:
        return _refuse(str(e))
    except RuntimeError as e:  # gRPC's "Failed to bind to address"
        tcp = args.listen is not None and not args.listen.startswith("unix:")
        why = (_bind_problem(args.listen) if tcp else None) or str(e)
        return _refuse(f"cannot listen on {args.listen or 'a private unix socket'}: {why}")
    # From here on the server is running: whatever ends this command stops it, which also removes
    # its private socket directory.
    grace = 0.0
    metrics_server = None
    try:
        if args.metrics_port is not None:
            from prometheus_client import CollectorRegistry
            from weightwire.server.observe.metrics import WorkerMetrics, serve_metrics

            registry = CollectorRegistry()
            WorkerMetrics(adapter.worker_id, registry=registry).attach(server.service)
            try:
                metrics_server = serve_metrics(registry, args.metrics_port, args.metrics_host)
            except (OSError, ValueError, OverflowError) as e:
                reason = getattr(e, "strerror", None) or str(e)
                return _refuse(f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {reason}")

        stop = threading.Event()

        def on_signal(signum: int, frame: Any) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        print(f"weightwire-serve listening {server.address}", flush=True)
        if metrics_server is not None:
            print(f"weightwire-serve metrics {metrics_server.url}", flush=True)
        log.info(
            "worker %s (%s, device %s, %d tensors) ready",
            adapter.worker_id,
            rank.short(),
            own_device,
            len(adapter.manifest().tensors),
        )
        while not stop.wait(1.0):
            pass
        log.info("stopping")
        grace = 2.0
        return 0
    finally:
        server.stop(grace=grace)
        if metrics_server is not None:
            metrics_server.close()
