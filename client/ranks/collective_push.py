"""One update pushed by every rank of a trainer together: FSDP2 (DTensor) weights, or any tensors with
``group=``, where every rank runs the same ``WeightPusher.push(...)`` line and the library decides
which rank sends what.

``WeightPusher.push`` hands the update here when its tensors are DTensors or a ``group`` is given.
Every rank then runs, in the same order (``weightwire.client.ranks.rank_agreement`` has the exchanges):

1. plan locally against every worker's manifest (names, dtypes, full shapes, FULL coverage, the
   workers' fingerprints re-checked), then ``agree``: any rank that could not plan, or any
   difference between the ranks' updates, fails the update on every rank before a byte moves;
2. one global bucket plan, the same on every rank. For each bucket, in order, every rank takes part
   in gathering its tensors' full values (``weightwire.client.inputs.dtensor_gather``); the ranks that pack
   the bucket write them straight into a staging buffer, then all ranks exchange a flag (and, in the
   gathered routing, their exported payload) and stop together at the first bucket anyone is not
   fine with;
3. ``routing="own_device"``: each worker gets its buckets from the rank on its own device (the
   lowest such rank), over that rank's own streams. ``routing="gathered"``: the sending rank streams
   every bucket to every worker, carrying one payload per device the bucket's workers are on, each
   exported by the rank on that device;
4. before any commit, the ranks exchange whether every worker they stream to acked every bucket:
   all commit only when all did, otherwise every rank cancels its streams (no worker commits a
   version another worker failed); then the ranks exchange their results and failures, so every rank
   returns the same results or raises the same ``PushError``.

Memory on each rank stays bounded by the staging buffers (``pipeline_depth`` x the bucket size) plus
one tensor's full value; the model is never gathered at once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from weightwire.client.inputs import plan as planning
from weightwire.client.inputs.dtensor_gather import (
    CastTo,
    FullTensorWriter,
    RankLostError,
    is_dtensor,
    source_device,
    spec_of,
)
from weightwire.client.inputs.plan import PlanError, TensorSpec
from weightwire.client.inputs.types import PushResult
from weightwire.client.ranks import rank_records
from weightwire.client.ranks.peer_payloads import encode_payload, gathered_route
from weightwire.client.ranks.rank_agreement import (
    RankGroup,
    UpdateDigest,
    disagreement,
    peer_failed,
    rank_for_device,
    unplaced_workers,
)
from weightwire.client.ranks.rank_outcome import abort_reason, merged_results, own_outcome
from weightwire.client.ranks.rank_records import PlanRecord, RankFailure, RankResults
from weightwire.client.transports import exporter as exp
from weightwire.client.transports.route import ExportedRoute, Job, Route
from weightwire.client.update.jobs import Jobs
from weightwire.client.update.routing import check_transport_limit
from weightwire.client.update.session import GateProblem, SessionProblem
from weightwire.client.update.staging import (
    StagingPool,
    Stopped,
    export_staged,
)
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import PushError, Reason, WeightwireError
from weightwire.core.manifest import ShardManifest

if TYPE_CHECKING:
    from weightwire.client.ranks.pusher_seam import PusherSeam
    from weightwire.client.update.options import PushOptions
    from weightwire.client.update.setup import PushSetup

Routing = Literal["own_device", "gathered"]
ROUTINGS: tuple[str, ...] = ("own_device", "gathered")
# Room for every rank's collectives around a session whose own deadline is the pusher's timeout.
_GROUP_GRACE_S = 5.0


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """One bucket of the global plan: its specs (offsets in the bucket), the tensors behind them,
    its size and every worker that owns something in it."""

    specs: tuple[TensorSpec, ...]
    tensors: tuple[torch.Tensor, ...]
    size_bytes: int
    recipients: tuple[str, ...]


def _layout_text(t: torch.Tensor) -> str:
    """How a tensor is laid out across ranks: every rank must hold it the same way, or the gathers
    would not line up."""
    if not is_dtensor(t):
        return "local"
    mesh = t.device_mesh  # type: ignore[attr-defined]
    return f"{tuple(mesh.shape)}:{','.join(repr(p) for p in t.placements)}"  # type: ignore[attr-defined]


class _RankedUpdate:
    """One multi-rank update as seen from this rank (built and run once by ``push_from_ranks``)."""

    def __init__(
        self,
        driver: PusherSeam,
        items: list[tuple[str, torch.Tensor]],
        options: PushOptions,
        *,
        group: Any,
        routing: str,
        sender_rank: int,
    ) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {routing!r}")
        self.driver = driver
        self.items = items
        self.options = options
        self.routing = routing
        self.sender_rank = int(sender_rank)
        self.cast_to: CastTo = options.cast_to
        self.ranks = RankGroup(group, driver.timeout_s + _GROUP_GRACE_S)
        if not 0 <= self.sender_rank < self.ranks.size:
            raise ValueError(f"sender_rank={sender_rank} is not a rank of a group of {self.ranks.size}")
        self.me = self.ranks.rank
        self.writer = FullTensorWriter(driver.timeout_s + _GROUP_GRACE_S)
        self.depth = max(2, driver.pipeline_depth)
        # Lockstep state: the next bucket every rank gathers, whether everyone stopped early, and why
        # this rank is not fine (a local error, or its session failed).
        self.next_bucket = 0
        self.stopped_all = False
        self.stopped_by: str | None = None
        self.problem: str | None = None
        self.outcome_sent = False
        self.abort_reason: str | None = None
        # Sender (gathered): set when a bucket's staging was released, i.e. every recipient acked it.
        self.acked: dict[int, threading.Event] = {}
        # Exporting non-sender (gathered): staging buffers per bucket until the sender says they are acked.
        self.in_flight: dict[int, tuple[StagingPool, exp.StagingBuffer]] = {}

    # ---------------------------------------------------------------- 1. plan and agree

    def run(self) -> dict[str, PushResult]:
        driver, opts = self.driver, self.options
        local_error: Exception | None = None
        specs: list[TensorSpec] = []
        manifests: dict[str, ShardManifest] = {}
        exporter: exp.Exporter | None = None
        unknown: set[str] = set()
        setup: PushSetup | None = None
        try:
            specs = [spec_of(name, t, self.cast_to) for name, t in self.items]
            source = source_device(self.items)
            setup, exporter = self.driver.prepare(source, opts)
            manifests = setup.manifests
            unknown = set(
                planning.check_update(specs, manifests, scope=opts.scope, allow_unowned=opts.allow_unowned)
            )
        except Exception as e:
            local_error = e
        digest = None
        if local_error is None:
            assert exporter is not None
            digest = UpdateDigest.of(
                version=opts.version,
                scope=str(opts.scope),
                routing=self.routing,
                sender_rank=self.sender_rank,
                specs=specs,
                layouts=[_layout_text(t) for _, t in self.items],
                endpoints=driver.endpoints,
                fingerprints=self.driver.fingerprints,
                settings={
                    "bucket": driver.bucket_size_bytes,
                    "align": driver.align_bytes,
                    "depth": self.depth,
                    "transport": exporter.name,
                    "allow_unowned": opts.allow_unowned,
                    "verify": opts.verify_checksums,
                    "update_id": opts.update_id,
                    "cast_to": str(self.cast_to),
                },
            )
        own = PlanRecord(
            digest,
            exporter.label if exporter is not None else None,
            RankFailure.of(local_error) if local_error is not None else None,
        )
        records = rank_records.exchange(self.ranks, own, "the update's plan")
        failed = [
            (r, rec.error) for r, rec in enumerate(records) if rec.error is not None or rec.digest is None
        ]
        if failed:
            if local_error is not None:
                raise local_error
            r, error = failed[0]
            raise peer_failed(
                r, (error or RankFailure("INTERNAL", "INTERNAL", "no plan")).to_json(), before_sending=True
            )
        message = disagreement(rank_records.digests(records))
        if message:
            raise PlanError(Reason.TRAINER_RANKS_DISAGREE, message)
        assert exporter is not None and setup is not None
        labels = [rec.label for rec in records]
        items = self.items
        if len({rec.digest.names_in_order for rec in records if rec.digest is not None}) > 1:
            # The same tensors in another order on some rank: everyone takes them sorted by name.
            order = sorted(range(len(items)), key=lambda i: items[i][0])
            items = [items[i] for i in order]
            specs = [specs[i] for i in order]
        return self._push(setup, manifests, exporter, labels, items, specs, unknown)

    # ---------------------------------------------------------------- 2. the global plan

    def _push(
        self,
        setup: PushSetup,
        manifests: dict[str, ShardManifest],
        exporter: exp.Exporter,
        labels: list[DeviceRef | None],
        items: list[tuple[str, torch.Tensor]],
        specs: list[TensorSpec],
        unknown: set[str],
    ) -> dict[str, PushResult]:
        # Everything up to the first collective below is computed from what every rank agreed on, so
        # a refusal here happens on every rank alike.
        driver = self.driver
        missing = unplaced_workers(manifests, labels, self.routing)
        if missing:
            raise PlanError(Reason.NO_PAYLOAD_FOR_DEVICE, missing)
        bucket_bytes = driver.bucket_size_bytes
        if exporter.bucket_bytes_limit is not None:
            bucket_bytes = min(bucket_bytes, exporter.bucket_bytes_limit)
        kept = [(s, t) for s, (_, t) in zip(specs, items, strict=True) if s.name not in unknown]
        plans = planning.plan_buckets(
            [s for s, _ in kept],
            planning.owners_by_name(manifests),
            bucket_bytes=bucket_bytes,
            align_bytes=driver.align_bytes,
        )
        check_transport_limit(exporter, [p.size_bytes for p in plans])
        self.buckets = [
            _Bucket(p.specs, tuple(kept[i][1] for i in p.items), p.size_bytes, p.recipients) for p in plans
        ]
        self.manifests = manifests
        self.labels = labels
        self.exporter = exporter
        self.pool = self.driver.staging_pool(exporter, bucket_bytes)
        if self.routing == "own_device":
            owner = {a: rank_for_device(m.device, labels) for a, m in manifests.items()}
            mine = [a for a in manifests if owner[a] == self.me]
        else:
            mine = list(manifests) if self.me == self.sender_rank else []
        # Which ranks export each bucket: every rank in own_device (each for its own workers); in
        # gathered, one rank per device the bucket's workers are on (the sender where it fits).
        self.exporters: list[set[int]] = []
        for b in self.buckets:
            if self.routing == "own_device":
                self.exporters.append({owner[a] for a in b.recipients if owner[a] is not None})  # type: ignore[misc]
            else:
                self.exporters.append(
                    {
                        r
                        for a in b.recipients
                        if (r := rank_for_device(manifests[a].device, labels, self.sender_rank)) is not None
                    }
                )
        mine_set = set(mine)

        local_results: dict[str, PushResult] = {}
        local_failures: dict[str, WeightwireError] = {}
        try:
            if mine:
                jobs = []
                for g, b in enumerate(self.buckets):
                    recipients = tuple(a for a in b.recipients if a in mine_set)
                    if recipients:
                        jobs.append(Job(list(b.specs), recipients, b.size_bytes, self._job(g)))
                local_results = self.driver.run(
                    setup, mine, Jobs(jobs, [self.pool]), self.options, self._gate
                )
            else:
                self._finish_lockstep()
                self._exchange_outcome(ok=self.problem is None and not self.stopped_all)
        except RankLostError:
            self._drop_in_flight()
            raise
        except PushError as e:
            if not self.outcome_sent:
                self.problem = self.problem or f"rank {self.me}: {e}"
            local_failures = dict(e.failures)
            local_results = {a: r for a, r in e.results.items() if isinstance(r, PushResult)}
        except Exception as e:
            self.problem = self.problem or f"rank {self.me}: {type(e).__name__}: {e}"
            local_failures = {f"trainer rank {self.me}": _as_error(e)}
        if not self.outcome_sent:
            # The session never reached its commit gate (it failed while setting up, or raised).
            self._finish_lockstep()
            self._exchange_outcome(ok=False)
        self._drop_in_flight(reuse=self.abort_reason is None)
        return self._merge(local_results, local_failures)

    # ---------------------------------------------------------------- per bucket, on every rank

    def _job(self, g: int) -> Callable[[Callable[[], bool], float], Route]:
        def prepare(stopped: Callable[[], bool], deadline: float) -> Route:
            self._advance(g)
            prepared = None if self.stopped_all else self._bucket_step(g, stopped, deadline)
            if prepared is None:  # every rank stops at this bucket
                raise Stopped
            return prepared

        return prepare

    def _advance(self, until: int) -> None:
        """Take part in every bucket before ``until`` that this rank does not stream itself."""
        while self.next_bucket < until and not self.stopped_all:
            self._bucket_step(self.next_bucket, lambda: False, time.monotonic() + self.driver.timeout_s)

    def _finish_lockstep(self) -> None:
        self._advance(len(self.buckets))

    def _bucket_step(self, g: int, stopped: Callable[[], bool], deadline: float) -> ExportedRoute | None:  # noqa: C901 - known; split when next changed
        """Bucket ``g`` on this rank: gather (and pack, if this rank exports it), then the exchange
        that tells every rank whether to go on. Returns what this rank streams, if it streams ``g``."""
        b = self.buckets[g]
        self.next_bucket = g + 1
        exports = self.me in self.exporters[g] and self.problem is None
        buf: exp.StagingBuffer | None = None
        if exports:
            try:
                buf = self.pool.acquire(b.size_bytes, stopped, deadline)
            except Stopped:
                self.problem = self.problem or "its own update failed (see its workers' errors)"
            except Exception as e:
                self.problem = f"no staging buffer for bucket {g}: {type(e).__name__}: {e}"
        try:
            self._fill(b, buf)
        except RankLostError:
            if buf is not None:
                self.pool.discard(buf)
            raise
        payload = b""
        prepared: ExportedRoute | None = None
        sender = self.routing == "gathered" and self.me == self.sender_rank
        if buf is not None and self.problem is None:
            try:
                if self.routing == "gathered" and not sender:
                    payload = encode_payload(self.exporter, buf, b.size_bytes, self.options.verify_checksums)
                else:
                    prepared = export_staged(
                        self.exporter,
                        buf,
                        b.size_bytes,
                        self.options.verify_checksums,
                        self._releaser(g, buf),
                    )
            except Exception as e:
                self.problem = f"exporting bucket {g} failed: {type(e).__name__}: {e}"
        if sender:
            self._wait_acked(g - self.depth + 1, stopped, deadline)
        if stopped():
            self.problem = self.problem or "its own update failed (see its workers' errors)"
        steps = self.ranks.step(self.problem is None, payload, f"bucket {g}")
        not_fine = [r for r, (ok, _) in enumerate(steps) if not ok]
        if not_fine:
            self.stopped_all = True
            self.stopped_by = f"trainer rank {not_fine[0]}"
        if self.routing == "gathered" and not sender:
            if buf is not None:
                if not_fine or self.problem is not None:
                    self.pool.discard(buf)
                else:
                    self.in_flight[g] = (self.pool, buf)
            # The sender waited for this bucket - (depth - 1) to be acked before this exchange.
            for old in [k for k in self.in_flight if k <= g - self.depth + 1]:
                pool, old_buf = self.in_flight.pop(old)
                pool.release(old_buf)
        elif buf is not None and (prepared is None or not_fine):
            if prepared is not None:
                prepared.release(False)
            else:
                self.pool.discard(buf)
            prepared = None
        if not_fine:
            return None
        if sender:
            event = self.acked.setdefault(g, threading.Event())
            peers = self.exporters[g] - {self.me}
            return gathered_route(g, prepared, peers, steps, self.labels, lambda ok: event.set())
        return prepared

    def _fill(self, b: _Bucket, buf: exp.StagingBuffer | None) -> None:
        """Every tensor of ``b`` gathered, and written into ``buf`` when given. A local failure stops
        the writing, never the taking part (the other ranks are in the same gathers)."""
        for spec, t in zip(b.specs, b.tensors, strict=True):
            dst = None
            if buf is not None and self.problem is None and spec.nbytes:
                dst = buf.tensor().narrow(0, spec.offset_bytes, spec.nbytes).view(spec.dtype).view(spec.shape)
            try:
                self.writer.write(spec.name, t, dst)
            except RankLostError:
                raise
            except Exception as e:
                self.problem = self.problem or f"writing {spec.name} failed: {type(e).__name__}: {e}"
                if is_dtensor(t) and dst is not None:
                    self.writer.write(spec.name, t, None)  # still take part in this tensor's gather

    def _releaser(self, g: int, buf: exp.StagingBuffer) -> Callable[[bool], None]:
        event = self.acked.setdefault(g, threading.Event())

        def release(ok: bool) -> None:
            if ok:
                self.pool.release(buf)
            else:
                self.pool.discard(buf)
            event.set()

        return release

    def _wait_acked(self, g: int, stopped: Callable[[], bool], deadline: float) -> None:
        """Sender: wait until bucket ``g`` was acked by all its workers (then every exporting rank may
        reuse the buffer it held for it)."""
        if g < 0:
            return
        event = self.acked.setdefault(g, threading.Event())
        while not event.wait(0.05):
            if stopped() or time.monotonic() >= deadline:
                self.problem = self.problem or f"bucket {g} was not acked before the deadline"
                return

    def _drop_in_flight(self, reuse: bool = False) -> None:
        for pool, buf in self.in_flight.values():
            if reuse:
                pool.release(buf)
            else:
                pool.discard(buf)  # a cancelled worker might still read it
        self.in_flight.clear()

    # ---------------------------------------------------------------- 3. commit on all or none

    def _gate(self, problem: SessionProblem | None) -> str | None:
        """Called by this rank's session once its workers acked everything (``problem`` None) or with
        what went wrong there: None to commit, else why every rank aborts."""
        # A session stopped early because every rank stopped at a bucket has no problem of its own.
        if problem is not None and not (self.stopped_all and problem.kind is GateProblem.STOPPED_EARLY):
            self.problem = self.problem or problem.message
        self._finish_lockstep()
        return self._exchange_outcome(ok=problem is None and self.problem is None and not self.stopped_all)

    def _exchange_outcome(self, ok: bool) -> str | None:
        self.outcome_sent = True
        own = own_outcome(ok, self.problem, self.stopped_by if self.stopped_all else None)
        self.abort_reason = abort_reason(rank_records.exchange(self.ranks, own, "every rank's outcome"))
        return self.abort_reason

    def _merge(
        self, results: dict[str, PushResult], failures: dict[str, WeightwireError]
    ) -> dict[str, PushResult]:
        records = rank_records.exchange(self.ranks, RankResults(results, failures), "every rank's results")
        return merged_results(records, self.abort_reason, self.me, self.driver.endpoints)


def _as_error(e: Exception) -> WeightwireError:
    if isinstance(e, WeightwireError):
        return e
    return WeightwireError(Reason.INTERNAL, f"{type(e).__name__}: {e}")


def push_from_ranks(
    driver: PusherSeam,
    items: list[tuple[str, torch.Tensor]],
    options: PushOptions,
    *,
    group: Any,
    routing: str,
    sender_rank: int,
) -> dict[str, PushResult]:
    """Run one multi-rank update from this rank (every rank of ``group`` calls it with the same
    arguments); every rank returns the same results or raises the same error."""
    return _RankedUpdate(driver, items, options, group=group, routing=routing, sender_rank=sender_rank).run()


__all__ = ["ROUTINGS", "Routing", "push_from_ranks"]
