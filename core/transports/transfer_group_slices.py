"""Every trainer rank a source: a ``TransferPlan`` carried out over a transfer group's process group.

Each trainer rank sends only the regions of its own shards that the plan gives it (no gather to
rank 0), each worker receives exactly the regions of its slices (``bytes received == its manifest's
kept bytes``) and writes them into its kept tensors (a tensor kept as several pieces is held as their
concatenation along the pieces' dimension, in the manifest's order: the layout of a fused q/k/v or
gate/up parameter, and of a TP shard).

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
from weightwire.core.transports.transfer_plan import Box, Transfer, TransferPlan, TransferPlanError

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


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


def messages(plan: TransferPlan, source: int, worker: str, max_message_bytes: int) -> list[list[Transfer]]:
    """The transfers ``source`` sends ``worker``, in plan order, grouped into messages."""
    out: list[list[Transfer]] = []
    size = 0
    for t in plan.transfers:
        if t.source != source or worker not in t.destinations:
            continue
        if not out or size + t.nbytes > max_message_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.nbytes
    return out


def agree(pg: Any, plan: TransferPlan, rank: int, world_size: int, timeout_s: float) -> None:
    """Every member's plan fingerprint against every other's; ``GROUP_PLAN_MISMATCH`` on every
    member naming the ranks that differ from this one."""
    mine = torch.frombuffer(bytearray(bytes.fromhex(plan.fingerprint)), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    pg.allgather([gathered], [mine]).wait(datetime.timedelta(seconds=timeout_s))
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


def send_slices(
    pg: Any, plan: TransferPlan, ranks: GroupRanks, source: int, local: Mapping[str, torch.Tensor],
    holdings: Mapping[str, Box], *, timeout_s: float, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> int:
    """Send what the plan gives trainer rank ``source``: ``local[name]`` is its shard of tensor
    ``name``, the region ``holdings[name]`` of the full tensor. Returns the bytes sent."""
    works, sent = [], 0
    for worker in ranks.workers:
        for message in messages(plan, source, worker, max_message_bytes):
            parts = [
                _region(local[t.tensor], t.box, [a for a, _ in holdings[t.tensor]]).contiguous().reshape(-1).view(torch.uint8)
                for t in message
            ]
            buf = torch.cat(parts) if len(parts) > 1 else parts[0]
            works.append((pg.send([buf], ranks.of_worker(worker), 0), buf))
            sent += buf.numel()
    for work, _ in works:
        work.wait(datetime.timedelta(seconds=timeout_s))
    return sent


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
    pg: Any, plan: TransferPlan, ranks: GroupRanks, worker: str, kept: Mapping[str, torch.Tensor],
    owned: Mapping[str, OwnedTensor], *, timeout_s: float, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> int:
    """Receive every region the plan sends ``worker`` into ``kept`` (by tensor name). Returns the
    bytes received."""
    posted = []
    for source in range(ranks.trainers):
        for message in messages(plan, source, worker, max_message_bytes):
            buf = torch.empty(sum(t.nbytes for t in message), dtype=torch.uint8)
            posted.append((pg.recv([buf], source, 0), buf, message))
    received = 0
    for work, buf, message in posted:
        work.wait(datetime.timedelta(seconds=timeout_s))
        offset = 0
        for t in message:
            o = owned[t.tensor]
            shape = [b - a for a, b in t.box]
            data = buf[offset:offset + t.nbytes].view(dtypes.to_torch(o.dtype)).reshape(shape)
            kept_region(kept[t.tensor], o, t.box).copy_(data)
            offset += t.nbytes
        received += buf.numel()
    return received
