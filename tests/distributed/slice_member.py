"""One member of a multi-source slice transfer, in its own process, for test_slices_from_every_rank.py.

Every member builds the same inputs a push would have: the demo model's TorchAdapter manifest for
every worker of a TP x PP x DP engine (real slice geometry from the adapter's TP rules) and the
FSDP2 holdings of every trainer rank (``Shard(0)`` over the trainer ranks), plans, and joins one
gloo process group on the test's store. A trainer rank keeps only its own shards of the checkpoint
(the full one is dropped before anything is sent) and sends what the plan gives it; a worker
receives straight into its TorchAdapter's parameters and checks them against the checkpoint's
slices. Prints one JSON line: the bytes it sent or received, its parameters' check, or the error.

``--plan-variant`` makes this member plan from other inputs (it believes a worker keeps another
slice), for the refusal test; ``--die-after-agree`` exits at once after the plan check (a trainer
rank lost mid-update). ``--direct-min-bytes 0`` sends every region of whole rows in place
(the demo model's tensors are all below the default bound, so they are otherwise all packed).
``--short-messages data`` makes a trainer rank send every slices message at half its planned size
(its announcements whole), ``--short-messages announcement`` its announcements at half theirs: a
broken or hostile sender, for the test that a short message is refused, never counted.
``--die-after-announcing`` makes a trainer rank exit once its announcements went out, before its
first message. ``--isolated`` makes a worker receive as ``weightwire serve`` does: through a
receiving process (``isolated_gloo``; every member then rendezvouses on weightwire's own store,
which the test serves), its bytes held there until every message arrived whole and
landed only then; a failed receive lands nothing, and the worker then reports whether its
parameters are still bit for bit what they were before (``unchanged``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers
from helpers import DiesAtItsFirstData
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import (
    DEMO_TP_RULES,
    DemoConfig,
    build_demo_model,
    expected_shard,
    full_checkpoint,
)
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest
from weightwire.core.transports.isolated_gloo import ReceivingProcess
from weightwire.core.transports.transfer_group_agreement import agree
from weightwire.core.transports.transfer_group_slices import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DIRECT_MIN_BYTES,
    GroupRanks,
    Writes,
    messages,
    receive_slices,
    send_slices,
)
from weightwire.core.transports.transfer_group_store import connect_store
from weightwire.core.transports.transfer_plan import Shard, TensorSpec, plan_transfers

CONFIG = DemoConfig()
HOST = DeviceRef.host("b0070000-0000-0000-0000-000000000000")
TIMEOUT_S = 30.0


def engine(tp: int, pp: int, dp: int) -> dict[str, tuple[ParallelRank, TorchAdapter]]:
    out = {}
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                rank = ParallelRank(tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, dp_rank=d, dp_size=dp)
                model = build_demo_model(CONFIG, rank, "cpu", 0)
                adapter = TorchAdapter(
                    model,
                    rank=rank,
                    device=torch.device("cpu"),
                    own_device=HOST,
                    tp_rules=DEMO_TP_RULES,
                    num_layers=CONFIG.num_layers,
                )
                out[adapter.worker_id] = (rank, adapter)
    return out


class ShortSends:
    """A process group whose sends carry only the first half of some messages: after the first one
    to each peer (``data``: the announcement goes whole), or only the first (``announcement``)."""

    def __init__(self, pg: object, mode: str) -> None:
        self.pg, self.mode, self.sent_to = pg, mode, collections.Counter[int]()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> object:
        first = self.sent_to[dst] == 0
        self.sent_to[dst] += 1
        if first == (self.mode == "announcement"):
            flat = tensors[0].reshape(-1).view(torch.uint8)
            tensors = [flat[: flat.numel() // 2]]
        return self.pg.send(tensors, dst, tag)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.pg, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)  # host:port
    ap.add_argument("--group", required=True)
    ap.add_argument("--trainers", type=int, required=True)
    ap.add_argument("--engine", required=True)  # tp,pp,dp
    ap.add_argument("--rank", type=int, required=True)  # group rank
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--plan-variant", action="store_true")
    ap.add_argument("--direct-min-bytes", type=int, default=DIRECT_MIN_BYTES)
    ap.add_argument("--die-after-agree", action="store_true")
    ap.add_argument("--short-messages", choices=["data", "announcement"])
    ap.add_argument("--die-after-announcing", action="store_true")
    ap.add_argument("--isolated", action="store_true")
    args = ap.parse_args()
    tp, pp, dp = (int(x) for x in args.engine.split(","))

    workers = engine(tp, pp, dp)
    manifests = {w: a.manifest() for w, (_, a) in workers.items()}
    if args.plan_variant:
        # This member believes the first sliced tensor of the first worker is kept whole.
        first = sorted(manifests)[0]
        m = manifests[first]
        name = next(n for n, t in sorted(m.tensors.items()) if t.pieces)
        tensors = dict(m.tensors)
        tensors[name] = OwnedTensor(name, m.tensors[name].dtype, m.tensors[name].shape)
        manifests[first] = ShardManifest.build(
            m.device, m.rank, tensors.values(), worker_id=m.worker_id, instance_id=m.instance_id
        )
    full = full_checkpoint(CONFIG, args.seed)
    specs = [
        TensorSpec.dtensor(name, tuple(t.shape), dtypes.from_torch(t.dtype), (args.trainers,), [Shard(0)])
        for name, t in full.items()
    ]
    plan = plan_transfers(specs, manifests)
    ranks = GroupRanks.of_plan(args.trainers, list(manifests))

    host, port = args.store.rsplit(":", 1)
    opts = torch.distributed.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
    opts._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=False)]
    pg: Any
    if args.isolated and args.rank >= args.trainers:
        receiving = ReceivingProcess()
        receiving.wait_ready(TIMEOUT_S)
        pg = receiving.process_group(
            args.store, [args.group], args.rank, ranks.world_size, opts._timeout, "127.0.0.1"
        )
    else:
        store: Any
        if args.isolated:  # every member on weightwire's store, which a receiving process speaks
            store = connect_store(args.store, TIMEOUT_S)
        else:
            store = torch.distributed.TCPStore(host, int(port), None, False, opts._timeout)
        pg = torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore(args.group, store), args.rank, ranks.world_size, opts
        )
    result: dict[str, object] = {"rank": args.rank, "fingerprint": plan.fingerprint}
    try:
        agree(pg, plan, args.rank, ranks.world_size, TIMEOUT_S)
        if args.die_after_agree:
            os._exit(3)  # killed between the plan check and its first send
        if args.rank < args.trainers:
            # Only this rank's shards survive: the full checkpoint is gone before a byte moves.
            local = {
                s.name: full[s.name][tuple(slice(a, b) for a, b in s.holdings[args.rank])].clone()
                for s in specs
                if args.rank in s.holdings
            }
            holdings = {s.name: s.holdings[args.rank] for s in specs if args.rank in s.holdings}
            del full
            sender = pg
            if args.short_messages:
                sender = ShortSends(pg, args.short_messages)
            elif args.die_after_announcing:
                sender = DiesAtItsFirstData(pg)  # exits with SLICE_RANK_DIED_EXIT_CODE (3)
            result["sent"] = send_slices(
                sender,
                plan,
                ranks,
                args.rank,
                local,
                holdings,
                timeout_s=TIMEOUT_S,
                direct_min_bytes=args.direct_min_bytes,
            )
            result["planned"] = sum(t.nbytes * len(t.destinations) for t in plan.for_source(args.rank))
        else:
            worker = ranks.workers[args.rank - args.trainers]
            rank, adapter = workers[worker]
            params = adapter.state()
            before = {n: t.clone() for n, t in params.items()}
            in_place = sum(
                1
                for src in range(args.trainers)
                for m in messages(plan, src, worker, DEFAULT_MAX_MESSAGE_BYTES, args.direct_min_bytes)
                if len(m) == 1 and m[0].rows and m[0].nbytes >= args.direct_min_bytes
            )
            result["in_place_messages"] = in_place
            landings: list[Any] = []
            with torch.no_grad():
                try:
                    received = receive_slices(
                        pg,
                        plan,
                        ranks,
                        worker,
                        params,
                        manifests[worker].tensors,
                        timeout_s=TIMEOUT_S,
                        direct_min_bytes=args.direct_min_bytes,
                        writes=Writes(deferred=landings) if args.isolated else None,
                    )
                except WeightwireError:
                    result["unchanged"] = all(torch.equal(params[n], t) for n, t in before.items())
                    raise
                for land in landings:  # the update commits: what was held back lands now
                    land()
            want = expected_shard(full, rank, CONFIG)
            result.update(
                worker=worker,
                received=received,
                kept_bytes=manifests[worker].kept_bytes,
                exact=sorted(want) == sorted(params) and all(torch.equal(params[n], want[n]) for n in want),
            )
    except WeightwireError as e:
        result.update(error=e.reason_name, message=str(e))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
