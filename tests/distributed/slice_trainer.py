"""One trainer rank of the every-rank-a-source tests: torch.distributed with gloo on the CPU, the demo
model sharded with FSDP2, and one ``WeightPusher(..., transfer_group=...)`` kept across steps, pushing
``model.state_dict()`` with ``group=`` the way a training loop would (every rank runs the same line).

Started by the test with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment as
``slice_trainer.py [--backend nccl] [--store-port P] [--group-timeout S] [--bucket-bytes B] ADDR...``
(``--store-port``: the pusher's store on a fixed port, as docs/distributed.md shows; ``--group-timeout``:
the transfer group's timeout, 20 s unless given; ``--bucket-bytes``: the pusher's bucket size, which
splits each worker's part into buckets). Reads one JSON command per line on stdin and answers one JSON
line on stdout for each:

  {"op": "push", "version": V, "seed": S, "scope": "full"|"partial", "drop": [names], "cast_to": dtype,
   "pause_rank": R, "pause_between_buckets": R, "single": bool, "steps": [seeds], "delta": bool,
   "forge_base": B}
                    push the checkpoint of seed S after the sparse steps of ``steps``
                    (``sparse_checkpoint.stepped``), with ``delta=True`` when asked (``forge_base``:
                    a delta against base B, which no worker had, sent as push(delta=True) sends one
                    but without its decision or fallback, from a copy of the pusher's keeper:
                    the pusher's own base stays) (``drop``: tensors left out;
                    ``single``: rank 0 alone pushes it as plain tensors, one source, the
                    others answer {"ok": true} at once). On rank R, the push
                    prints {"paused": true} after the group compared the plan, right before its own
                    sends, and waits for a line on stdin ("go": send; "die": exit at once, code 3);
                    with "pause_between_buckets": R, rank R sends every worker's first bucket,
                    then prints {"paused": true} and waits so before the second bucket's
  {"op": "quit"}

The answer: {"ok": true, "results": {addr: {...}}, "group_id": ..., "formations": N, "progress":
[[buckets_done, buckets_total, bytes_done, bytes_total], ...], "committed_pushes": the pusher's
metrics count} or {"ok": false,
"error": {"reason", "failures": {addr: {"reason", "message"}}}}. The pause wraps the library's
``send_slices`` in this process only (a test harness, not part of weightwire).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from sparse_checkpoint import stepped
from torch.distributed.fsdp import fully_shard
from weightwire.adapters.torch.demo import DemoConfig, build_demo_model
from weightwire.client import PushError, PushProgress, TrainerMetrics, WeightPusher, WeightwireError
from weightwire.client.inputs.dtensor_gather import default_group
from weightwire.client.ranks import slice_deltas, slice_push
from weightwire.client.transports.transfer_group import TransferGroupOptions
from weightwire.client.update.options import PushOptions
from weightwire.core.manifest import ParallelRank
from weightwire.core.transports.transfer_group_slices import send_sequence
from weightwire.v1 import weight_transfer_pb2 as pb

DIED_EXIT_CODE = 3
_pause = False
_pause_between = False
_real_send = slice_push.send_slices


def _wait_for_word() -> None:
    print(json.dumps({"paused": True}), flush=True)
    line = sys.stdin.readline().strip()
    if line == "die":
        os._exit(DIED_EXIT_CODE)  # a trainer rank lost mid-transfer: no cleanup, like a crash


class _PausedAfter:
    """A process group whose ``send`` pauses (``_wait_for_word``) before its ``n + 1``-th send."""

    def __init__(self, pg: Any, n: int) -> None:
        self._pg, self._left = pg, n

    def send(self, *args: Any) -> Any:
        if self._left == 0:
            _wait_for_word()
        self._left -= 1
        return self._pg.send(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)


def _paused_send(pg: Any, plan: Any, ranks: Any, source: int, *args: Any, **kwargs: Any) -> int:
    if _pause:
        _wait_for_word()
    if _pause_between:
        # The sends of the first round of buckets: each worker's announcement and messages.
        first = [
            w
            for w, bucket, _, _ in send_sequence(
                plan, ranks, source, kwargs["max_message_bytes"], buckets=kwargs["buckets"]
            )
            if bucket == 0
        ]
        pg = _PausedAfter(pg, len(first) + len(set(first)))
    return _real_send(pg, plan, ranks, source, *args, **kwargs)


slice_push.send_slices = _paused_send  # type: ignore[assignment]


def fsdp_model(seed: int, steps: list[int] | None = None) -> torch.nn.Module:
    model = build_demo_model(DemoConfig(), ParallelRank(), "cpu", seed)
    if steps:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in stepped(DemoConfig(), seed, steps).items():
                params[name].copy_(t)
    for layer in model.model.layers.children():
        fully_shard(layer)
    fully_shard(model)
    return model


def answer(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def run_push(pusher: WeightPusher, cmd: dict[str, Any]) -> dict[str, Any]:
    global _pause, _pause_between
    if cmd.get("single"):
        if dist.get_rank() != 0:
            return {"ok": True}
        model = build_demo_model(DemoConfig(), ParallelRank(), "cpu", int(cmd["seed"]))
    else:
        model = fsdp_model(int(cmd["seed"]), cmd.get("steps"))
    tensors = {n: t for n, t in model.state_dict().items() if n not in set(cmd.get("drop", []))}
    _pause = cmd.get("pause_rank") == dist.get_rank()
    _pause_between = cmd.get("pause_between_buckets") == dist.get_rank()
    reports: list[list[int]] = []

    def progress(p: PushProgress) -> None:
        reports.append([p.buckets_done, p.buckets_total, p.bytes_done, p.bytes_total])

    try:
        if cmd.get("forge_base"):
            return forged_delta(pusher, tensors, int(cmd["version"]), int(cmd["forge_base"]))
        results = pusher.push(
            tensors,
            version=int(cmd["version"]),
            scope=cmd.get("scope", "full"),
            cast_to=getattr(torch, cmd["cast_to"]) if cmd.get("cast_to") else None,
            progress=progress,
            delta=bool(cmd.get("delta")),
        )
        pushes = pusher.metrics.registry.get_sample_value(  # type: ignore[union-attr]
            "weightwire_trainer_pushes_total", {"outcome": "committed"}
        )
        return {
            "progress": reports,
            "committed_pushes": pushes,
            "ok": True,
            "results": {a: dataclasses.asdict(r) for a, r in results.items()},
            "group_id": pusher._sources.group_id if pusher._sources is not None else None,
            "formations": pusher._sources.formations if pusher._sources is not None else 0,
        }
    except (PushError, WeightwireError) as e:
        return failed(e)
    finally:
        _pause = _pause_between = False


def forged_delta(pusher: WeightPusher, tensors: dict[str, Any], version: int, base: int) -> dict[str, Any]:
    """A delta against ``base`` from a copy of the pusher's keeper that believes the workers hold it."""
    confused = copy.deepcopy(pusher.delta_keeper)
    confused._base_version = base
    items = list(tensors.items())
    options = PushOptions(version=version, scope=pb.UPDATE_SCOPE_FULL)
    deltas = slice_deltas.SliceDeltas(confused, version, base)
    results = slice_deltas.send(pusher, items, options, default_group(items), deltas, pb.DELTA_FALLBACK_NONE)
    return {"ok": True, "results": {a: dataclasses.asdict(r) for a, r in results.items()}}


