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

from weightwire.core.manifest import ParallelRank
from weightwire.core.netutil import read_token_file
from weightwire.server.worker.streams import DEFAULT_IDLE_TIMEOUT_S

log = logging.getLogger("weightwire.serve")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run an engine worker (demo model) serving WeightTransferService",
        description="Run one engine worker with the built-in demo model. Prints 'weightwire-serve listening ADDR' "
        "once it accepts requests.",
    )
    p.add_argument("--model", choices=["demo"], default="demo", help="model to serve (default: demo)")
    for axis in ("tp", "pp", "dp", "sp"):
        p.add_argument(f"--{axis}-rank", type=int, default=0, metavar="R", help=f"{axis.upper()} rank of this worker")
        p.add_argument(f"--{axis}-size", type=int, default=1, metavar="N", help=f"{axis.upper()} size of the engine")
    p.add_argument(
        "--listen",
        default=None,
        metavar="ADDR",
        help="'unix:/abs/path.sock' or 'HOST:PORT' (port 0 picks one); default: a unix socket in a private directory",
    )
    p.add_argument("--seed", type=int, default=0, help="initial weights = demo checkpoint of this seed (default 0)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu, or cuda (the current visible GPU)")
    p.add_argument("--token", default=None, help="require 'authorization: Bearer TOKEN' (needed on non-loopback TCP)")
    p.add_argument("--token-file", default=None, help="read the token from this file instead of the command line")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain for TLS on TCP")
    p.add_argument("--tls-key", default=None, help="PEM private key for TLS on TCP")
    p.add_argument("--worker-id", default=None, help="worker name (default e.g. tp0-pp1)")
    p.add_argument(
        "--dump-dir",
        default=None,
        metavar="DIR",
        help="after each committed update write the local shard to DIR/<worker_id>-v<version>.safetensors",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a port; printed as "
        "'weightwire-serve metrics URL' after the listening line); default: no metrics endpoint",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST", help="address of the metrics endpoint (default 127.0.0.1)")
    p.add_argument(
        "--idle-timeout-s",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        metavar="S",
        help=f"end a PushWeights stream that sends nothing for S seconds (default {DEFAULT_IDLE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--group-host",
        default=None,
        metavar="ADDR",
        help="address of this machine that transfer-group sockets listen on, reachable by the trainer "
        "(default: the --listen TCP host, else 127.0.0.1); see docs/distributed.md",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=run)


def _dump(adapter: Any, dump_dir: str, version: int) -> None:
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in adapter.state().items()}
    path = os.path.join(dump_dir, f"{adapter.worker_id}-v{version}.safetensors")
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata={"version": str(version), "worker_id": adapter.worker_id})
    os.replace(tmp, path)  # readers never see a half-written file


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    from weightwire.adapters.torch import TorchAdapter
    from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model
    from weightwire.core.devices import DeviceRef, cuda_device_uuid
    from weightwire.server import serve

    try:
        rank = ParallelRank(
            tp_rank=args.tp_rank, tp_size=args.tp_size, pp_rank=args.pp_rank, pp_size=args.pp_size,
            dp_rank=args.dp_rank, dp_size=args.dp_size, sp_rank=args.sp_rank, sp_size=args.sp_size,
        )
    except ValueError as e:
        print(f"weightwire serve: {e}", file=sys.stderr)
        return 2
    token = args.token
    if args.token_file:
        token = read_token_file(args.token_file)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("weightwire serve: --device cuda but no CUDA device is visible", file=sys.stderr)
            return 2
        index = torch.cuda.current_device()
        device = torch.device("cuda", index)
        own_device = DeviceRef.cuda(cuda_device_uuid(index))
    else:
        device = torch.device("cpu")
        own_device = DeviceRef.host()
    config = DemoConfig()
    model = build_demo_model(config, rank, device, args.seed)
    adapter = TorchAdapter(
        model, rank=rank, device=device, own_device=own_device, tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers, engine="torch-demo", worker_id=args.worker_id,
    )
    on_commit = None
    if args.dump_dir:
        os.makedirs(args.dump_dir, exist_ok=True)
        dump_dir = args.dump_dir

        def on_commit(result: Any) -> None:
            _dump(adapter, dump_dir, result.version)

    try:
        server = serve(
            adapter, listen=args.listen, token=token, tls_cert=args.tls_cert, tls_key=args.tls_key, idle_timeout_s=args.idle_timeout_s,
            own_device=own_device, on_commit=on_commit, group_host=args.group_host,
        )
    except (ValueError, OSError) as e:
        print(f"weightwire serve: {e}", file=sys.stderr)
        return 2
    metrics_server = None
    if args.metrics_port is not None:
        from prometheus_client import CollectorRegistry
        from weightwire.server.observe.metrics import WorkerMetrics, serve_metrics

        registry = CollectorRegistry()
        WorkerMetrics(adapter.worker_id, registry=registry).attach(server.service)
        try:
            metrics_server = serve_metrics(registry, args.metrics_port, args.metrics_host)
        except (OSError, ValueError) as e:
            server.stop(grace=0)
            print(f"weightwire serve: cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {e}", file=sys.stderr)
            return 2

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"weightwire-serve listening {server.address}", flush=True)
    if metrics_server is not None:
        print(f"weightwire-serve metrics {metrics_server.url}", flush=True)
    log.info("worker %s (%s, device %s, %d tensors) ready", adapter.worker_id, rank.short(), own_device, len(adapter.manifest().tensors))
    while not stop.wait(1.0):
        pass
    log.info("stopping")
    server.stop(grace=2.0)
    if metrics_server is not None:
        metrics_server.close()
    return 0
