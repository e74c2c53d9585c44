"""A trainer process for the fault tests: pushes the demo checkpoint of one seed to a set of workers
with ``WeightPusher`` and reports, as JSON lines on stdout, its pid, each completed bucket and the
outcome. ``--sleep-s`` makes each bucket's progress callback sleep, so a test can SIGKILL this
process in the middle of an update.

Run as a script (it imports nothing from the test packages):
``python tests/reliability/trainer.py --endpoint unix:/.../w0.sock --version 3 --seed 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.client import WeightPusher
from weightwire.client.push.pusher import PushProgress
from weightwire.core.errors import PushError


def emit(**event: object) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--endpoint", action="append", required=True)
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--bucket-bytes", type=int, default=16 * 1024)
    p.add_argument(
        "--sleep-s", type=float, default=0.0, help="sleep in the progress callback after each bucket"
    )
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--transport", default="host_shm")
    args = p.parse_args(argv)

    full = full_checkpoint(DemoConfig(), seed=args.seed)

    def progress(report: PushProgress) -> None:
        emit(event="progress", buckets_done=report.buckets_done, buckets_total=report.buckets_total)
        if args.sleep_s:
            time.sleep(args.sleep_s)

    with WeightPusher(
        args.endpoint, timeout_s=args.timeout_s, bucket_size_bytes=args.bucket_bytes, transport=args.transport
    ) as pusher:
        pusher.manifests()
        emit(event="ready", pid=os.getpid())
        try:
            results = pusher.push(full, version=args.version, progress=progress)
        except PushError as e:
            emit(event="failed", failures={a: [f.code, f.reason, f.message] for a, f in e.failures.items()})
            return 1
    emit(event="done", versions={a: r.version for a, r in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