def failed(e: Exception) -> dict[str, Any]:
    failures = getattr(e, "failures", {})
    return {
        "ok": False,
        "error": {
            "reason": getattr(e, "reason", "PUSH_FAILED"),
            "message": str(e)[:4000],
            "failures": {a: {"reason": f.reason, "message": f.message[:2000]} for a, f in failures.items()},
        },
    }


def main() -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    args = sys.argv[1:]
    backend = "gloo"
    if args[:1] == ["--backend"]:
        backend, args = args[1], args[2:]
    port = 0
    if args[:1] == ["--store-port"]:
        port, args = int(args[1]), args[2:]
    group_timeout_s = 20.0
    if args[:1] == ["--group-timeout"]:
        group_timeout_s, args = float(args[1]), args[2:]
    bucket_bytes = None
    if args[:1] == ["--bucket-bytes"]:
        bucket_bytes, args = int(args[1]), args[2:]
    if backend == "nccl" and torch.cuda.is_available():
        # One GPU per trainer rank: NCCL refuses two members of one group on one device.
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    pusher = WeightPusher(
        args,
        transfer_group=TransferGroupOptions(
            host="127.0.0.1", port=port, timeout_s=group_timeout_s, backend=backend
        ),
        timeout_s=60,
        metrics=TrainerMetrics(CollectorRegistry()),
        bucket_size_bytes=bucket_bytes,
    )
    answer({"ready": True, "rank": dist.get_rank()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            answer(run_push(pusher, cmd))
    finally:
        pusher.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
