"""The trainer's side of transfer groups: forming the group with the workers, routing each bucket
over it (point-to-point to each owner, or one broadcast to a subgroup of workers that own the same
tensors), sending the bytes, and tearing the group down.

``WeightPusher(..., transfer_group=TransferGroupOptions(host=...))`` makes a ``GroupLink`` and uses
the ``transfer_group`` transport (``GroupExporter``, its row in ``weightwire.core.transports.table``). Per
push the pusher asks the link to ``ensure`` the group (formed once, reused while every worker reports
it READY with the same identities; formed anew otherwise), then ``route``s the update's jobs: each
job's bucket carries, for every recipient, a ``TransferGroupHandle`` naming the byte ranges of the
tensors that worker owns, and once the bucket messages are queued the link posts the sends. Any
failed update, and ``close``, tear the group down on this side: its sockets close, so a worker
blocked in a receive fails at once instead of waiting out the timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import torch
from weightwire.client.push.plan import PlanError, TensorSpec
from weightwire.client.push.rpc import Worker, error_from_rpc
from weightwire.client.push.staging import Job, PreparedBucket
from weightwire.client.transports import exporter as exp
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import PushError, Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports import table as transports
from weightwire.core.transports.transfer_group import TransferGroup, check_backend
from weightwire.core.transports.transfer_group_plan import GroupPlan, MemberIdentity, message_tag, plan_group
from weightwire.core.transports.transfer_group_store import StoreServer
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["GroupExporter", "GroupLink", "TransferGroupOptions"]

log = logging.getLogger(__name__)

_BACKENDS = {"gloo": pb.TRANSFER_BACKEND_GLOO, "nccl": pb.TRANSFER_BACKEND_NCCL}
# How much longer than the group's timeout a JoinTransferGroup call may take (the worker answers
# with its reason at the group's timeout; the RPC deadline only guards a hung worker).
_JOIN_GRACE_S = 5.0
_LEAVE_TIMEOUT_S = 5.0
# How long closing the pusher waits for its process groups to be destroyed (they end at once unless
# an operation is still running; a process exiting meanwhile would cut a destructor off halfway).
_CLOSE_WAIT_S = 10.0
# Key of the trainer's own part in a PushError about forming (workers are keyed by address).
TRAINER_KEY = "trainer"


@dataclasses.dataclass(frozen=True)
class TransferGroupOptions:
    """How a pusher forms its transfer group.

    ``host``: this trainer's address on the network the workers reach; the rendezvous store and the
    group's sockets listen only there. ``port``: the store's port (0 picks a free one). ``backend``:
    ``"gloo"`` (CPU staging) or ``"nccl"`` (tensors and staging on GPUs). ``broadcast``: workers that
    own the same tensors share one broadcast instead of receiving the same bytes one by one.
    ``timeout_s``: deadline of forming and of every send and receive (default: the pusher's timeout).
    ``trainer_rank``: this process's rank among the trainer's processes (only names it).
    """

    host: str
    port: int = 0
    backend: str = "gloo"
    broadcast: bool = True
    timeout_s: float | None = None
    trainer_rank: int = 0

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, not {self.backend!r}")
        if not self.host:
            raise ValueError("TransferGroupOptions needs the host address the workers can reach")

    @property
    def backend_value(self) -> int:
        return _BACKENDS[self.backend]


# --------------------------------------------------------------------------------------------
# The exporter: staging buffers on the backend's device
# --------------------------------------------------------------------------------------------


class _GroupBuffer(exp.StagingBuffer):
    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.capacity_bytes = flat.numel()

    def tensor(self) -> torch.Tensor:
        return self.flat

    def ready(self) -> None:
        if self.flat.device.type == "cuda":
            torch.cuda.current_stream(self.flat.device).synchronize()


class GroupExporter(exp.Exporter):
    """The trainer's half of the transfer-group transport: staging in plain memory on the device the
    backend sends from (host memory for gloo, the trainer's GPU for NCCL; a caller's flat buffer on
    that device is sent in place), and the update hooks through the pusher's ``GroupLink``: each
    update checks (or forms) the group before anything is sent, and ``route_update`` gives every
    job per-worker payloads (each worker's group rank and byte ranges) and its sends."""

    TRANSPORT = transports.TRANSFER_GROUP
    label = None
    routes_each_update = True

    def __init__(self, link: GroupLink | None = None) -> None:
        self.link = link

    @property
    def device(self) -> torch.device:
        """Where staging lives: the device the group's backend sends from, asked at each use (an
        NCCL trainer may select its GPU after building the pusher)."""
        return self.link.device if self.link is not None else torch.device("cpu")

    @classmethod
    def for_source(cls, source: torch.device) -> exp.Exporter:
        return cls()

    def allocate(self, capacity_bytes: int) -> exp.StagingBuffer:
        return _GroupBuffer(torch.empty(max(int(capacity_bytes), 1), dtype=torch.uint8, device=self.device))

    def wrap(self, flat: torch.Tensor) -> exp.StagingBuffer | None:
        if flat.device.type != self.device.type or not flat.is_contiguous():
            return None
        return _GroupBuffer(flat.reshape(-1).view(torch.uint8))

    def export(self, buffer: exp.StagingBuffer, size_bytes: int, label: DeviceRef) -> pb.Payload:
        # One payload per device cannot name each worker's group rank; route_update makes them.
        raise WeightwireError(
            Reason.TRANSPORT_UNAVAILABLE,
            "transfer-group payloads name each worker's group rank; they are made per worker by route_update",
        )

    def _formed_link(self) -> GroupLink:
        if self.link is None:
            raise PlanError(
                Reason.TRANSPORT_UNAVAILABLE,
                "transport 'transfer_group' needs WeightPusher(..., transfer_group=TransferGroupOptions(host=...))",
            )
        return self.link

    def route_update(
        self,
        jobs: Sequence[Job],
        manifests: Mapping[str, ShardManifest],
        statuses: Mapping[str, pb.GetStatusResponse] | None,
        sources: Mapping[str, torch.Tensor] | None,
        *,
        verify_checksums: bool,
    ) -> list[Job]:
        link = self._formed_link()
        link.ensure(manifests, statuses, max((j.size_bytes for j in jobs), default=0))
        return link.route(jobs, manifests, sources, verify_checksums=verify_checksums)

    def update_failed(self, failures: Mapping[str, WeightwireError]) -> bool:
        # The workers leave the group when an update fails; so does this side. A worker not in the
        # plan restarted since its manifest was read: read them again next time.
        if self.link is not None:
            self.link.teardown("an update failed", leave=False)
        return any(err.kind is Reason.GROUP_UNKNOWN_MEMBER for err in failures.values())


# --------------------------------------------------------------------------------------------
# Byte ranges of a bucket
# --------------------------------------------------------------------------------------------


def _byte_ranges(ranges: Sequence[tuple[int, int]]) -> list[pb.ByteRange]:
    return [pb.ByteRange(offset_bytes=o, size_bytes=n) for o, n in ranges]


# --------------------------------------------------------------------------------------------
# The link: one formed group and everything sent over it
# --------------------------------------------------------------------------------------------


class _Sends:
    """Waits, on one thread and in order, for each bucket's posted sends; a bucket whose sends all
    completed has left this process, so its buffer may be reused (``on_done``) before the workers
    acked it. A failure is reported to ``on_failure`` (the bucket's buffer then stays with the
    session, which discards it when the update fails)."""

    def __init__(self, on_failure: Callable[[WeightwireError], None]) -> None:
        self._queue: queue.SimpleQueue[tuple[TransferGroup, list[Any], str, Callable[[], None]] | None] = (
            queue.SimpleQueue()
        )
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name="ww-group-sends", daemon=True)
        self._thread.start()

    def add(self, group: TransferGroup, works: list[Any], what: str, on_done: Callable[[], None]) -> None:
        self._queue.put((group, works, what, on_done))

    def stop(self, wait_s: float) -> None:
        """End the thread and wait for it: a thread that still drops a torch.distributed Work while
        the interpreter exits aborts the process (the Work's destructor releases the GIL)."""
        self._queue.put(None)
        self._thread.join(wait_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._wait(*item)
            del item  # no Work outlives its wait here (see ``stop``)

    def _wait(self, group: TransferGroup, works: list[Any], what: str, on_done: Callable[[], None]) -> None:
        if group.closed:
            return
        try:
            for work in works:
                group.wait(work, what)
        except WeightwireError as err:
            self._on_failure(err)
            return
        on_done()


@dataclasses.dataclass
class _Formed:
    plan: GroupPlan
    group: TransferGroup
    identities: dict[str, tuple[str, str]]  # address -> (worker id, instance id) it was planned with


class GroupLink:
    """A pusher's transfer group: forms it, routes buckets over it, tears it down."""

    def __init__(
        self,
        options: TransferGroupOptions,
        workers: Mapping[str, Worker],
        metadata: tuple[tuple[str, str], ...],
        timeout_s: float,
    ) -> None:
        self.options = options
        self.timeout_s = float(options.timeout_s if options.timeout_s is not None else timeout_s)
        self._workers = workers
        self._metadata = metadata
        self.identity = MemberIdentity.of_trainer(options.trainer_rank, uuid.uuid4().hex)
        self._store: StoreServer | None = None
        self._formed: _Formed | None = None
        self._closing: list[TransferGroup] = []
        self._lock = threading.Lock()
        self._sequence = 0
        self._failure: WeightwireError | None = None
        self._sends = _Sends(self._send_failed)
        self.formations = 0

    @property
    def device(self) -> torch.device:
        if self.options.backend_value == pb.TRANSFER_BACKEND_NCCL:
            return (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cuda")
            )
        return torch.device("cpu")

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
        if self._store is None:
            self._store = StoreServer(self.options.host, self.options.port, timeout_s=self.timeout_s)
        largest = max((t.nbytes for m in manifests.values() for t in m.tensors.values()), default=0)
        plan = plan_group(
            manifests,
            trainer=self.identity,
            group_id=f"ww-{uuid.uuid4().hex[:20]}",
            backend=backend,
            store_address=self._store.address,
            timeout_ms=int(self.timeout_s * 1000),
            max_bucket_bytes=max(max_bucket_bytes, largest),
            broadcast=self.options.broadcast,
        )
        request = pb.JoinTransferGroupRequest(spec=plan.spec)
        futures = {
            a: self._workers[a].stub.JoinTransferGroup.future(
                request, timeout=self.timeout_s + _JOIN_GRACE_S, metadata=self._metadata
            )
            for a in manifests
        }
        mine: WeightwireError | None = None
        group: TransferGroup | None = None
        try:
            group = TransferGroup.form(
                plan.spec,
                self.identity,
                listen_host=self.options.host,
                device=self.device,
                store=self._store.store,
            )
        except WeightwireError as err:
            mine = err
        failures: dict[str, WeightwireError] = {}
        for a, fut in futures.items():
            try:
                fut.result()
            except grpc.RpcError as e:
                failures[a] = error_from_rpc(e, worker=a, context="JoinTransferGroup")
        if failures or mine is not None or group is None:
            if group is not None:
                group.close()
            self._leave_all(plan.group_id)
            if mine is not None and not failures:
                failures[TRAINER_KEY] = mine
            raise PushError(failures)
        self._formed = _Formed(plan, group, {a: (m.worker_id, m.instance_id) for a, m in manifests.items()})
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

    def _leave_all(self, group_id: str) -> None:
        request = pb.LeaveTransferGroupRequest(group_id=group_id)
        futures = [
            w.stub.LeaveTransferGroup.future(request, timeout=_LEAVE_TIMEOUT_S, metadata=self._metadata)
            for w in self._workers.values()
        ]
        for fut in futures:
            try:
                fut.result()
            except grpc.RpcError:
                pass  # a worker that is gone has left already

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
        if self._store is not None:
            self._store.close()
            self._store = None

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
    ) -> Callable[[Callable[[], bool], float], PreparedBucket]:
        inner = job.prepare
        workers = set(job.recipients)
        subgroup = next(
            (sid for sid, members in formed.plan.subgroup_workers.items() if set(members) == workers), None
        )
        direct = None if verify_checksums or sources is None else self._direct_sources(job, sources)

        def prepare(stopped: Callable[[], bool], deadline: float) -> PreparedBucket:
            if direct is not None:
                flats = dict(zip((sp.name for sp in job.specs), direct, strict=True))
                return self._bucket(
                    job,
                    lambda specs: _direct_segments(specs, [flats[sp.name] for sp in specs]),
                    formed,
                    manifests,
                    subgroup,
                    0,
                    None,
                    lambda ok: None,
                )
            prepared = inner(stopped, deadline)
            try:
                staged = prepared.staged
                if staged is None:
                    raise WeightwireError(
                        Reason.TRANSPORT_UNAVAILABLE, "a transfer-group bucket needs its staged buffer"
                    )
                base = prepared.base_offset_bytes
                data = staged.tensor()
                return self._bucket(
                    job,
                    lambda specs: _packed_segments(specs, data, base),
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
        segments_of: Callable[[Sequence[TensorSpec]], list[_Segment]],
        formed: _Formed,
        manifests: Mapping[str, ShardManifest],
        subgroup: int | None,
        base: int,
        checksum: pb.Checksum | None,
        release: Callable[[bool], None],
    ) -> PreparedBucket:
        size = base + job.size_bytes
        self._sequence += 1
        seq = self._sequence
        group, plan = formed.group, formed.plan
        gid = plan.group_id
        sends: list[tuple[str, list[_Segment]]] = []
        payloads: dict[str, pb.Payload] = {}
        segments: list[_Segment] = []
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
            by_owned: dict[tuple[str, ...], list[_Segment]] = {}
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
            # ``_Sends`` (the worker concerned then fails its update and the session ends it).
            works: list[Any] = []
            try:
                if subgroup is not None:
                    what = f"broadcast of bucket {seq}"
                    works = [group.broadcast(g.source, subgroup) for g in segments]
                else:
                    what = f"sending bucket {seq}"
                    for a, mine in sends:
                        dst = plan.ranks[a]
                        works += [group.send(g.source, dst, message_tag(seq, i)) for i, g in enumerate(mine)]
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

        return PreparedBucket(
            [],
            None,
            checksum,
            release_routed,
            base_offset_bytes=base,
            per_recipient=payloads.__getitem__,
            on_sent=on_sent,
        )


# A tensor at least this large is sent straight from its own memory; smaller adjacent ones are
# packed into one message (a message costs more than copying a few hundred KiB).
DIRECT_MIN_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One message of a bucket: bytes [offset, offset + size) of the layout, the tensors they hold,
    and where the sender reads them (exactly ``size`` bytes)."""

    offset: int
    size: int
    names: tuple[str, ...]
    source: torch.Tensor


def _packed_segments(specs: Sequence[TensorSpec], data: torch.Tensor, base: int) -> list[_Segment]:
    """Messages over a packed bucket: runs of exactly adjacent tensors (gaps are never sent)."""
    out: list[_Segment] = []
    for spec in sorted((s for s in specs if s.nbytes > 0), key=lambda s: s.offset_bytes):
        offset = base + spec.offset_bytes
        last = out[-1] if out else None
        if last is not None and last.offset + last.size == offset:
            size = last.size + spec.nbytes
            out[-1] = _Segment(
                last.offset, size, (*last.names, spec.name), data[last.offset : last.offset + size]
            )
        else:
            out.append(_Segment(offset, spec.nbytes, (spec.name,), data[offset : offset + spec.nbytes]))
    return out


def _direct_segments(specs: Sequence[TensorSpec], flats: Sequence[torch.Tensor]) -> list[_Segment]:
    """Messages straight from the tensors: each large one alone, runs of exactly adjacent small ones
    copied into one small buffer (a few per bucket; freed when their send completes)."""
    order = sorted((i for i, s in enumerate(specs) if s.nbytes > 0), key=lambda i: specs[i].offset_bytes)
    out: list[_Segment] = []
    run: list[int] = []

    def close_run() -> None:
        if not run:
            return
        first, last = specs[run[0]], specs[run[-1]]
        start, end = first.offset_bytes, last.offset_bytes + last.nbytes
        buf = torch.empty(end - start, dtype=torch.uint8, device=flats[run[0]].device)
        for i in run:
            buf[specs[i].offset_bytes - start : specs[i].offset_bytes - start + specs[i].nbytes].copy_(
                flats[i]
            )
        out.append(_Segment(start, end - start, tuple(specs[i].name for i in run), buf))
        run.clear()

    for i in order:
        spec = specs[i]
        if spec.nbytes >= DIRECT_MIN_BYTES:
            close_run()
            out.append(_Segment(spec.offset_bytes, spec.nbytes, (spec.name,), flats[i]))
            continue
        if run and specs[run[-1]].offset_bytes + specs[run[-1]].nbytes != spec.offset_bytes:
            close_run()
        run.append(i)
    close_run()
    return out
