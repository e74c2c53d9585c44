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
3. rank 0 runs the update's ``UpdateSession`` (``weightwire.client.update.session``) over every
   worker, its part of the plan split into buckets of at most the pusher's bucket size, each a
   slices payload (``weightwire.client.ranks.slice_buckets``); once the last is queued, the
   route starts this rank's sends, and every other rank starts its own; every member compares the
   plan's fingerprint over the group (at most once per update, and only for a plan the group has
   not agreed on before: ``transfer_group_agreement``), then every rank sends what the plan gives
   it (``send_slices``), bucket by bucket, while every worker receives one bucket at a time and
   holds it until the commit;
4. the ranks exchange whether their sends ended well: on rank 0 that exchange is the session's
   commit gate, so the session commits on every worker only when every rank's sends did and every
   worker acked its bucket, and cancels every stream otherwise (what failed tears this side of the
   group down first, so that no member waits for bytes that will not come);
5. rank 0's results (or failures, with blame) go to every rank: every rank returns the same results
   or raises the same ``PushError``. A failed update tears the group down on every member; the next
   push forms a new one.

With ``delta=True`` (``weightwire.client.ranks.slice_deltas``) each rank prepares its part once the
plan is agreed (step 1): a delta's buckets carry every region's ``TensorDelta`` and each rank sends
its streams of encodings (``send_streams``) in place of its regions' bytes in step 3.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from weightwire.client.inputs import plan as planning
from weightwire.client.inputs.dtensor_gather import RankLostError, spec_of
from weightwire.client.inputs.plan import PlanError
from weightwire.client.inputs.types import PushResult
from weightwire.client.ranks import rank_records
from weightwire.client.ranks.rank_agreement import RankGroup, peer_failed
from weightwire.client.ranks.rank_holdings import holdings_of, layout_key, local_parts
from weightwire.client.ranks.rank_records import RankFailure, RankResults, SlicesPlanRecord
from weightwire.client.ranks.rank_sends import RankSends, let_go
from weightwire.client.ranks.slice_buckets import slice_jobs, split_for
from weightwire.client.ranks.transfer_group_sources import FormedSources, SourcesLink
from weightwire.client.rpc.stream import Connections
from weightwire.client.update.session import GateProblem, SessionProblem, SpecTemplates, UpdateSession
from weightwire.core.errors import PushError, Reason, WeightwireError, without_frames
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.transfer_group_agreement import agree
from weightwire.core.transports.transfer_group_slice_deltas import send_streams
from weightwire.core.transports.transfer_group_slices import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Buckets,
    send_slices,
)
from weightwire.core.transports.transfer_plan import (
    Box,
    TransferPlan,
    plan_transfers,
)

if TYPE_CHECKING:
    from weightwire.client.ranks.slice_deltas import SliceDeltas
    from weightwire.client.update.options import PushOptions

__all__ = ["push_slices"]

# The trainer's own exchanges wait this much longer than one transfer, or rank 0's session over
# the workers' streams, may take.
_GROUP_GRACE_S = 30.0


