"""One update whose every trainer rank is a source: ``push(fsdp_model.state_dict(), group=...)`` on
pushers made with ``transfer_group=``, where each rank sends only bytes it holds and each worker
receives exactly its slices (no gather to rank 0, no full tensor anywhere).

Every rank of the trainer's ``group`` runs the same push line; then, in order:

1. each rank plans alone, from the same inputs: the update's checks against every worker's manifest
   (``plan.check_update``: names, dtypes, full shapes, FULL coverage), the holdings of every rank
   (a DTensor's ``Shard`` / ``Replicate`` placements on its mesh; a plain tensor is held whole by
   every rank, so ``group=`` with plain tensors means the same values on every rank) and the transfer
   plan (``core.transports.transfer_plan``); the ranks compare the plans' fingerprints, and any
   error or difference fails every rank before anything is sent;
2. the group of every trainer rank and the workers is formed, or reused (``transfer_group_sources``);
3. rank 0 opens every worker's PushWeights stream and sends its header and one slices bucket (its
   part of the plan); every member compares the plan's fingerprint over the group, then every rank
   sends what the plan gives it (``send_slices``) while every worker receives into its kept tensors;
4. the ranks exchange whether their sends ended well; rank 0 commits on every worker only when every
   rank's did and every worker acked its bucket, and cancels every stream otherwise (tearing its side
   of the group down first, so that no member waits for bytes that will not come);
5. rank 0's results (or failures, with blame) go to every rank: every rank returns the same results
   or raises the same ``PushError``. A failed update tears the group down on every member; the next
   push forms a new one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from weightwire.client.inputs import plan as planning
from weightwire.client.inputs.dtensor_gather import CastTo, is_dtensor, spec_of, target_dtype
from weightwire.client.inputs.plan import PlanError
from weightwire.client.inputs.types import PushProgress, PushResult
from weightwire.client.ranks import rank_records
from weightwire.client.ranks.rank_agreement import RankGroup, peer_failed
from weightwire.client.ranks.rank_records import RankFailure, RankResults
from weightwire.client.ranks.transfer_group_sources import FormedSources, SourcesLink
from weightwire.client.rpc.stream import Connections, WorkerStream, settle_cancelled
from weightwire.client.update.blame import collect_results
from weightwire.core import dtypes
from weightwire.core.errors import PushError, Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.transfer_group_slices import DEFAULT_MAX_MESSAGE_BYTES, agree, send_slices
from weightwire.core.transports.transfer_plan import (
    Box,
    Placement,
    Replicate,
    Shard,
    TransferPlan,
    plan_transfers,
)
from weightwire.core.transports.transfer_plan import TensorSpec as Holding
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    from weightwire.client.update.options import PushOptions

__all__ = ["holdings_of", "push_slices"]

# The trainer's own exchanges wait this much longer than one transfer may take.
_GROUP_GRACE_S = 30.0


def _placements(name: str, t: Any) -> list[Placement]:
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    out: list[Placement] = []
    for p in t.placements:
        if type(p) is DShard:
            out.append(Shard(int(p.dim)))
        elif isinstance(p, DReplicate):
            out.append(Replicate())
        else:
            raise PlanError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"{name}: DTensor placement {p!r} is not one every rank can send its part of (Shard and Replicate "
                "are); push without transfer_group=, which gathers it",
                tensor=name,
            )
    return out


def holdings_of(
    items: Sequence[tuple[str, torch.Tensor]], group: Any, cast_to: CastTo = None
) -> list[Holding]:
    """What every rank of ``group`` holds of each tensor (in the dtype it is sent as)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    meshes: dict[int, list[int]] = {}
    specs: list[Holding] = []
    for name, t in items:
        code = dtypes.from_torch(target_dtype(t.dtype, cast_to))
        shape = tuple(int(d) for d in t.shape)
        if not is_dtensor(t):
            specs.append(Holding.whole_on(name, shape, code, range(size)))
            continue
        mesh = t.device_mesh  # type: ignore[attr-defined]
        ranks = meshes.get(id(mesh))
        if ranks is None:
            ranks = meshes[id(mesh)] = [
                dist.get_group_rank(group, int(g)) for g in mesh.mesh.flatten().tolist()
            ]
        if any(r < 0 for r in ranks):
            raise PlanError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"{name}: its device mesh has ranks outside the group given as group=",
                tensor=name,
            )
        specs.append(Holding.dtensor(name, shape, code, tuple(mesh.shape), _placements(name, t), ranks))
    return specs


