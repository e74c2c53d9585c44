"""A trainer process that pushes the demo checkpoint over a transfer group, for the tests that need
the trainer in a process of its own (several trainer ranks in parallel, a trainer killed
mid-bucket).

    python group_trainer.py --version 3 --trainer-rank 0 [--bucket-bytes N] [--die-after-acks K] ADDR...

Prints ``ready`` once its manifests are read, waits for a line on stdin (so that several trainers
start pushing together), pushes, and prints one JSON line: per worker its state, bytes loaded and
received, or the failure reasons. With ``--die-after-acks K`` it kills itself (SIGKILL, no cleanup
at all) from the progress callback once K buckets were acked: the next buckets are then on their way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.client import PushError, PushProgress, WeightPusher
from weightwire.client.transports.transfer_group import TransferGroupOptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoints", nargs="+")
    ap.add_argument("--version", type=int, required=True)
    ap.add_argument("--trainer-rank", type=int, default=0)
    ap.add_argument("--bucket-bytes", type=int, default=64 << 20)
    ap.add_argument("--timeout-s", type=float, default=30.0)
    ap.add_argument("--die-after-acks", type=int, default=0)
    args = ap.parse_args()

    def progress(p: PushProgress) -> None:
        if args.die_after_acks and p.buckets_done >= args.die_after_acks:
            os.kill(os.getpid(), signal.SIGKILL)

    options = TransferGroupOptions(host="127.0.0.1", trainer_rank=args.trainer_rank)
    with WeightPusher(
        args.endpoints, transfer_group=options, timeout_s=args.timeout_s, bucket_size_bytes=args.bucket_bytes
    ) as pusher:
        pusher.manifests()
        print("ready", flush=True)
        sys.stdin.readline()
        out: dict[str, object] = {}
        try:
            results = pusher.push(
                full_checkpoint(DemoConfig(), args.version), version=args.version, progress=progress
            )
            out["results"] = {
                r.worker_id: {
                    "state": r.state,
                    "bytes_loaded": r.bytes_loaded,
                    "bytes_received": r.bytes_received,
                }
                for r in results.values()
            }
        except PushError as e:
            out["failures"] = {
                a: {"reason": err.reason, "message": err.message} for a, err in e.failures.items()
            }
        out["group_id"] = pusher.transfer_group_id
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