class _SliceUpdate:
    def __init__(
        self,
        link: SourcesLink,
        connections: Connections,
        read_manifests: Callable[[], tuple[dict[str, ShardManifest], dict[str, str]]],
        options: PushOptions,
        ranks: RankGroup,
        deltas: SliceDeltas | None = None,
        bucket_bytes: int = planning.DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.link = link
        # What bounds a bucket (``slice_buckets.split_buckets``): the pusher's bucket size, the same on every rank.
        self.bucket_bytes = bucket_bytes
        # A push asked for as a delta (``slice_deltas``): what this rank records or sends of it.
        self.deltas = deltas
        self.connections = connections
        self._read_manifests = read_manifests
        self.manifests: dict[str, ShardManifest] = {}
        self.fingerprints: dict[str, str] = {}
        self.options = options
        self.ranks = ranks
        # The group id every rank still holds for these workers ("" : none), said with the plan.
        self.groups_held: list[str] = []
        # Whether every rank said its sends ended well (the outcome exchange).
        self.everyone_ok = False
        # Why rank 0's outcome exchange failed (a rank was lost), kept for the error it raises.
        self.lost: RankLostError | None = None
        # The group this update runs on, and which of its updates this is (``call_off``).
        self.formed: FormedSources | None = None
        self.update_index = 0

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
                layout_key(items),
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
        records = rank_records.exchange(
            self.ranks,
            SlicesPlanRecord(
                plan.fingerprint if plan is not None else "",
                group_held,
                int(opts.version),
                int(opts.scope),
                str(opts.update_id),
                str(opts.cast_to),
                RankFailure.of(local_error) if local_error else None,
                self.bucket_bytes,
            ),
            "the update's transfer plan",
        )
        for r, rec in enumerate(records):
            if rec.error is not None:
                if local_error is not None:
                    raise local_error
                raise peer_failed(r, rec.error.to_json(), before_sending=True)
        if len({json.dumps(rec.update) for rec in records}) > 1:
            raise PlanError(
                Reason.TRAINER_RANKS_DISAGREE,
                "the trainer ranks push different updates (version, scope, update id, cast_to, bucket size): "
                + "; ".join(f"rank {r}: {rec.update}" for r, rec in enumerate(records)),
            )
        if len({rec.fingerprint for rec in records}) > 1:
            raise PlanError(
                Reason.TRAINER_RANKS_DISAGREE,
                "the trainer ranks planned different transfers (fingerprints "
                + ", ".join(f"rank {r}: {rec.fingerprint[:12]}" for r, rec in enumerate(records))
                + "); every rank must push the same tensors, shapes and dtypes",
            )
        assert plan is not None
        self.groups_held = [rec.group for rec in records]
        return plan, local, boxes

    def run(self, items: Sequence[tuple[str, torch.Tensor]]) -> dict[str, PushResult]:
        plan, local, boxes = self.plan(items)
        if self.deltas is not None:
            self.deltas.prepare(self.ranks, plan, local, boxes, self.link.device)
        formed = self.link.ensure(self.ranks, self.manifests, self.groups_held)
        formed.updates += 1
        self.formed, self.update_index = formed, formed.updates
        # A delta update goes as one bucket per worker (none given: ``send_streams`` sends each
        # worker one stream).
        delta = self.deltas is not None and self.deltas.is_delta
        buckets = () if delta else split_for(self.link, plan, list(self.manifests), self.bucket_bytes)
        sends = RankSends(lambda stopped: self.send(formed, plan, local, boxes, buckets, stopped))
        if self.ranks.rank == 0:
            outcome = self._streamed(formed, plan, sends, buckets)
        else:
            sends.start()
            self._outcome(None, sends)
            outcome = RankResults({}, {})
        try:
            shared = rank_records.exchange(self.ranks, outcome, "the update's results")[0]
        except RankLostError as e:
            self.link.teardown("a trainer rank was lost")
            if self.ranks.rank != 0:
                raise
            raise _rank_lost(self.lost or e, outcome) from None
        if shared.failures or not self.everyone_ok:
            self.link.teardown("the update failed")
            raise PushError(shared.failures, shared.results)
        return shared.results

    def _streamed(
        self, formed: FormedSources, plan: TransferPlan, sends: RankSends, buckets: Buckets
    ) -> RankResults:
        """Rank 0: one ``UpdateSession`` over every worker, its part of the plan in the buckets
        ``buckets`` gives it (the workers' first buckets first, then their second ...), committed
        only when the ranks' outcome exchange (its commit gate) says every rank sent well."""
        deltas = self.deltas if self.deltas is not None and self.deltas.is_delta else None
        jobs = slice_jobs(
            self.link, formed, plan, self.manifests, buckets, self.bucket_bytes, deltas, sends.start
        )
        session = UpdateSession(
            jobs,
            self.manifests,
            self.options,
            self.connections,
            self.fingerprints,
            SpecTemplates(),
            (),
            commit_gate=lambda problem: self._outcome(problem, sends),
            whole_update=False,
        )
        try:
            return RankResults(session.run(), {})
        except PushError as e:
            return RankResults(
                {a: r for a, r in e.results.items() if isinstance(r, PushResult)}, dict(e.failures)
            )

    def _call_off_watch(self) -> Callable[[threading.Event], str | None] | None:
        """On a rank other than 0: what watches for rank 0 calling this update off."""
        formed, index = self.formed, self.update_index
        if self.ranks.rank == 0 or formed is None:
            return None
        return lambda ended: self.link.watch_call_off(formed, index, ended)

    def _outcome(self, problem: SessionProblem | None, sends: RankSends) -> str | None:
        """The ranks' outcome exchange, on every rank once its sends ended: rank 0's commit gate
        (``problem``: what keeps its session from committing). Rank 0 calls a failed update off
        before it waits for anything (its own sends stop, the other ranks are told through its
        store, ``SourcesLink.call_off``); the others watch for that while their sends run. Whatever
        failed here tears this side of the group down first, so that no member waits for bytes
        that will not come. Returns why the update is called off, or None when every rank sent well."""
        formed = self.formed
        if problem is not None:
            sends.stop()
            if formed is not None:
                self.link.call_off(formed, self.update_index, problem.message)
            self.link.teardown(
                "a worker failed the update"
                if problem.kind is GateProblem.WORKER_FAILED
                else "the update failed"
            )
        sent_error = sends.wait(self._call_off_watch())
        ok = problem is None and sent_error is None
        if not ok and problem is None:
            if self.ranks.rank == 0 and formed is not None and sent_error is not None:
                self.link.call_off(formed, self.update_index, sent_error.message)
            self.link.teardown("the update failed")
        try:
            verdicts = self.ranks.step(
                ok, (sent_error.message[:2000] if sent_error else "").encode(), "the sends' outcome"
            )
        except RankLostError as e:
            self.link.teardown("a trainer rank was lost")
            if self.ranks.rank != 0:
                raise
            # Rank 0's gate: the session calls the update off and collects what every worker
            # said (a worker that lost its bytes names the trainer rank it waited for).
            self.lost = e
            self.everyone_ok = False
            return e.message
        self.everyone_ok = all(flag for flag, _ in verdicts)
        if self.everyone_ok:
            return None
        why = next(
            (
                f"trainer rank {r} failed: {msg.decode(errors='replace')}"
                for r, (flag, msg) in enumerate(verdicts)
                if not flag and r != 0
            ),
            None,
        )
        return why or (sent_error.message if sent_error else None) or (problem.message if problem else None)

    def send(
        self,
        formed: FormedSources,
        plan: TransferPlan,
        local: dict[str, torch.Tensor],
        boxes: dict[str, Box],
        buckets: Buckets,
        stopped: Callable[[], bool] | None = None,
    ) -> WeightwireError | None:
        """This rank's part: the plan compared over the group (CANCELLED once ``stopped()``), then
        its sends; the error, if any. The process group is never held by this frame itself: after
        a failure it is let go on a thread of its own (``rank_sends.let_go``)."""
        me = self.ranks.rank
        held: list[Any] = []
        error: WeightwireError | None = None
        try:
            held.append(formed.group.process_group())
            self._send_on(held[0], formed, plan, local, boxes, buckets, stopped)
        except WeightwireError as err:
            error = without_frames(err)
        except Exception as e:
            error = WeightwireError(Reason.TRANSFER_FAILED, f"trainer rank {me}: sending failed: {e!r}")
        if error is not None:
            let_go(held)
        return error

    def _send_on(
        self,
        pg: Any,
        formed: FormedSources,
        plan: TransferPlan,
        local: dict[str, torch.Tensor],
        boxes: dict[str, Box],
        buckets: Buckets,
        stopped: Callable[[], bool] | None,
    ) -> None:
        me = self.ranks.rank
        group = formed.group
        delta = self.deltas if self.deltas is not None and self.deltas.is_delta else None
        # A delta's workers compare on every update (``transfer_group_slice_deltas``): so do the
        # ranks then, and only the other updates count towards the group's agreed plans.
        agree(
            pg,
            plan,
            group.rank,
            group.world_size,
            self.link.timeout_s,
            stopped,
            self.link.device,
            None if delta is not None else formed.agreed_plans,
        )
        if delta is not None:
            send_streams(
                pg,
                formed.ranks,
                me,
                delta.streams,
                timeout_s=self.link.timeout_s,
                max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
            )
            return
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
            buckets=buckets,
        )