def local_parts(
    items: Sequence[tuple[str, torch.Tensor]],
    specs: Sequence[Holding],
    rank: int,
    cast_to: CastTo = None,
    device: torch.device | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """This rank's parts of ``items`` (the local shard of a DTensor; cast when asked, and on
    ``device``, the one the group's backend sends from, when given) and the boxes they are."""
    local: dict[str, torch.Tensor] = {}
    boxes: dict[str, Box] = {}
    for (name, t), spec in zip(items, specs, strict=True):
        box = spec.holdings.get(rank)
        if box is None:
            continue
        part = (t.to_local() if is_dtensor(t) else t).detach()  # type: ignore[attr-defined]
        dtype = target_dtype(t.dtype, cast_to)
        to = device if device is not None and part.device.type != device.type else part.device
        local[name] = part if (part.dtype, part.device) == (dtype, to) else part.to(device=to, dtype=dtype)
        boxes[name] = box
    return local, boxes


def _layout_key(items: Sequence[tuple[str, torch.Tensor]]) -> tuple[object, ...]:
    """What the plan of ``items`` depends on, cheap to build every push: names, dtypes, shapes and,
    for a DTensor, its mesh's ranks and its placements (each distinct mesh read once)."""
    meshes: dict[int, tuple[object, ...]] = {}

    def mesh_of(t: Any) -> tuple[object, ...]:
        mesh = t.device_mesh
        key = meshes.get(id(mesh))
        if key is None:
            key = meshes[id(mesh)] = (tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist()))
        return key

    return tuple(
        (n, t.dtype, tuple(t.shape), (mesh_of(t), tuple(map(str, t.placements))) if is_dtensor(t) else None)  # type: ignore[attr-defined]
        for n, t in items
    )


class _Streams:
    """Rank 0's streams of one update: acks (each worker's one bucket, reported to ``progress``)
    and ends, and a callback at the first failure."""

    def __init__(
        self, on_failure: Callable[[], None], options: PushOptions, bytes_total: int, workers: int
    ) -> None:
        self.cond = threading.Condition()
        self.failed: str | None = None
        self._on_failure = on_failure
        self._progress = options.progress
        self._done = (0, 0)
        self._total = (workers, bytes_total)

    def on_ack(self, stream: WorkerStream, ack: pb.BucketAck) -> None:
        with self.cond:
            self._done = (self._done[0] + 1, self._done[1] + ack.bytes_loaded)
            report = PushProgress(self._done[0], self._total[0], self._done[1], self._total[1])
            self.cond.notify_all()
        if self._progress is not None:
            self._progress(report)

    def on_stream_end(self, stream: WorkerStream) -> None:
        first = False
        with self.cond:
            if stream.result is None and self.failed is None:
                self.failed = stream.address
                first = True
            self.cond.notify_all()
        if first:
            self._on_failure()  # no member may wait for bytes that will not come


def _slices_bucket(
    address: str, formed: FormedSources, plan: TransferPlan, manifest: ShardManifest
) -> pb.PushWeightsRequest:
    """The bucket of ``address``'s part of ``plan``: the same message every update with the same
    plan and group (so the worker finds it checked already)."""
    request = pb.PushWeightsRequest()
    payload = request.bucket.payloads.add()
    payload.device.CopyFrom(manifest.device.to_proto())
    h = payload.transfer_group
    h.group_id = formed.group_id
    h.mode = pb.TRANSFER_MODE_SLICES
    h.plan_fingerprint = plan.fingerprint
    h.max_message_bytes = DEFAULT_MAX_MESSAGE_BYTES
    size = 0
    for t in plan.for_worker(address):
        s = h.slices.add(tensor=t.tensor, source_rank=t.source)
        s.start.extend(a for a, _ in t.box)
        s.stop.extend(b for _, b in t.box)
        size += t.nbytes
    payload.size_bytes = size
    return request


