"""The trainer's transfer group: forming it with the workers, routing each bucket over it
(point-to-point to each owner, or one broadcast to a subgroup of workers that own the same tensors),
sending the bytes, and tearing it down.

``WeightPusher(..., transfer_group=TransferGroupOptions(host=...))`` makes a ``GroupLink`` and
registers the transport's exporter with it (``weightwire.client.transports.transfer_group``). Per
push the exporter asks the link to ``ensure`` the group (formed once, reused while every worker
reports it READY with the same identities; formed anew otherwise), then ``route``s the update's
jobs: each job's bucket carries, for every recipient, a ``TransferGroupHandle`` naming the byte
ranges of the tensors that worker owns, and once the bucket messages are queued the link posts the
sends. Any failed update, and ``close``, tear the group down on this side: its sockets close, so a
worker blocked in a receive fails at once instead of waiting out the timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from weightwire.client.inputs.plan import TensorSpec
from weightwire.client.rpc.calls import Worker
from weightwire.client.transports.group_forming import (
    TRAINER_KEY,
    Joining,
    identities_of,
    join_here,
    largest_tensor_bytes,
    leave_all,
)
from weightwire.client.transports.route import ExportedRoute, Job, PerWorkerRoute, Route
from weightwire.client.transports.transfer_group_options import TransferGroupOptions
from weightwire.client.transports.transfer_group_sends import (
    Segment,
    Sends,
    announce_segments,
    direct_segments,
    packed_segments,
)
from weightwire.core.errors import PushError, Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.transfer_group import TransferGroup, check_backend
from weightwire.core.transports.transfer_group_plan import (
    ANNOUNCEMENT_INDEX,
    GroupPlan,
    MemberIdentity,
    message_tag,
    plan_group,
)
from weightwire.core.transports.transfer_group_store import SharedStore
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["GroupLink"]

log = logging.getLogger(__name__)

# How long closing the pusher waits for its process groups to be destroyed (they end at once unless
# an operation is still running; a process exiting meanwhile would cut a destructor off halfway).
_CLOSE_WAIT_S = 10.0


# --------------------------------------------------------------------------------------------
# Byte ranges of a bucket
# --------------------------------------------------------------------------------------------


# Each receiver first gets the sizes and last bytes of its messages, so it can tell a message that
# arrived short from a whole one (``weightwire.core.transports.whole_messages``).
def _post_broadcast(group: TransferGroup, subgroup: int, segments: Sequence[Segment]) -> list[Any]:
    if not segments:
        return []
    return [group.broadcast(announce_segments(segments), subgroup)] + [
        group.broadcast(g.source, subgroup) for g in segments
    ]


def _post_sends(group: TransferGroup, dst: int, seq: int, segments: Sequence[Segment]) -> list[Any]:
    if not segments:
        return []
    return [group.send(announce_segments(segments), dst, message_tag(seq, ANNOUNCEMENT_INDEX))] + [
        group.send(g.source, dst, message_tag(seq, i)) for i, g in enumerate(segments)
    ]


def _byte_ranges(ranges: Sequence[tuple[int, int]]) -> list[pb.ByteRange]:
    return [pb.ByteRange(offset_bytes=o, size_bytes=n) for o, n in ranges]


# --------------------------------------------------------------------------------------------
# The link: one formed group and everything sent over it
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Formed:
    plan: GroupPlan
    group: TransferGroup
    identities: dict[str, tuple[str, str]]  # address -> (worker id, instance id) it was planned with


class LinkBase:
    """What both transfer-group links of a pusher hold (this single-source one and
    ``weightwire.client.ranks.transfer_group_sources.SourcesLink``): the options and the deadline,
    the workers and the metadata of every call to them, and the rendezvous store."""

    def __init__(
        self,
        options: TransferGroupOptions,
        workers: Mapping[str, Worker],
        metadata: tuple[tuple[str, str], ...],
        timeout_s: float,
        store: SharedStore | None = None,
    ) -> None:
        self.options = options
        self.timeout_s = float(options.timeout_s if options.timeout_s is not None else timeout_s)
        self._workers = workers
        self._metadata = metadata
        # The pusher's store, shared by both its links (closed by the pusher), or one of this link's own.
        self._owns_store = store is None
        self.store = store if store is not None else SharedStore(options.host, options.port, self.timeout_s)
        self._start()

    def _start(self) -> None:
        """What the link holds besides the common part, made by each kind of link."""

    @property
    def device(self) -> torch.device:
        return self.options.device

    def _leave_all(self, group_id: str) -> None:
        leave_all(self._workers, group_id, self._metadata)

    def _close_store(self) -> None:
        if self._owns_store:
            self.store.close()


class GroupLink(LinkBase):
    """A pusher's transfer group: forms it, routes buckets over it, tears it down."""

    def _start(self) -> None:
        self.identity = MemberIdentity.of_trainer(self.options.trainer_rank, uuid.uuid4().hex)
        self._formed: _Formed | None = None
        self._closing: list[TransferGroup] = []
        self._lock = threading.Lock()
        self._sequence = 0
        self._failure: WeightwireError | None = None
        self._sends = Sends(self._send_failed)
        self.formations = 0

    @property
    def group_id(self) -> str | None:
        formed = self._formed
        return formed.plan.group_id if formed is not None else None

    @property
    def plan(self) -> GroupPlan | None:
        formed = self._formed
        return formed.plan if formed is not None else None

    # ---------------------------------------------------------------- forming

    def _needs_forming(
        self,
        manifests: Mapping[str, ShardManifest],
        statuses: Mapping[str, pb.GetStatusResponse] | None,
        max_bytes: int,
    ) -> str | None:
        formed = self._formed
        if formed is None or formed.group.closed:
            return "no group yet" if formed is None else "the group was torn down"
        if set(manifests) != set(formed.identities):
            return "the workers changed"
        for a, m in manifests.items():
            if formed.identities[a] != (m.worker_id, m.instance_id):
                return f"{m.worker_id or a} restarted (instance {m.instance_id[:8]})"
        if max_bytes > formed.plan.spec.max_bucket_bytes:
            return f"a bucket of {max_bytes} bytes exceeds the group's limit"
        for a, st in (statuses or {}).items():
            tg = st.transfer_group
            if tg.group_id != formed.plan.group_id or tg.state != pb.TRANSFER_GROUP_STATE_READY:
                why = tg.last_teardown or pb.TransferGroupState.Name(tg.state)
                return f"{manifests[a].worker_id or a} is not in the group ({why})"
        return None

    def ensure(
        self,
        manifests: Mapping[str, ShardManifest],
        statuses: Mapping[str, pb.GetStatusResponse] | None,
        max_bucket_bytes: int,
    ) -> None:
        """Form the group unless the current one still holds exactly these workers, all READY."""
        why = self._needs_forming(manifests, statuses, max_bucket_bytes)
        if why is None:
            return
        log.info("forming a transfer group: %s", why)
        self.teardown(why, leave=self._formed is not None)
        self._form(manifests, max_bucket_bytes)

    def _form(self, manifests: Mapping[str, ShardManifest], max_bucket_bytes: int) -> None:
        backend = self.options.backend_value
        check_backend(backend, self.device)
        server = self.store.server()
        plan = plan_group(
            manifests,
            trainer=self.identity,
            group_id=f"ww-{uuid.uuid4().hex[:20]}",
            backend=backend,
            store_address=server.address,
            timeout_ms=int(self.timeout_s * 1000),
            max_bucket_bytes=max(max_bucket_bytes, largest_tensor_bytes(manifests)),
            broadcast=self.options.broadcast,
        )
        joining = Joining(self._workers, manifests, plan.spec, self.timeout_s, self._metadata)
        group, mine = join_here(plan.spec, self.identity, self.options, server.store)
        failures = joining.failures()
        if failures or mine is not None or group is None:
            if group is not None:
                group.close()
            self._leave_all(plan.group_id)
            if mine is not None and not failures:
                failures[TRAINER_KEY] = mine
            raise PushError(failures)
        self._formed = _Formed(plan, group, identities_of(manifests))
        self._failure = None
        self._sequence = 0
        self.formations += 1
        log.info(
            "transfer group %s formed: %d workers, %d broadcast subgroups",
            plan.group_id,
            len(manifests),
            len(plan.spec.subgroups),
        )

    # ---------------------------------------------------------------- tearing down

    def _send_failed(self, err: WeightwireError) -> None:
        # Not torn down here: the worker concerned fails its own update (its receive fails, or its
        # stream breaks), so the session names it first and cancels the others; the session's
        # failure path then closes this side (``release_routed``), which frees anyone still waiting.
        self._failure = self._failure or err
        log.warning("transfer group %s: %s", self.group_id, err.message)

    def teardown(self, why: str, *, leave: bool = True, wait_s: float = 0.0) -> None:
        """Destroy this side of the group (pending receives on the workers fail at once); with
        ``leave``, also tell every worker to leave it (best effort)."""
        with self._lock:
            formed, self._formed = self._formed, None
        if formed is None:
            return
        log.info("tearing down transfer group %s: %s", formed.plan.group_id, why)
        with self._lock:
            self._closing = [g for g in self._closing if not g.destroyed] + [formed.group]
        formed.group.close(wait_s)
        if leave:
            self._leave_all(formed.plan.group_id)

    def close(self) -> None:
        self.teardown("the pusher closed")
        # Every group torn down so far gets its destructors finished (a process that exits during
        # one aborts), within one bound in all.
        deadline = time.monotonic() + _CLOSE_WAIT_S
        with self._lock:
            closing, self._closing = self._closing, []
        for group in closing:
            group.close(max(0.0, deadline - time.monotonic()))
        self._sends.stop(max(0.0, deadline - time.monotonic()))
        self._close_store()

    # ---------------------------------------------------------------- routing

    def route(
        self,
        jobs: Sequence[Job],
        manifests: Mapping[str, ShardManifest],
        sources: Mapping[str, torch.Tensor] | None = None,
        *,
        verify_checksums: bool = False,
    ) -> list[Job]:
        """The same jobs, whose prepared buckets carry per-worker transfer-group payloads and post
        their sends once the bucket messages are queued.

        With ``sources`` (the tensors ``push`` was given, by name), a bucket whose tensors are all
        contiguous, on this group's device and of the dtype sent is sent straight from them: each
        tensor of at least ``DIRECT_MIN_BYTES`` as its own message, runs of smaller adjacent ones
        packed into a small buffer; nothing is copied into a staging buffer.
        """
        formed = self._formed
        if formed is None:
            raise WeightwireError(Reason.GROUP_NOT_JOINED, "the transfer group is not formed")
        return [
            dataclasses.replace(
                job, prepare=self._routed_prepare(job, formed, manifests, sources, verify_checksums)
            )
            for job in jobs
        ]

    def _routed_prepare(
        self,
        job: Job,
        formed: _Formed,
        manifests: Mapping[str, ShardManifest],
        sources: Mapping[str, torch.Tensor] | None,
        verify_checksums: bool,
    ) -> Callable[[Callable[[], bool], float], Route]:
        inner = job.prepare
        workers = set(job.recipients)
        subgroup = next(
            (sid for sid, members in formed.plan.subgroup_workers.items() if set(members) == workers), None
        )
        direct = None if verify_checksums or sources is None else self._direct_sources(job, sources)

        def prepare(stopped: Callable[[], bool], deadline: float) -> Route:
            if direct is not None:
                flats = dict(zip((sp.name for sp in job.specs), direct, strict=True))
                return self._bucket(
                    job,
                    lambda specs: direct_segments(specs, [flats[sp.name] for sp in specs]),
                    formed,
                    manifests,
                    subgroup,
                    0,
                    None,
                    lambda ok: None,
                )
            prepared = inner(stopped, deadline)
            try:
                staged = prepared.staged if isinstance(prepared, ExportedRoute) else None
                if staged is None:
                    raise WeightwireError(
                        Reason.TRANSPORT_UNAVAILABLE, "a transfer-group bucket needs its staged buffer"
                    )
                base = prepared.base_offset_bytes
                data = staged.tensor()
                return self._bucket(
                    job,
                    lambda specs: packed_segments(specs, data, base),
                    formed,
                    manifests,
                    subgroup,
                    base,
                    prepared.checksum,
                    prepared.release,
                )
            except BaseException:
                prepared.release(False)
                raise

        return prepare

    def _direct_sources(self, job: Job, sources: Mapping[str, torch.Tensor]) -> list[torch.Tensor] | None:
        """Each spec's tensor as flat bytes, or None when any cannot be sent as it is."""
        device = self.device.type
        out = []
        for spec in job.specs:
            t = sources.get(spec.name)
            if (
                t is None
                or t.device.type != device
                or t.dtype != spec.dtype
                or tuple(t.shape) != tuple(spec.shape)
                or not t.is_contiguous()
            ):
                return None
            out.append(t.detach().reshape(-1).view(torch.uint8))
        return out

    def _bucket(
        self,
        job: Job,
        segments_of: Callable[[Sequence[TensorSpec]], list[Segment]],
        formed: _Formed,
        manifests: Mapping[str, ShardManifest],
        subgroup: int | None,
        base: int,
        checksum: pb.Checksum | None,
        release: Callable[[bool], None],
    ) -> Route:
        size = base + job.size_bytes
        self._sequence += 1
        seq = self._sequence
        group, plan = formed.group, formed.plan
        gid = plan.group_id
        sends: list[tuple[str, list[Segment]]] = []
        payloads: dict[str, pb.Payload] = {}
        segments: list[Segment] = []
        if subgroup is not None:
            segments = segments_of(job.specs)
            handle = pb.TransferGroupHandle(
                group_id=gid,
                mode=pb.TRANSFER_MODE_BROADCAST,
                source_rank=group.rank,
                subgroup_id=subgroup,
                sequence=seq,
                ranges=_byte_ranges([(g.offset, g.size) for g in segments]),
            )
            for a in job.recipients:
                payloads[a] = pb.Payload(
                    device=manifests[a].device.to_proto(), size_bytes=size, transfer_group=handle
                )
        else:
            # Only the tensors a worker owns travel to it (shard-aware, no padding); workers that
            # own the same tensors share one list of messages.
            by_owned: dict[tuple[str, ...], list[Segment]] = {}
            for a in job.recipients:
                owned = manifests[a].tensors
                names = tuple(sp.name for sp in job.specs if sp.name in owned)
                if names not in by_owned:
                    by_owned[names] = segments_of([sp for sp in job.specs if sp.name in owned])
                mine = by_owned[names]
                handle = pb.TransferGroupHandle(
                    group_id=gid,
                    mode=pb.TRANSFER_MODE_POINT_TO_POINT,
                    source_rank=group.rank,
                    sequence=seq,
                    ranges=_byte_ranges([(g.offset, g.size) for g in mine]),
                )
                payloads[a] = pb.Payload(
                    device=manifests[a].device.to_proto(), size_bytes=size, transfer_group=handle
                )
                sends.append((a, mine))
        released = threading.Lock()

        def release_once(ok: bool) -> None:
            # The first verdict wins: a buffer handed back when its sends completed may already be
            # in use for a later bucket when the session releases this one.
            if released.acquire(blocking=False):
                release(ok)

        def on_sent() -> None:
            # Every recipient's stream has the bucket message; now the bytes. Errors arrive through
            # ``Sends`` (the worker concerned then fails its update and the session ends it).
            try:
                if subgroup is not None:
                    what = f"broadcast of bucket {seq}"
                    works = _post_broadcast(group, subgroup, segments)
                else:
                    what = f"sending bucket {seq}"
                    works = [w for a, mine in sends for w in _post_sends(group, plan.ranks[a], seq, mine)]
            except WeightwireError as err:
                self._send_failed(err)
                return
            except Exception as e:
                self._send_failed(
                    WeightwireError(Reason.TRANSFER_FAILED, f"posting the sends of bucket {seq}: {e!r}")
                )
                return
            self._sends.add(group, works, what, lambda: release_once(True))

        def release_routed(ok: bool) -> None:
            if not ok:
                # A worker may wait for bytes that will not come: close our side so it fails now.
                self.teardown("an update failed")
            release_once(ok)

        return PerWorkerRoute(
            payloads, releaser=release_routed, checksum=checksum, base_offset_bytes=base, on_queued=on_sent
        )
