"""Every trainer rank a source: a ``TransferPlan`` carried out over a transfer group's process group.

Each trainer rank sends only the regions of its own shards that the plan gives it (no gather to
rank 0), each worker receives exactly the regions of its slices (``bytes received == its manifest's
kept bytes``) and writes them into its kept tensors (a tensor kept as several pieces is held as their
concatenation along the pieces' dimension, in the manifest's order: the layout of a fused q/k/v or
gate/up parameter, and of a TP shard).

Buffers can be kept across updates (``staging``: memory of one update's messages, for speed).
Both sides derive the messages from the plan alone: what one source sends one worker is the plan's
transfers between them, in plan order, packed back to back and cut into messages of at most
``max_message_bytes`` (a transfer larger than that travels alone). Every member first compares the
plan's fingerprint with every other member (``agree``), so a member with another plan refuses
before a byte moves instead of pairing the wrong bytes.

Not yet wired into ``WeightPusher.push`` (the gRPC plan, acks and commit of a multi-source update);
this is the data plane that push will drive. Pure torch.distributed: any process group with
``send``/``recv``/``allgather`` (``ProcessGroupGloo`` here, ``ProcessGroupNCCL`` on GPUs).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from weightwire.core import dtypes
from weightwire.core.errors import Reason
from weightwire.core.manifest import OwnedTensor
from weightwire.core.transports.transfer_group import transfer_error
from weightwire.core.transports.transfer_plan import Box, Transfer, TransferPlan, TransferPlanError

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# Below this a region of whole rows is still packed with its neighbours: a message per small region
# would cost more in per-message work than the copy it saves.
DIRECT_MIN_BYTES = 256 << 10


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
) -> list[list[Transfer]]:
    """The transfers ``source`` sends ``worker``, in plan order, grouped into messages. A transfer
    of whole rows (``Transfer.rows``) of at least ``direct_min_bytes`` is a message of its own, sent
    from the shard and received into the kept tensor in place; the others are packed together."""
    out: list[list[Transfer]] = []
    size = 0
    packing = False
    for t in plan.transfers:
        if t.source != source or worker not in t.destinations:
            continue
        if _direct(t, direct_min_bytes):
            out.append([t])
            packing = False
            continue
        if not packing or size + t.nbytes > max_message_bytes:
            out.append([])
            size = 0
            packing = True
        out[-1].append(t)
        size += t.nbytes
    return out


def _direct(t: Transfer, direct_min_bytes: int) -> bool:
    return t.rows and t.nbytes >= direct_min_bytes


def agree(pg: Any, plan: TransferPlan, rank: int, world_size: int, timeout_s: float) -> None:
    """Every member's plan fingerprint against every other's; ``GROUP_PLAN_MISMATCH`` on every
    member naming the ranks that differ from this one."""
    mine = torch.frombuffer(bytearray(bytes.fromhex(plan.fingerprint)), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    try:
        pg.allgather([gathered], [mine]).wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise transfer_error(e, "comparing transfer plans") from None
    differ = [r for r, g in enumerate(gathered) if not torch.equal(g, mine)]
    if differ:
        raise TransferPlanError(
            Reason.GROUP_PLAN_MISMATCH,
            f"group rank {rank}'s transfer plan {plan.fingerprint} differs from that of rank(s) {differ}; "
            "every member must plan from the same holdings and manifests",
            ranks=",".join(map(str, differ)),
        )


def _region(t: torch.Tensor, box: Box, origin: Sequence[int]) -> torch.Tensor:
    for d, ((a, b), o) in enumerate(zip(box, origin, strict=True)):
        t = t.narrow(d, a - o, b - a)
    return t


def _buffer(staging: dict[Any, torch.Tensor] | None, key: Any, nbytes: int) -> torch.Tensor:
    """A message buffer of ``nbytes``, kept in ``staging`` across updates when the caller gives one
    (the same plan makes the same messages, so each buffer is reused as is; a fresh allocation per
    message and update is page faults on every byte)."""
    if staging is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    buf = staging.get(key)
    if buf is None or buf.numel() != nbytes:
        buf = staging[key] = torch.empty(nbytes, dtype=torch.uint8)
    return buf


def _view(buf: torch.Tensor, offset: int, t: Transfer, dtype: torch.dtype) -> torch.Tensor:
    return buf[offset : offset + t.nbytes].view(dtype).view([b - a for a, b in t.box])


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
) -> int:
    """Send what the plan gives trainer rank ``source``: ``local[name]`` is its shard of tensor
    ``name``, the region ``holdings[name]`` of the full tensor. Each region is copied once, into its
    place in the message. Returns the bytes sent."""
    works, sent = [], 0
    for worker in ranks.workers:
        for index, message in enumerate(messages(plan, source, worker, max_message_bytes, direct_min_bytes)):
            if _direct(message[0], direct_min_bytes):
                t = message[0]
                shard = local[t.tensor]
                view = _region(shard, t.box, [a for a, _ in holdings[t.tensor]]).contiguous()  # no copy: rows
                works.append(
                    _post(lambda v=view, w=worker: pg.send([v], ranks.of_worker(w), 0), f"send to {worker}")
                )
                sent += t.nbytes
                continue
            buf = _buffer(staging, (worker, index), sum(t.nbytes for t in message))
            offset = 0
            for t in message:
                shard = local[t.tensor]
                _view(buf, offset, t, shard.dtype).copy_(
                    _region(shard, t.box, [a for a, _ in holdings[t.tensor]])
                )
                offset += t.nbytes
            works.append(
                _post(lambda b=buf, w=worker: pg.send([b], ranks.of_worker(w), 0), f"send to {worker}")
            )
            sent += buf.numel()
    for work in works:
        _wait(work, timeout_s, "a send")
    return sent


def _post(op: Any, what: str) -> Any:
    """Post a send or receive; one the backend refuses at once (a peer already gone) is
    TRANSFER_FAILED, as a failed wait is."""
    try:
        return op()
    except RuntimeError as e:
        raise transfer_error(e, what) from None


def _wait(work: Any, timeout_s: float, what: str) -> None:
    """Wait for a posted operation within the group's timeout: a peer that died or never sends
    ends it with TRANSFER_FAILED (gloo fails a pending receive at once when its peer's sockets
    close, and at the timeout otherwise), never a hang."""
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise transfer_error(e, what) from None


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
) -> int:
    """Receive every region the plan sends ``worker`` into ``kept`` (by tensor name). Returns the
    bytes received."""
    posted: list[tuple[Any, torch.Tensor | None, list[Transfer]]] = []
    for source in range(ranks.trainers):
        for index, message in enumerate(messages(plan, source, worker, max_message_bytes, direct_min_bytes)):
            t = message[0]
            if (
                _direct(t, direct_min_bytes)
                and (region := kept_region(kept[t.tensor], owned[t.tensor], t.box)).is_contiguous()
            ):
                posted.append(
                    (
                        _post(
                            lambda r=region, s=source: pg.recv([r], s, 0),
                            f"receive from trainer rank {source}",
                        ),
                        None,
                        message,
                    )
                )
                continue
            staged = _buffer(staging, (source, index), sum(t.nbytes for t in message))
            posted.append(
                (
                    _post(
                        lambda b=staged, s=source: pg.recv([b], s, 0), f"receive from trainer rank {source}"
                    ),
                    staged,
                    message,
                )
            )
    received = 0
    for work, into, message in posted:
        _wait(work, timeout_s, f"a receive from trainer rank {message[0].source}")
        if into is None:  # received in place
            received += message[0].nbytes
            continue
        buf = into
        offset = 0
        for t in message:
            o = owned[t.tensor]
            kept_region(kept[t.tensor], o, t.box).copy_(_view(buf, offset, t, dtypes.to_torch(o.dtype)))
            offset += t.nbytes
        received += buf.numel()
    return received