class _SliceUpdate:
    def __init__(
        self,
        link: SourcesLink,
        connections: Connections,
        read_manifests: Callable[[], tuple[dict[str, ShardManifest], dict[str, str]]],
        options: PushOptions,
        ranks: RankGroup,
    ) -> None:
        self.link = link
        self.connections = connections
        self._read_manifests = read_manifests
        self.manifests: dict[str, ShardManifest] = {}
        self.fingerprints: dict[str, str] = {}
        self.options = options
        self.ranks = ranks
        # The group id every rank still holds for these workers ("" : none), said with the plan.
        self.groups_held: list[str] = []

    def plan(
        self, items: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[TransferPlan, dict[str, torch.Tensor], dict[str, Box]]:
        opts = self.options
        local_error: Exception | None = None
        plan: TransferPlan | None = None
        local: dict[str, torch.Tensor] = {}
        boxes: dict[str, Box] = {}
        group_held = ""
        try:
            self.link.check_backend()
            self.manifests, self.fingerprints = self._read_manifests()
            unable = sorted(m.worker_id or a for a, m in self.manifests.items() if not m.receives_slices)
            if unable:
                raise PlanError(
                    Reason.TRANSPORT_UNAVAILABLE,
                    f"worker(s) {', '.join(unable[:8])} do not receive slices (their manifests say receives_slices "
                    "false: an older weightwire, or an engine adapter that does not expose the tensors it keeps); a "
                    "multi-rank push over a transfer group needs every worker to",
                )
            key = (
                _layout_key(items),
                opts.scope,
                opts.allow_unowned,
                str(opts.cast_to),
                tuple(sorted(self.fingerprints.items())),
            )
            planned = self.link.plans.get(key)
            if planned is None:
                specs = [spec_of(n, t, opts.cast_to) for n, t in items]
                unknown = set(
                    planning.check_update(
                        specs, self.manifests, scope=opts.scope, allow_unowned=opts.allow_unowned
                    )
                )
                held = holdings_of(
                    [(n, t) for n, t in items if n not in unknown], self.ranks.group, opts.cast_to
                )
                planned = (unknown, held, plan_transfers(held, self.manifests))
                self.link.remember_plan(key, planned)
            unknown, held, plan = planned
            local, boxes = local_parts(
                [(n, t) for n, t in items if n not in unknown],
                held,
                self.ranks.rank,
                opts.cast_to,
                self.link.device,
            )
            group_held = self.link.held_group(self.manifests)
        except Exception as e:
            local_error = e
        said = self.ranks.exchange(
            json.dumps(
                {
                    "fp": plan.fingerprint if plan is not None else "",
                    "group": group_held,
                    "update": [opts.version, int(opts.scope), opts.update_id, str(opts.cast_to)],
                    "error": RankFailure.of(local_error).to_json() if local_error else None,
                }
            ).encode(),
            "the update's transfer plan",
        )
        records = [json.loads(raw) for raw in said]
        for r, rec in enumerate(records):
            if rec["error"] is not None:
                if local_error is not None:
                    raise local_error
                raise peer_failed(r, rec["error"], before_sending=True)
        if len({json.dumps(rec["update"]) for rec in records}) > 1:
            raise PlanError(
                Reason.TRAINER_RANKS_DISAGREE,
                "the trainer ranks push different updates (version, scope, update id, cast_to): "
                + "; ".join(f"rank {r}: {rec['update']}" for r, rec in enumerate(records)),
            )
        if len({rec["fp"] for rec in records}) > 1:
            raise PlanError(
                Reason.TRAINER_RANKS_DISAGREE,
                "the trainer ranks planned different transfers (fingerprints "
                + ", ".join(f"rank {r}: {rec['fp'][:12]}" for r, rec in enumerate(records))
                + "); every rank must push the same tensors, shapes and dtypes",
            )
        assert plan is not None
        self.groups_held = [str(rec["group"]) for rec in records]
        return plan, local, boxes

    def run(self, items: Sequence[tuple[str, torch.Tensor]]) -> dict[str, PushResult]:
        plan, local, boxes = self.plan(items)
        formed = self.link.ensure(self.ranks, self.manifests, self.groups_held)
        owner = _Streams(
            lambda: self.link.teardown("a worker failed the update"),
            self.options,
            sum(plan.bytes_to().values()),
            len(self.manifests),
        )
        streams = self._open(owner, formed, plan) if self.ranks.rank == 0 else {}
        deadline = time.monotonic() + self.link.timeout_s
        sent_error = self._send(formed, plan, local, boxes)
        ok = sent_error is None and (self.ranks.rank != 0 or _all_acked(owner, streams, deadline))
        if not ok:
            self.link.teardown("the update failed")
        verdicts = self.ranks.step(
            ok, (sent_error.message[:2000] if sent_error else "").encode(), "the sends' outcome"
        )
        everyone_ok = all(flag for flag, _ in verdicts)
        why = next(
            (
                f"trainer rank {r} failed: {msg.decode(errors='replace')}"
                for r, (flag, msg) in enumerate(verdicts)
                if not flag and r != 0
            ),
            None,
        )
        outcome = RankResults({}, {})
        if self.ranks.rank == 0:
            outcome = self._finish(
                streams, owner, everyone_ok, deadline, why or (sent_error.message if sent_error else None)
            )
        shared = rank_records.exchange(self.ranks, outcome, "the update's results")[0]
        if shared.failures or not everyone_ok:
            self.link.teardown("the update failed")
            raise PushError(shared.failures, shared.results)
        return shared.results

    def _open(self, owner: _Streams, formed: FormedSources, plan: TransferPlan) -> dict[str, WorkerStream]:
        """Rank 0: every worker's stream, its header and its slices bucket on the way."""
        streams: dict[str, WorkerStream] = {}
        for a, m in self.manifests.items():
            s = WorkerStream(owner, self.connections, a, self.options.header(self.fingerprints[a]))
            streams[a] = s
            s.start()
            s.send_header()
            key = (formed.group_id, plan.fingerprint, a)
            request = self.link.buckets.get(key)
            if request is None:
                request = _slices_bucket(a, formed, plan, m)
                self.link.remember_bucket(key, request)
            s.send_bucket(0, request)
            s.ensure_reader()
        return streams

    def _send(
        self, formed: FormedSources, plan: TransferPlan, local: dict[str, torch.Tensor], boxes: dict[str, Box]
    ) -> WeightwireError | None:
        """This rank's part: the plan compared over the group, then its sends; the error, if any."""
        me = self.ranks.rank
        try:
            group = formed.group
            pg = group.process_group()
            agree(pg, plan, group.rank, group.world_size, self.link.timeout_s)
            send_slices(
                pg,
                plan,
                formed.ranks,
                me,
                local,
                boxes,
                timeout_s=self.link.timeout_s,
                max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
                staging=self.link.staging,
            )
        except WeightwireError as err:
            return err
        except Exception as e:
            return WeightwireError(Reason.TRANSFER_FAILED, f"trainer rank {me}: sending failed: {e!r}")
        return None

    def _finish(
        self,
        streams: dict[str, WorkerStream],
        owner: _Streams,
        commit: bool,
        deadline: float,
        why: str | None,
    ) -> RankResults:
        """Rank 0: commit every stream (or cancel them all), then what every worker answered."""
        for s in streams.values():
            if commit:
                s.commit()
            else:
                s.cancel()
        for s in streams.values():
            s.done.wait(max(0.0, deadline - time.monotonic()) + _GROUP_GRACE_S)
        if not commit:
            # A worker's own refusal (MANIFEST_CHANGED after a restart, GROUP_NOT_JOINED after it
            # joined another group) can be overtaken by the cancel: ask each what it recorded.
            settle_cancelled(streams.values(), self.connections.metadata, deadline + _GROUP_GRACE_S)
        if self.options.metrics is not None:
            self.options.metrics.record_session(
                streams, self.manifests, version=self.options.version, started_at=self.options.started_at
            )
        try:
            results = collect_results(
                streams,
                self.manifests,
                timeout_s=self.link.timeout_s,
                committed=commit,
                deadline_hit=time.monotonic() >= deadline,
                first_failure=owner.failed,
                cancelled_because=why,
            )
        except PushError as e:
            return RankResults(
                {a: r for a, r in e.results.items() if isinstance(r, PushResult)}, dict(e.failures)
            )
        if not commit:
            return RankResults(
                results, {"trainer rank 0": WeightwireError(Reason.TRAINER_RANK_FAILED, why or "")}
            )
        return RankResults(results, {})


def _all_acked(owner: _Streams, streams: Mapping[str, WorkerStream], deadline: float) -> bool:
    """Rank 0: whether every worker acked its bucket before the deadline and before any failed."""
    with owner.cond:
        while owner.failed is None and time.monotonic() < deadline:
            if all(len(s.acks) >= len(s.sent_jobs) for s in streams.values()):
                return True
            owner.cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
    return False


def push_slices(
    link: SourcesLink,
    connections: Connections,
    read_manifests: Callable[[], tuple[dict[str, ShardManifest], dict[str, str]]],
    items: Sequence[tuple[str, torch.Tensor]],
    options: PushOptions,
    *,
    group: Any,
) -> dict[str, PushResult]:
    """Run one update from this rank (every rank of ``group`` calls it with the same arguments);
    every rank returns the same results or raises the same error. ``read_manifests`` gives the
    workers' manifests and fingerprints (read inside the ranks' agreement: a rank that cannot read
    them fails every rank)."""
    ranks = RankGroup(group, link.timeout_s + _GROUP_GRACE_S)
    return _SliceUpdate(link, connections, read_manifests, options, ranks).run(items)
