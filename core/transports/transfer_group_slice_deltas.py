"""Every trainer rank a source, as a delta: each region's changes (a ``SliceTransfer.delta``) instead
of its bytes, over the same group and plan as ``transfer_group_slices``.

In a delta update every region of a slices bucket carries a ``TensorDelta`` whose target is the
region (its elements in row-major order; a region the trainer has no base for goes as a DENSE one,
its values being its bytes). What one source sends one worker is then one **stream**: the encodings
of the regions it sends that worker, in plan order, each starting at a multiple of ``ALIGN`` bytes
(``stream_layout``). Both sides derive every size from the ``TensorDelta``s alone
(``encoded_nbytes``: the layout ``weightwire.core.delta.wire.pack_delta`` writes at offset 0, no
stated size trusted), so the worker knows what to receive before a byte moves. A stream travels as
messages of at most ``max_message_bytes`` (``chunks``), announced and checked whole like any
message of a group (``weightwire.core.transports.whole_messages``), into a buffer of the worker's
own: no byte reaches the model during the receive, so the worker checks every delta against its
region before anything is written, and writes (applies) only when the update commits.

The trainer's ranks call ``send_streams`` (``weightwire.client.ranks.slice_deltas``), the worker
``receive_streams`` (``weightwire.server.transports.transfer_group_slice_deltas``). Pure
torch.distributed (gloo here; NCCL takes the same calls with the buffers on the GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from weightwire.core.delta.errors import invalid_delta
from weightwire.core.transports.transfer_group_slices import GroupRanks, send_order
from weightwire.core.transports.transfer_group_waits import post, wait, watch_receives
from weightwire.core.transports.whole_messages import Arrivals, announce, last_byte
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["ALIGN", "chunks", "encoded_nbytes", "receive_streams", "send_streams", "stream_layout"]

# Where each region's encoding starts in a stream: a multiple of this (any element's alignment).
ALIGN = 64
_INDEX_BYTES = {pb.DTYPE_INT32: 4, pb.DTYPE_INT64: 8}


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def encoded_nbytes(msg: pb.TensorDelta, numel: int, itemsize: int, **where: str) -> int:
    """The bytes of a region's encoding as ``pack_delta`` lays it out at offset 0, from the counts
    and dtypes alone: INVALID_DELTA for an unknown encoding or index dtype, a count outside
    [0, numel] (DENSE: exactly numel), or values not where that layout puts them."""
    label = ", ".join(f"{k} {v}" for k, v in where.items()) or "region"
    count = msg.changed_count
    if not 0 <= count <= numel:
        raise invalid_delta(f"{label}: changed_count {count} outside [0, {numel}]", **where)
    if msg.encoding == pb.DELTA_ENCODING_DENSE:
        if count != numel:
            raise invalid_delta(f"{label}: a dense delta changes all {numel} elements, not {count}", **where)
        first, values_at = 0, 0
    elif msg.encoding == pb.DELTA_ENCODING_BITMAP:
        first = (numel + 7) // 8
        values_at = _align(first, itemsize)
    elif msg.encoding == pb.DELTA_ENCODING_INDICES:
        index_bytes = _INDEX_BYTES.get(msg.index_dtype)
        if index_bytes is None:
            raise invalid_delta(f"{label}: index dtype must be DTYPE_INT32 or DTYPE_INT64", **where)
        first = count * index_bytes
        values_at = _align(first, itemsize)
    else:
        raise invalid_delta(f"{label}: delta encoding {msg.encoding} is not one this worker knows", **where)
    if msg.values_offset_bytes != values_at:
        raise invalid_delta(
            f"{label}: values at byte {msg.values_offset_bytes} of the region's encoding; a region's values "
            f"follow its {'indices' if first and msg.encoding == pb.DELTA_ENCODING_INDICES else 'bitmap' if first else 'start'} "
            f"at byte {values_at}",
            **where,
        )
    return values_at + count * itemsize


def stream_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each of a stream's encodings (of ``sizes`` bytes, in order) starts, and the stream's
    bytes: each at the next multiple of ``ALIGN``, the stream ending with the last one."""
    offsets: list[int] = []
    end = 0
    for size in sizes:
        at = _align(end, ALIGN)
        offsets.append(at)
        end = at + size
    return offsets, end


