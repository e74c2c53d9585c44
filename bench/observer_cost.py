"""What a worker's observers cost per update: the structured update line and Prometheus metrics,
against the same worker with no observer, measured in the same run.

The worker core (``WorkerService``, no gRPC) runs FULL updates of the demo model (39 tensors) from
prebuilt inline buckets, so what is timed is the worker's own per-update work (checks, views,
loads, commit) plus what the observers add. Rounds alternate the three set-ups so that load on
the machine hits them alike::

    python bench/observer_cost.py [--updates 200] [--rounds 7] [--buckets 1 8]

Prints per-update medians and the ratio to "none"; BENCHMARKS.md has a run.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch
from prometheus_client import CollectorRegistry
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model, full_checkpoint
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ParallelRank
from weightwire.server.observe.metrics import WorkerMetrics
from weightwire.server.observe.update_events import UpdateEvents
from weightwire.server.observe.update_log import LOGGER_NAME
from weightwire.server.worker.service import WorkerService
from weightwire.v1 import weight_transfer_pb2 as pb


def inline_buckets(n_buckets: int) -> list[pb.PushWeightsRequest]:
    tensors = list(full_checkpoint(DemoConfig(), seed=1).items())
    per = -(-len(tensors) // n_buckets)
    out = []
    for i in range(0, len(tensors), per):
        specs, chunks, offset = [], [], 0
        for name, t in tensors[i : i + per]:
            raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            specs.append(
                pb.TensorSpec(
                    name=name, dtype=dtypes.from_torch(t.dtype), shape=list(t.shape), offset_bytes=offset
                )
            )
            chunks.append(raw)
            offset += len(raw)
        data = b"".join(chunks)
        payload = pb.Payload(device=DeviceRef.host().to_proto(), size_bytes=len(data), inline_data=data)
        out.append(pb.PushWeightsRequest(bucket=pb.Bucket(index=len(out), tensors=specs, payloads=[payload])))
    return out


def make_service(kind: str) -> WorkerService:
    config = DemoConfig()
    model = build_demo_model(config, ParallelRank(), "cpu", 0)
    adapter = TorchAdapter(
        model,
        rank=ParallelRank(),
        device=torch.device("cpu"),
        own_device=None,
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
    )
    service = WorkerService(adapter, own_device=DeviceRef.host())
    if kind == "none":
        service._events = UpdateEvents()  # the bench compares against a worker without its default observer
    if kind == "log+metrics":
        WorkerMetrics(adapter.worker_id, registry=CollectorRegistry()).attach(service)
    return service


def time_updates(service: WorkerService, buckets: list[pb.PushWeightsRequest], n: int) -> float:
    """Median seconds of one update over ``n`` updates."""
    times = []
    for _ in range(n):
        version = service.weights_version + 1
        reqs = [
            pb.PushWeightsRequest(header=pb.UpdateHeader(version=version, scope=pb.UPDATE_SCOPE_FULL)),
            *buckets,
            pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=len(buckets))),
        ]
        t0 = time.perf_counter()
        responses = list(service.push(iter(reqs)))
        times.append(time.perf_counter() - t0)
        if responses[-1].result.version != version:
            raise RuntimeError("an update did not commit")
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=200, help="updates per set-up per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 8])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    # As `weightwire serve` logs: INFO, one formatted line per record, to a stream (here /dev/null).
    handler = logging.StreamHandler(open(os.devnull, "w"))  # open for the whole run
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger(LOGGER_NAME).addHandler(handler)
    logging.getLogger(LOGGER_NAME).setLevel(logging.INFO)
    logging.getLogger(LOGGER_NAME).propagate = False
    kinds = ("none", "log", "log+metrics")
    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
        f"{args.rounds} rounds x {args.updates} updates per set-up"
    )
    for n_buckets in args.buckets:
        buckets = inline_buckets(n_buckets)
        services = {k: make_service(k) for k in kinds}
        for s in services.values():
            time_updates(s, buckets, 10)  # warm: layout cache, allocator
        medians: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(args.rounds):
            for k in kinds:
                medians[k].append(time_updates(services[k], buckets, args.updates))
        base = statistics.median(medians["none"])
        for k in kinds:
            m = statistics.median(medians[k])
            print(
                f"{len(buckets)} bucket(s)  {k:12s} {m * 1e6:8.1f} us/update   x{m / base:.3f} of none   (+{(m - base) * 1e6:.1f} us)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