def _rank_lost(lost: RankLostError, outcome: RankResults) -> RankLostError:
    """Rank 0's error for an update during which a trainer rank was lost: names the rank (those
    the workers' failed receives name, other than rank 0 itself) and carries the workers' failures
    and results, which no other rank can be told."""
    named = sorted(
        {
            int(r)
            for f in outcome.failures.values()
            if (r := f.metadata.get("trainer_rank", "")).isdigit() and r != "0"
        }
    )
    who = f"trainer rank {', '.join(map(str, named))}" if named else "a trainer rank"
    err = RankLostError(
        f"{who} was lost during the update: {lost.message}",
        **lost.metadata,
        **({"lost_ranks": ",".join(map(str, named))} if named else {}),
    )
    err.failures = dict(outcome.failures)
    err.results = dict(outcome.results)
    return err


def push_slices(
    link: SourcesLink,
    connections: Connections,
    read_manifests: Callable[[], tuple[dict[str, ShardManifest], dict[str, str]]],
    items: Sequence[tuple[str, torch.Tensor]],
    options: PushOptions,
    *,
    group: Any,
    deltas: SliceDeltas | None = None,
    bucket_bytes: int = planning.DEFAULT_BUCKET_BYTES,
) -> dict[str, PushResult]:
    """Run one update from this rank (every rank of ``group`` calls it with the same arguments);
    every rank returns the same results or raises the same error. ``read_manifests`` gives the
    workers' manifests and fingerprints (read inside the ranks' agreement: a rank that cannot read
    them fails every rank). ``deltas``: a push asked for as a delta (``slice_deltas``), prepared
    once the plan is agreed. ``bucket_bytes`` bounds each bucket a worker is sent
    (``slice_buckets.split_buckets``; a delta goes as one bucket per worker)."""
    # Rank 0's session may take up to the pusher's timeout (a worker that hangs rather than dies is
    # waited for until then, and so is the status of each worker it cancelled) while the other
    # ranks wait in the exchanges; their sends end within the group's timeout. Either may be longer.
    ranks = RankGroup(group, max(link.timeout_s, connections.timeout_s) + _GROUP_GRACE_S)
    return _SliceUpdate(link, connections, read_manifests, options, ranks, deltas, bucket_bytes).run(items)