def chunks(nbytes: int, max_message_bytes: int) -> list[tuple[int, int]]:
    """The ``(offset, size)`` of the messages a stream of ``nbytes`` travels as (none when empty)."""
    return [(a, min(max_message_bytes, nbytes - a)) for a in range(0, nbytes, max_message_bytes)]


def send_streams(
    pg: Any,
    ranks: GroupRanks,
    source: int,
    streams: Mapping[str, torch.Tensor],
    *,
    timeout_s: float,
    max_message_bytes: int,
) -> int:
    """Send trainer rank ``source``'s stream to each worker of ``streams`` (flat uint8, one per
    worker it sends any region; an empty one is announced as no message), the workers in
    ``send_order``; returns the bytes sent."""
    order = [w for w in send_order(ranks, source) if w in streams]
    works = []
    sent = 0
    for worker in order:
        buf = streams[worker]
        parts = [buf[a : a + n] for a, n in chunks(buf.numel(), max_message_bytes)]
        note = announce([(p.numel(), last_byte(p)) for p in parts], buf.device)
        dst = ranks.of_worker(worker)
        works.append(post(lambda b=note, d=dst: pg.send([b], d, 0), f"announcing to {worker}"))
        for p in parts:
            works.append(post(lambda b=p, d=dst: pg.send([b], d, 0), f"send to {worker}"))
            sent += p.numel()
    for work in works:
        wait(work, timeout_s, "a send")
    return sent


def receive_streams(
    pg: Any,
    sizes: Mapping[int, int],
    device: torch.device,
    *,
    timeout_s: float,
    max_message_bytes: int,
    stopped: Callable[[], bool] | None = None,
) -> dict[int, torch.Tensor]:
    """Receive from each trainer rank of ``sizes`` its stream of that many bytes into a buffer of
    this worker's on ``device``; each source's announcement is checked first (another plan, a
    short announcement: refused before anything lands), then every message whole
    (MESSAGE_TRUNCATED). The buffers are not the model, so a process group that stages receives
    (a worker's isolated gloo) lands each message in them as soon as it arrived whole, and every
    wait ends with CANCELLED as soon as ``stopped()``."""
    buffers = {s: torch.empty(n, dtype=torch.uint8, device=device) for s, n in sizes.items()}
    parts = {s: [buffers[s][a : a + n] for a, n in chunks(sizes[s], max_message_bytes)] for s in sizes}
    arrivals = {s: Arrivals([p.numel() for p in parts[s]], device, f"trainer rank {s}") for s in sizes}
    notes = [
        post(lambda b=a.buffer, s=s: pg.recv([b], s, 0), f"announcement from {a.what}")
        for s, a in arrivals.items()
    ]
    whats = [(f"the announcement from {a.what}", {"trainer_rank": str(s)}) for s, a in arrivals.items()]
    watch_receives(notes, timeout_s, whats, stopped)
    for a in arrivals.values():
        a.open()
    staged = bool(getattr(pg, "stages_receives", False))
    posted = []
    for s, listed in parts.items():
        for index, p in enumerate(listed):
            arrivals[s].prime(index, p)
            recv = pg.recv_staged if staged else pg.recv
            posted.append(
                (s, index, p, post(lambda b=p, s=s, r=recv: r([b], s, 0), f"receive from trainer rank {s}"))
            )
    for s, index, p, work in posted:
        wait(
            work,
            timeout_s,
            f"a receive from trainer rank {s}",
            stopped if staged else None,
            metadata={"trainer_rank": str(s)},
        )
        arrivals[s].check(index, work.staged if staged else p)
        if staged:
            work.land()
    return buffers
