"""A transfer group whose every trainer rank is a member and a source: forming it from all the
trainer's ranks together, reusing it while nothing changed, tearing it down.

One ``SourcesLink`` per pusher, on every rank (``WeightPusher(..., transfer_group=...)`` with a
multi-rank ``push(..., group=...)``; ``weightwire.client.ranks.slice_push`` drives an update over
it). Forming takes the ranks together over the trainer's own process group: every rank says who it
is (an instance id), rank 0 serves the rendezvous store, plans the group (trainer ranks 0..M-1, then
the workers by identity, ``plan_group``) and sends that plan to every worker (JoinTransferGroup) and
to every rank; each rank then joins the group itself, on its own ``TransferGroupOptions.host``. Each
rank ends with the same verdict: the group, or the same ``PushError``.

During an update, rank 0 can call it off on the store it serves (``call_off``), before it waits for
anything of the other ranks; every other rank watches for that (``watch_call_off``) while its sends
run. Without it, a rank whose sends wait for workers that refused the update at its header (and so
never join the plan's comparison) would hear rank 0's verdict only at the group's timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import torch
from weightwire.client.ranks import rank_records
from weightwire.client.ranks.rank_agreement import RankGroup
from weightwire.client.ranks.rank_records import MemberRecord, RankFailure, RankResults
from weightwire.client.transports.group_forming import (
    TRAINER_KEY,
    Joining,
    identities_of,
    join_here,
    largest_tensor_bytes,
)
from weightwire.client.transports.transfer_group_link import LinkBase
from weightwire.core.errors import PushError, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.transfer_group import TransferGroup, check_backend
from weightwire.core.transports.transfer_group_agreement import AgreedPlans
from weightwire.core.transports.transfer_group_plan import MemberIdentity, check_spec, plan_group
from weightwire.core.transports.transfer_group_slices import GroupRanks
from weightwire.core.transports.transfer_group_store import StoreServer, as_timedelta, connect_store
from weightwire.core.transports.transfer_group_store_table import StoreTimeout
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["FormedSources", "SourcesLink"]

log = logging.getLogger(__name__)

# A plan of a few thousand members, exchanged between the ranks as its protobuf.
_MAX_SPEC_BYTES = 4 << 20
_MAX_PLANS = 8
_MAX_BUCKETS = 4096
# A rank watching for rank 0's call-off asks the store to wait this long at a time, so that the
# watch ends this soon after the update's sends ended well.
_WATCH_SLICE_S = 0.25
_MAX_WHY_BYTES = 2000


@dataclasses.dataclass
class FormedSources:
    """A formed group as this rank holds it."""

    spec: pb.TransferGroupSpec
    group: TransferGroup
    ranks: GroupRanks
    identities: dict[str, tuple[str, str]]  # address -> (worker id, instance id) it was planned with
    # Updates run on the group so far: the same count on every rank, so it names one update.
    updates: int = 0
    # The plan fingerprints every member compared over this group (``transfer_group_agreement``).
    agreed_plans: AgreedPlans = dataclasses.field(default_factory=AgreedPlans)
    # A rank other than 0: its own connection to rank 0's store, to watch for call-offs on.
    watch: Any = None
    watch_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def group_id(self) -> str:
        return self.spec.group_id

    def call_off_key(self, update: int) -> str:
        return f"weightwire/{self.group_id}/called-off/{update}"

    def close_watch(self) -> None:
        """Drop the watch connection; on a thread of its own, as a watch may hold it for up to
        ``_WATCH_SLICE_S``."""
        with self.watch_lock:
            conn, self.watch = self.watch, None
        if conn is not None:
            threading.Thread(target=conn.close, name="weightwire-watch-close", daemon=True).start()


class SourcesLink(LinkBase):
    """One trainer rank's side of a group of every trainer rank and the workers."""

    def _start(self) -> None:
        # Rank 0 serves the store: the pusher's (shared with its single-source link) or its own.
        self.instance_id = uuid.uuid4().hex
        self._store: StoreServer | None = None
        self._formed: FormedSources | None = None
        self.formations = 0
        # Each worker's slices bucket of recent plans (``remember_bucket``).
        self.buckets: dict[tuple[object, ...], pb.Payload] = {}
        # Message buffers of this rank's sends, reused while the plan stays the same.
        self.staging: dict[Any, torch.Tensor] = {}
        # The plans of recent updates by what they depend on (``slice_push``); planning a model of
        # hundreds of tensors takes tens of milliseconds of Python, every step alike.
        self.plans: dict[object, Any] = {}

    def check_backend(self) -> None:
        """TRANSPORT_UNAVAILABLE when the group's backend cannot run here (NCCL without a GPU)."""
        check_backend(self.options.backend_value, self.device)

    @property
    def group_id(self) -> str | None:
        return self._formed.group_id if self._formed is not None else None

    def remember_bucket(self, key: tuple[object, ...], payload: pb.Payload) -> None:
        """Keep a worker's slices bucket (by group, plan, worker and place) for the next update: the same
        message every step, built once (tens of thousands of regions on a large model)."""
        if len(self.buckets) >= _MAX_BUCKETS:
            self.buckets.pop(next(iter(self.buckets)))
        self.buckets[key] = payload

    def remember_plan(self, key: object, planned: Any) -> None:
        """Keep an update's plan (or its split into buckets) for the next push of the same layout to
        the same workers."""
        if len(self.plans) >= _MAX_PLANS:
            self.plans.pop(next(iter(self.plans)))
        self.plans[key] = planned

    def held_group(self, manifests: Mapping[str, ShardManifest]) -> str:
        """The id of the group this rank holds with exactly these workers, or "" (for ``ensure``)."""
        formed = self._formed
        if formed is None or formed.group.closed:
            return ""
        if formed.identities != identities_of(manifests):
            return ""
        return formed.group_id

    def ensure(
        self, ranks: RankGroup, manifests: Mapping[str, ShardManifest], held: list[str]
    ) -> FormedSources:
        """The group every rank holds, formed now unless every rank still holds the same one with
        exactly these workers (``held``: every rank's ``held_group``, exchanged by the caller).
        Collective: every rank of ``ranks`` calls it."""
        if held and held[0] and len(set(held)) == 1 and self._formed is not None:
            return self._formed
        self.teardown("forming a new group")
        return self._form(ranks, manifests)

    def _form(self, ranks: RankGroup, manifests: Mapping[str, ShardManifest]) -> FormedSources:
        me = ranks.rank
        mine: WeightwireError | None = None
        store_address = ""
        try:
            if me == 0 and self._store is None:
                self._store = self.store.server()
            store_address = self._store.address if self._store is not None else ""
        except WeightwireError as err:
            mine = err
        records = rank_records.exchange(
            ranks,
            MemberRecord(self.instance_id, RankFailure.of(mine) if mine else None),
            "the trainer ranks' identities",
        )
        refused = {
            f"{TRAINER_KEY} rank {r}": WeightwireError(
                rec.error.reason, rec.error.message, code=rec.error.code
            )
            for r, rec in enumerate(records)
            if rec.error is not None
        }
        if refused:  # the same on every rank: each rank's own reason
            raise PushError(refused)
        trainers = [MemberIdentity.of_trainer(r, rec.instance) for r, rec in enumerate(records)]
        identity = trainers[me]
        spec_bytes = b""
        if me == 0:
            largest = largest_tensor_bytes(manifests, default=1)
            plan = plan_group(
                manifests,
                trainers=trainers,
                group_id=f"ww-{uuid.uuid4().hex[:20]}",
                backend=self.options.backend_value,
                store_address=store_address,
                timeout_ms=int(self.timeout_s * 1000),
                max_bucket_bytes=max(largest, 1),
                broadcast=False,
            )
            spec_bytes = plan.spec.SerializeToString()
        spec = pb.TransferGroupSpec.FromString(
            ranks.exchange(spec_bytes, "the transfer group's plan", max_bytes=_MAX_SPEC_BYTES)[0]
        )
        check_spec(spec)
        joining = Joining(self._workers, manifests if me == 0 else (), spec, self.timeout_s, self._metadata)
        group, mine = join_here(
            spec, identity, self.options, self._store.store if self._store is not None else None
        )
        failures = {f"{TRAINER_KEY} rank {me}": mine} if mine is not None else {}
        failures.update(joining.failures())
        verdicts = rank_records.exchange(ranks, RankResults({}, failures), "the transfer group's forming")
        everyone = {a: err for v in verdicts for a, err in v.failures.items()}
        if everyone:
            if group is not None:
                group.close()
            if me == 0:
                self._leave_all(spec.group_id)
            raise PushError(everyone)
        assert group is not None
        members = sorted(spec.members, key=lambda m: m.group_rank)
        workers = [m.instance_id for m in members if m.role == pb.TRANSFER_ROLE_WORKER]
        by_id = {m.instance_id: a for a, m in manifests.items()}
        self._formed = FormedSources(
            spec,
            group,
            GroupRanks(len(trainers), tuple(by_id[w] for w in workers)),
            identities_of(manifests),
        )
        self.staging = {}
        self.buckets = {}  # built for the old group's id
        self.formations += 1
        log.info(
            "transfer group %s formed: %d trainer ranks, %d workers",
            spec.group_id,
            len(trainers),
            len(workers),
        )
        return self._formed

    def call_off(self, formed: FormedSources, update: int, why: str) -> None:
        """Rank 0: tell every other rank that update ``update`` on ``formed`` is called off, with
        ``why``: a key on the store this rank serves, which they watch (``watch_call_off``) while
        their sends run. Best effort: a rank that misses it still ends, at the group's timeout."""
        server = self._store
        store = server.store if server is not None else None
        if store is None:
            return
        try:
            store.set(formed.call_off_key(update), why.encode()[:_MAX_WHY_BYTES])
        except Exception as e:
            log.warning(
                "could not call update %d of group %s off on the store: %s", update, formed.group_id, e
            )

    def watch_call_off(self, formed: FormedSources, update: int, until: threading.Event) -> str | None:
        """A rank other than 0: wait until rank 0 calls update ``update`` off (``call_off``; returns
        its reason) or ``until`` is set (None). Over a connection of its own to rank 0's store, made
        at the group's first watch, each wait at most ``_WATCH_SLICE_S``. A store that cannot be
        reached ends the watch (None): a rank 0 that is gone ends the update through its sockets
        and the ranks' exchange."""
        key = formed.call_off_key(update)
        try:
            with formed.watch_lock:
                if formed.watch is None:
                    formed.watch = connect_store(formed.spec.store_address, self.timeout_s)
                conn = formed.watch
            while not until.is_set():
                try:
                    conn.wait([key], as_timedelta(_WATCH_SLICE_S))
                except StoreTimeout:
                    continue
                return bytes(conn.get(key)).decode("utf-8", "replace")
        except Exception as e:
            if not until.is_set():
                log.info("stopped watching group %s for a call-off: %s", formed.group_id, e)
        return None

    def teardown(self, why: str) -> None:
        """Destroy this rank's side of the group (its peers' pending operations fail at once)."""
        formed, self._formed = self._formed, None
        if formed is not None:
            log.info("tearing down transfer group %s: %s", formed.group_id, why)
            formed.close_watch()
            formed.group.close()

    def close(self, wait_s: float = 10.0) -> None:
        formed, self._formed = self._formed, None
        if formed is not None:
            formed.close_watch()
            formed.group.close(wait_s)
            if self._store is not None:  # rank 0 formed it: the workers leave too
                self._leave_all(formed.group_id)
        self._store = None
        self._close_store()
