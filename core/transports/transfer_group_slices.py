"""Every trainer rank a source: a ``TransferPlan`` carried out over a transfer group's process group.

Each trainer rank sends only the regions of its own shards that the plan gives it (no gather to
rank 0), each worker receives exactly the regions of its slices (``bytes received == its manifest's
kept bytes``) and writes them into its kept tensors (a tensor kept as several pieces is held as their
concatenation along the pieces' dimension, in the manifest's order: the layout of a fused q/k/v or
gate/up parameter, and of a TP shard).

Buffers can be kept across updates (``staging``: memory of one update's messages and the operations
built for them, reused while the plan and the tensors are the same; for speed).
Both sides derive the messages from the plan alone (``messages``): what one source sends one
worker is the plan's transfers between them, the small ones packed back to back into messages of
at most ``max_message_bytes``, every other one alone, sent from the shard and received into the
kept tensor in place where its region is contiguous there. Every member first compares the
plan's fingerprint with every other member (``agree``, ``transfer_group_agreement``: once per group
and plan), so a member with another plan refuses before a byte moves instead of pairing the wrong
bytes; each source then announces to each worker
the sizes and last bytes of its messages, so a message that arrives short is refused, not counted
(``weightwire.core.transports.whole_messages``).

``WeightPusher.push`` drives it in a multi-rank push over a transfer group
(``weightwire.client.ranks.slice_push`` on the trainer's ranks, ``weightwire.server.transports.
transfer_group_slices`` on the workers; gRPC carries the plan, acks and commit). Pure
torch.distributed: any process group with
``send``/``recv``/``allgather`` (``ProcessGroupGloo`` here, ``ProcessGroupNCCL`` on GPUs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from weightwire.core import dtypes
from weightwire.core.manifest import OwnedTensor
from weightwire.core.transports.transfer_group_waits import post, wait, watch_receives
from weightwire.core.transports.transfer_plan import Box, Transfer, TransferPlan
from weightwire.core.transports.whole_messages import Arrivals, announce, last_byte

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# Below this a region is packed with its neighbours: a message per small region would cost more in
# per-message work than the copies it saves.
DIRECT_MIN_BYTES = 64 << 10


@dataclasses.dataclass(frozen=True)
class GroupRanks:
    """Group rank of every member: trainer rank r is group rank r, then the workers in the order
    given (every member must be given the same order; ``of_plan`` sorts them)."""

    trainers: int
    workers: tuple[str, ...]

    @classmethod
    def of_plan(cls, trainers: int, workers: Sequence[str]) -> GroupRanks:
        return cls(trainers, tuple(sorted(workers)))

    @property
    def world_size(self) -> int:
        return self.trainers + len(self.workers)

    def of_worker(self, worker: str) -> int:
        return self.trainers + self.workers.index(worker)


def messages(
    plan: TransferPlan,
    source: int,
    worker: str,
    max_message_bytes: int,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
    tensors: frozenset[str] | None = None,
) -> list[list[Transfer]]:
    """The transfers ``source`` sends ``worker`` (only those of ``tensors`` when given: one of the
    worker's buckets), grouped into messages: first the transfers under
    ``direct_min_bytes``, in plan order, packed back to back into messages of at most
    ``max_message_bytes``; then each transfer of at least ``direct_min_bytes`` as a message of its
    own, those of whole rows (``Transfer.rows``) first, each group in plan order. Such a message is sent from the shard in place when its region is
    contiguous there (whole rows of a ``Shard(0)`` shard), else copied once into a buffer sent to
    all its destinations, and received in place when its region is contiguous in the kept tensor
    (whole rows, or the rows of a row-parallel slice), else into a buffer and copied."""
    packed: list[list[Transfer]] = []
    alone: list[list[Transfer]] = []
    size = 0
    for t in plan.transfers:
        if t.source != source or worker not in t.destinations:
            continue
        if tensors is not None and t.tensor not in tensors:
            continue
        if _alone(t, direct_min_bytes):
            alone.append([t])
            continue
        if not packed or size + t.nbytes > max_message_bytes:
            packed.append([])
            size = 0
        packed[-1].append(t)
        size += t.nbytes
    # Whole rows first: sent from a Shard(0) shard in place, they flow while the others are copied.
    return packed + [m for m in alone if m[0].rows] + [m for m in alone if not m[0].rows]


def _alone(t: Transfer, direct_min_bytes: int) -> bool:
    return t.nbytes >= direct_min_bytes


def send_order(ranks: GroupRanks, source: int) -> list[str]:
    """The order trainer rank ``source`` serves the workers: all of them, starting at a different
    one per source (``source * workers // trainers``), so the sources do not all send to the first
    worker first while the last waits. Only the order of posting; what one source sends one worker
    keeps plan order (``messages``)."""
    n = len(ranks.workers)
    if n == 0:
        return []
    first = source * n // max(ranks.trainers, 1) % n
    return [ranks.workers[(first + k) % n] for k in range(n)]


Buckets = tuple[tuple[str, tuple[frozenset[str], ...]], ...]
"""How each worker's part of a plan is split into the buckets of one update: per worker (in any
order) the tensors of each of its buckets, in bucket order. Every region of a tensor travels in
the same bucket; a worker the split leaves out gets all its regions in one."""


def send_sequence(
    plan: TransferPlan,
    ranks: GroupRanks,
    source: int,
    max_message_bytes: int,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
    buckets: Buckets = (),
) -> list[tuple[str, int, int, list[Transfer]]]:
    """``(worker, bucket, index, message)`` in the order trainer rank ``source`` posts its sends:
    bucket by bucket (every worker's first bucket, then every worker's second, ...), and within one
    round the workers in ``send_order`` taking turns, one message each, so every worker's stream
    starts at once and the copies of the later, packed regions overlap the earlier ones' sends.
    Each worker's messages keep their order (``messages``, per bucket), which is all the receiver
    relies on."""
    split = dict(buckets)
    rounds: dict[str, list[list[list[Transfer]]]] = {}
    for w in send_order(ranks, source):
        parts = split.get(w)
        if parts is None:
            rounds[w] = [messages(plan, source, w, max_message_bytes, direct_min_bytes)]
        else:
            rounds[w] = [messages(plan, source, w, max_message_bytes, direct_min_bytes, p) for p in parts]
    out = []
    for bucket in range(max((len(r) for r in rounds.values()), default=0)):
        streams = [(w, r[bucket]) for w, r in rounds.items() if bucket < len(r)]
        for index in range(max((len(m) for _, m in streams), default=0)):
            out += [(w, bucket, index, m[index]) for w, m in streams if index < len(m)]
    return out


def _region(t: torch.Tensor, box: Box, origin: Sequence[int]) -> torch.Tensor:
    for d, ((a, b), o) in enumerate(zip(box, origin, strict=True)):
        t = t.narrow(d, a - o, b - a)
    return t


def held_region(shard: torch.Tensor, box: Box, held: Box) -> torch.Tensor:
    """Region ``box`` of the full tensor in ``shard``, a rank's part of it that is region ``held``."""
    return _region(shard, box, [a for a, _ in held])


def _buffer(
    staging: dict[Any, torch.Tensor] | None, key: Any, nbytes: int, device: torch.device
) -> torch.Tensor:
    """A message buffer of ``nbytes`` on ``device`` (where the message's regions live, which is
    where the group's backend moves bytes from: the host for gloo, the GPU for NCCL), kept in
    ``staging`` across updates when the caller gives one (the same plan makes the same messages, so
    each buffer is reused as is; a fresh allocation per message and update is page faults on every
    byte)."""
    if staging is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    buf = staging.get(key)
    if buf is None or buf.numel() != nbytes or buf.device != device:
        buf = staging[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf


def _view(buf: torch.Tensor, offset: int, t: Transfer, dtype: torch.dtype) -> torch.Tensor:
    return buf[offset : offset + t.nbytes].view(dtype).view([b - a for a, b in t.box])


def _packed(
    buf: torch.Tensor, offset: int, t: Transfer, region: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Transfer ``t``'s bytes (``dtype`` on the wire) at ``offset`` of message buffer ``buf`` and
    ``region``, as two tensors to copy either way: typed where ``offset`` is a multiple of the
    element size, else, for a region of the wire's dtype, both as bytes. A message packs regions of
    several dtypes one after another, so an FP8 region of an odd byte count puts the float32
    scale after it off its alignment."""
    if offset % dtype.itemsize == 0 or region.dtype != dtype or region.dim() == 0:
        return _view(buf, offset, t, dtype), region
    as_bytes = region.view(torch.uint8)  # needs the last dimension contiguous, as every region here is
    return buf[offset : offset + t.nbytes].view(as_bytes.shape), as_bytes


Op = tuple[int, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], int, str, torch.Tensor | None]
"""(peer's group rank, the buffer sent or received into, the copies (to, from) before the send or
after the receive, bytes, the peer's name for errors, and on the sending side the last byte of the
message's content where it is read before the copies: ``last_byte`` of its last region)."""


@dataclasses.dataclass
class _Ops:
    """One side's operations for a plan, kept in ``staging`` across updates: building them (the
    messages, each region's view) costs more Python than posting them, and the same plan into the
    same tensors makes the same ones. Valid while the plan and the parameters are the same and
    every tensor used is the same object with the same storage, shape and strides."""

    plan: TransferPlan
    params: tuple[Any, ...]
    tensors: dict[str, tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]]
    meta: dict[str, Any]  # what else a tensor's views were made from (its holding, its pieces)
    ops: list[Op]
    rounds: list[int] = dataclasses.field(default_factory=list)  # each op's bucket (sending side)

    def valid(
        self, plan: TransferPlan, params: tuple[Any, ...], tensors: Mapping[str, Any], meta: Mapping[str, Any]
    ) -> bool:
        return (
            self.plan is plan
            and self.params == params
            and all(
                tensors.get(n) is t and t.data_ptr() == p and t.shape == sh and t.stride() == st
                for n, (t, p, sh, st) in self.tensors.items()
            )
            and all((v := meta.get(n)) is w or v == w for n, w in self.meta.items())
        )

    def track(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], name: str
    ) -> tuple[torch.Tensor, Any]:
        """``tensors[name]`` and ``meta[name]``, noted as what this tensor's views are made from."""
        t, m = tensors[name], meta[name]
        if name not in self.tensors:
            self.tensors[name] = (t, t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            self.meta[name] = m
        return t, m


def _cached_ops(
    staging: dict[Any, torch.Tensor] | None,
    key: Any,
    plan: TransferPlan,
    params: tuple[Any, ...],
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    build: Callable[[_Ops], None],
) -> _Ops:
    store = cast(dict[Any, Any] | None, staging)
    entry = store.get(key) if store is not None else None
    if isinstance(entry, _Ops) and entry.valid(plan, params, tensors, meta):
        return entry
    entry = _Ops(plan, params, {}, {}, [])
    build(entry)
    if store is not None:
        store[key] = entry
    return entry


def send_slices(
    pg: Any,
    plan: TransferPlan,
    ranks: GroupRanks,
    source: int,
    local: Mapping[str, torch.Tensor],
    holdings: Mapping[str, Box],
    *,
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    staging: dict[Any, torch.Tensor] | None = None,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
    buckets: Buckets = (),
) -> int:
    """Send what the plan gives trainer rank ``source``: ``local[name]`` is its shard of tensor
    ``name``, the region ``holdings[name]`` of the full tensor. A region contiguous in the shard is
    sent from it; any other is copied once, into its place in a message (a region travelling alone
    is copied once for all its destinations). With ``buckets`` each worker's part goes as the
    buckets it names, each announced on its own before its messages (the worker receives one bucket
    at a time, ``receive_slices`` per bucket). Returns the bytes sent (a transfer to k workers
    counted k times)."""

    def build(into: _Ops) -> None:
        alone: dict[Transfer, torch.Tensor] = {}  # the message of a transfer travelling alone

        def region(t: Transfer) -> torch.Tensor:
            shard, held = into.track(local, holdings, t.tensor)
            return _region(shard, t.box, [a for a, _ in held])

        for worker, bucket, index, message in send_sequence(
            plan, ranks, source, max_message_bytes, direct_min_bytes, buckets
        ):
            dst = ranks.of_worker(worker)
            t = message[0]
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            if _alone(t, direct_min_bytes):
                buf = alone.get(t)
                if buf is None:
                    r = region(t)
                    if r.is_contiguous():
                        buf = r
                    else:
                        buf = _buffer(staging, ("alone", worker, bucket, index), t.nbytes, r.device)
                        copies.append((_view(buf, 0, t, r.dtype), r))
                    alone[t] = buf
            else:
                buf = _buffer(
                    staging, (worker, bucket, index), sum(t.nbytes for t in message), region(t).device
                )
                offset = 0
                for t in message:
                    r = region(t)
                    copies.append(_packed(buf, offset, t, r, r.dtype))
                    offset += t.nbytes
            # The announcement goes out before the copies are made: its last byte is read from the
            # region itself.
            last = last_byte(region(message[-1]))
            into.ops.append((dst, buf, copies, sum(t.nbytes for t in message), worker, last))
            into.rounds.append(bucket)

    params = ("send", ranks, source, max_message_bytes, direct_min_bytes, buckets)
    works, sent = [], 0
    entry = _cached_ops(staging, ("ops", "send", source), plan, params, local, holdings, build)
    ops, rounds = entry.ops, entry.rounds
    start = 0
    while start < len(ops):
        # One bucket round: its announcements first, then its messages (each worker reads a
        # bucket's announcement, then that bucket's messages, then the next bucket's announcement).
        end = start
        while end < len(ops) and rounds[end] == rounds[start]:
            end += 1
        streams: dict[int, tuple[str, list[tuple[int, torch.Tensor]]]] = {}
        for dst, _, _, nbytes, worker, last in ops[start:end]:
            assert last is not None
            streams.setdefault(dst, (worker, []))[1].append((nbytes, last))
        for dst, (worker, listed) in streams.items():
            note = announce(listed, ops[0][1].device)
            works.append(post(lambda b=note, d=dst: pg.send([b], d, 0), f"announcing to {worker}"))
        for dst, buf, copies, nbytes, worker, _ in ops[start:end]:
            for to, frm in copies:
                to.copy_(frm)
            works.append(post(lambda b=buf, d=dst: pg.send([b], d, 0), f"send to {worker}"))
            sent += nbytes
        start = end
    for work in works:
        wait(work, timeout_s, "a send")
    return sent


@dataclasses.dataclass(frozen=True)
class Writes:
    """How a worker's receive reaches its kept tensors: ``before`` is called once before the first
    byte may land there; with ``deferred`` (a list) and a process group that stages receives
    (``isolated_gloo``), nothing lands during the receive: what lands the bytes (``before`` first)
    is appended to ``deferred``, for the caller to run when the update commits."""

    before: Callable[[], None] | None = None
    deferred: list[Callable[[], None]] | None = None


def kept_region(kept: torch.Tensor, owned: OwnedTensor, box: Box) -> torch.Tensor:
    """Where region ``box`` of the full tensor lies in the worker's kept tensor (its pieces
    concatenated along their dimension, in manifest order)."""
    if not owned.pieces:
        return _region(kept, box, [0] * len(box))
    d = owned.pieces[0].dim
    base = 0
    for p in owned.pieces:
        if p.offset <= box[d][0] < p.end:
            origin = [0] * len(box)
            origin[d] = p.offset - base
            return _region(kept, box, origin)
        base += p.length
    raise ValueError(f"{owned.name}: region {box} is in none of the pieces this worker keeps")


def receive_slices(
    pg: Any,
    plan: TransferPlan,
    ranks: GroupRanks,
    worker: str,
    kept: Mapping[str, torch.Tensor],
    owned: Mapping[str, OwnedTensor],
    *,
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    staging: dict[Any, torch.Tensor] | None = None,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
    writes: Writes | None = None,
    stopped: Callable[[], bool] | None = None,
) -> int:
    """Receive every region the plan sends ``worker`` into ``kept`` (by tensor name). Returns the
    bytes received. Every source's announcement is checked first (``Arrivals.open``: a source with
    another plan or a short announcement is refused before anything lands); then
    ``writes.before`` is called, and the bytes land (on a process group that stages receives,
    only once every message arrived whole, or later: ``Writes``, ``_receive_messages``). A message
    that arrives short raises MESSAGE_TRUNCATED before its bytes are counted or copied on. With
    ``stopped``, the wait for the announcements ends with CANCELLED as soon as ``stopped()`` (``watch_receives``); the
    receives into the kept tensors that follow wait for their senders, their sockets closing or
    the timeout."""

    def build(into: _Ops) -> None:
        def region(t: Transfer) -> torch.Tensor:
            k, o = into.track(kept, owned, t.tensor)
            return kept_region(k, o, t.box)

        for source in range(ranks.trainers):
            for index, message in enumerate(
                messages(plan, source, worker, max_message_bytes, direct_min_bytes)
            ):
                t = message[0]
                nbytes = sum(t.nbytes for t in message)
                copies: list[tuple[torch.Tensor, torch.Tensor]] = []
                if _alone(t, direct_min_bytes) and (r := region(t)).is_contiguous():
                    target = r  # received in place
                else:
                    target = _buffer(staging, (source, index), nbytes, region(t).device)
                    offset = 0
                    for t in message:
                        r = region(t)
                        wire = dtypes.to_torch(owned[t.tensor].dtype)
                        into_message, into_region = _packed(target, offset, t, r, wire)
                        copies.append((into_region, into_message))
                        offset += t.nbytes
                into.ops.append((source, target, copies, nbytes, f"trainer rank {source}", None))

    params = ("receive", ranks, worker, max_message_bytes, direct_min_bytes)
    ops = _cached_ops(staging, ("ops", "receive", worker), plan, params, kept, owned, build).ops
    sizes: dict[int, list[int]] = {}
    indices: list[int] = []  # each op's index among its source's messages
    for source, _, _, nbytes, _, _ in ops:
        indices.append(len(sizes.setdefault(source, [])))
        sizes[source].append(nbytes)
    arrivals = {s: Arrivals(n, ops[0][1].device, f"trainer rank {s}") for s, n in sizes.items()}
    notes = []
    for source, a in arrivals.items():
        notes.append(post(lambda b=a.buffer, s=source: pg.recv([b], s, 0), f"announcement from {a.what}"))
    whats = [(f"the announcement from {a.what}", {"trainer_rank": str(s)}) for s, a in arrivals.items()]
    watch_receives(notes, timeout_s, whats, stopped)
    for a in arrivals.values():
        a.open()
    return _receive_messages(pg, ops, indices, arrivals, timeout_s, writes or Writes(), stopped)


def _receive_messages(
    pg: Any,
    ops: Sequence[Op],
    indices: Sequence[int],
    arrivals: Mapping[int, Arrivals],
    timeout_s: float,
    writes: Writes,
    stopped: Callable[[], bool] | None,
) -> int:
    """Post and wait for every message of ``ops`` (the announcements were checked), each checked
    whole. A process group that stages receives (a worker's isolated gloo, ``isolated_gloo``) keeps
    every message out of the kept tensors until all of them arrived whole, so a failed update
    leaves the model as it was, and a wait may then end with CANCELLED as soon as ``stopped()``
    (a receive given up on lands nowhere); otherwise bytes land as they arrive, after
    ``writes.before``, and each receive waits for its sender, its sockets closing or the timeout."""
    staged = bool(getattr(pg, "stages_receives", False))
    if writes.before is not None and not staged:
        writes.before()
    works = []
    for (source, target, _, _, peer, _), index in zip(ops, indices, strict=True):
        if staged:
            # Primed where the bytes are held: ``target`` may be the model's own tensor (a region
            # received in place), which a failed update must leave as it was, byte for byte.
            last = arrivals[source].primed(index, target)
            receive = functools.partial(pg.recv_staged, [target], source, 0, last_byte=last)
        else:
            arrivals[source].prime(index, target)
            receive = functools.partial(pg.recv, [target], source, 0)
        works.append(post(receive, f"receive from {peer}"))
    received = 0
    for work, (source, target, copies, nbytes, peer, _), index in zip(works, ops, indices, strict=True):
        wait(
            work,
            timeout_s,
            f"a receive from {peer}",
            stopped if staged else None,
            metadata={"trainer_rank": str(source)},
        )
        arrivals[source].check(index, work.staged if staged else target)
        if not staged:
            for to, frm in copies:
                to.copy_(frm)
        received += nbytes
    if staged:

        def land() -> None:
            if writes.before is not None:
                writes.before()
            for work, (_, _, copies, _, _, _) in zip(works, ops, strict=True):
                work.land()
                for to, frm in copies:
                    to.copy_(frm)

        if writes.deferred is None:
            land()
        else:
            writes.deferred.append(land)
    return received
