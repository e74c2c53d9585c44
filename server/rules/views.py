"""Where a bucket's owned tensors lie, how their bytes are fetched, and the tensor views over them.

``weightwire.server.rules.layout`` builds a ``ViewItem`` per owned tensor when it first checks a bucket
layout; ``weightwire.server.worker.update`` asks the layout for a ``ReadPlan`` that fits the opened
payload, has the payload fetch each ``ReadBatch`` (``ImportedPayload.fetch``), and hands
``views_over`` of the fetched bytes to the engine.

Two kinds of payload: one whose bytes are already in this process's memory (inline bytes, a CUDA
IPC storage) is viewed in place, as one batch whose positions are the tensors' own offsets. One
whose bytes must be copied in (host shared memory, read with ``pread`` so that a segment that
shrinks cannot fault the worker) gets batches of at most ``copy_chunk_bytes``: only the owned byte
ranges are read, packed one after another into a staging buffer (gaps below ``MAX_GAP_BYTES`` are
read along rather than split), so the staging memory stays bounded however large the bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, cast, runtime_checkable

import torch
from weightwire.core.capabilities import has_capability
from weightwire.core.errors import Reason, WeightwireError

# Segments of a copying read start at multiples of this, in the payload and in the staging buffer,
# so every tensor keeps its alignment (no dtype has a larger element).
ALIGN_BYTES = 64
# Owned byte ranges closer than this are read as one (a syscall costs more than a few KiB).
MAX_GAP_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class ViewItem:
    """Where one tensor lies in a payload, with its contiguous strides worked out once."""

    offset_bytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, offset_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> ViewItem:
        stride: list[int] = []
        step = 1
        for d in reversed(shape):
            stride.append(step)
            step *= max(d, 1)
        numel = 1
        for d in shape:
            numel *= d
        return cls(offset_bytes, dtype, shape, tuple(reversed(stride)), numel)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Payload bytes [start, end) go to ``staging_at`` in the staging buffer."""

    start: int
    end: int
    staging_at: int


@dataclasses.dataclass(frozen=True)
class ReadBatch:
    """Tensors fetched and loaded together. ``positions[i]`` is where ``items[i]`` starts in the
    fetched bytes; ``segments`` (empty for in-place payloads) what a copying payload reads."""

    names: tuple[str, ...]
    items: tuple[ViewItem, ...]
    positions: tuple[int, ...]
    segments: tuple[Segment, ...]
    size_bytes: int


ReadPlan = tuple[ReadBatch, ...]


def in_place_plan(names: Sequence[str], items: Sequence[ViewItem]) -> ReadPlan:
    """One batch over the payload as it is: every tensor at its own offset."""
    end = max((i.offset_bytes + i.nbytes for i in items), default=0)
    return (ReadBatch(tuple(names), tuple(items), tuple(i.offset_bytes for i in items), (), end),)


def _align_up(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def copy_plan(names: Sequence[str], items: Sequence[ViewItem], chunk_bytes: int) -> ReadPlan:
    """Batches of at most ``chunk_bytes`` of staging (a tensor larger than that gets one alone),
    reading only the owned ranges, in payload order."""
    order = sorted(range(len(items)), key=lambda k: items[k].offset_bytes)
    batches: list[ReadBatch] = []
    b_names: list[str] = []
    b_items: list[ViewItem] = []
    b_pos: list[int] = []
    segs: list[Segment] = []
    size = 0

    def close() -> None:
        nonlocal size
        if b_items:
            batches.append(ReadBatch(tuple(b_names), tuple(b_items), tuple(b_pos), tuple(segs), size))
        b_names.clear()
        b_items.clear()
        b_pos.clear()
        segs.clear()
        size = 0

    for k in order:
        item = items[k]
        end = item.offset_bytes + item.nbytes
        last = segs[-1] if segs else None
        if (
            last is not None
            and item.offset_bytes - last.end <= MAX_GAP_BYTES
            and last.staging_at + (max(end, last.end) - last.start) <= chunk_bytes
        ):
            # Extend the last segment over the gap (and this tensor).
            grown = Segment(last.start, max(end, last.end), last.staging_at)
            segs[-1] = grown
            pos = grown.staging_at + item.offset_bytes - grown.start
            size = max(size, grown.staging_at + grown.end - grown.start)
        else:
            start = item.offset_bytes - item.offset_bytes % ALIGN_BYTES
            at = _align_up(size)
            if b_items and at + (end - start) > chunk_bytes:
                close()
                at = 0
            segs.append(Segment(start, end, at))
            pos = at + item.offset_bytes - start
            size = at + end - start
        b_names.append(names[k])
        b_items.append(item)
        b_pos.append(pos)
    close()
    return tuple(batches)


# Batches whose views one mapping keeps (a staging buffer of a packed push of a large model serves
# up to a few hundred layouts); beyond this the memo starts over.
MAX_MEMO_BATCHES = 512


class _Fetches(Protocol):
    def fetch(self, batch: ReadBatch) -> torch.Tensor: ...


@dataclasses.dataclass
class _Kept:
    """What a mapping remembers for one batch: the batch itself (so its id stays its own), the
    views over the mapping, and each adapter's prepared load of them (``prepare_load``), by
    adapter id with the adapter held for the same reason."""

    batch: ReadBatch
    views: list[torch.Tensor]
    loads: dict[int, tuple[object, Callable[[], None]]] = dataclasses.field(default_factory=dict)


@runtime_checkable
class KeepsViews(Protocol):
    """A mapping whose bytes stay where they are while it is kept: views of a batch are built once
    and kept in ``view_memo`` (keyed by the batch's id) for as long as the mapping lives; a mapping
    of that type whose bytes may move this time has ``view_memo`` None."""

    view_memo: dict[int, object] | None


@runtime_checkable
class PlacesViews(Protocol):
    """A mapping of several storages (CUDA IPC of a trainer's own parameters) that places each
    tensor in its own storage itself."""

    def views_of(self, batch: ReadBatch) -> list[torch.Tensor]: ...


def _kept(mapping: object, batch: ReadBatch) -> _Kept | None:
    memo = cast(KeepsViews, mapping).view_memo if has_capability(mapping, KeepsViews) else None
    kept = memo.get(id(batch)) if memo is not None else None
    return kept if isinstance(kept, _Kept) and kept.batch is batch else None


def batch_views(mapping: _Fetches, batch: ReadBatch) -> list[torch.Tensor]:
    """``views_over`` the bytes ``mapping.fetch(batch)`` gives, for every tensor of ``batch``.

    ``fetch`` runs every time (it is where a mapping reads, or waits for its producer). A mapping
    whose bytes stay where they are for as long as it is kept (a CUDA IPC storage; the host
    shared-memory importer's staging buffer, which each batch is read to the same place of) has a
    ``view_memo`` dict: the views of a batch are built once and reused for the same batch (the
    layout's read plan, which the layout cache keeps) while the mapping lives, instead of one
    ``as_strided`` per tensor per bucket.
    """
    base = mapping.fetch(batch)
    kept = _kept(mapping, batch)
    if kept is not None:
        return kept.views
    # A payload of several storages (CUDA IPC of a trainer's own parameters) places each tensor in
    # its own storage, and refuses rather than copies a misaligned one.
    places = has_capability(mapping, PlacesViews)
    views = (
        cast(PlacesViews, mapping).views_of(batch)
        if places
        else views_over(base, batch.positions, batch.items)
    )
    memo = cast(KeepsViews, mapping).view_memo if has_capability(mapping, KeepsViews) else None
    if memo is None:
        return views
    storage = base.untyped_storage().data_ptr()
    if not places and any(v.numel() and v.untyped_storage().data_ptr() != storage for v in views):
        return views  # a misaligned tensor was copied out: its bytes are this bucket's only
    if len(memo) >= MAX_MEMO_BATCHES:
        memo.clear()
    memo[id(batch)] = _Kept(batch, views)
    return views


@runtime_checkable
class PreparesLoads(Protocol):
    """An adapter whose ``load`` can be split: its checks and slicing once, its copies many times."""

    def prepare_load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Callable[[], None]:
        """``load``'s checks and slicing now; the returned function does its copies (finished on the
        device when it returns) each time it is called (``TorchAdapter`` does this)."""
        ...


class _Loads(Protocol):
    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None: ...


def batch_load(
    mapping: object, batch: ReadBatch, views: list[torch.Tensor], adapter: _Loads
) -> Callable[[], None]:
    """The call that loads ``views`` (``batch_views(mapping, batch)``) into ``adapter``.

    For remembered views and an adapter with ``prepare_load`` (its checks and slicing up front, the
    copies on each call), the prepared load is made once and kept with the views; otherwise it is
    ``adapter.load`` of the named views, as every time before.
    """
    named = list(zip(batch.names, views, strict=True))
    kept = _kept(mapping, batch)
    if not has_capability(adapter, PreparesLoads) or kept is None or kept.views is not views:
        return lambda: adapter.load(named)
    known = kept.loads.get(id(adapter))
    if known is not None and known[0] is adapter:
        return known[1]
    load = cast(PreparesLoads, adapter).prepare_load(named)
    kept.loads[id(adapter)] = (adapter, load)
    return load


def views_over(base: torch.Tensor, positions: Sequence[int], items: Sequence[ViewItem]) -> list[torch.Tensor]:
    """The tensor of each item, lying at ``positions[i]`` in the uint8 tensor ``base``.

    Aligned, non-empty items are one ``as_strided`` of a typed view of ``base`` each (no copy); an
    item whose position is not a multiple of its element size is copied once (a view needs element
    alignment). Read the views, never write them.
    """
    size = base.numel()
    typed: dict[torch.dtype, torch.Tensor | None] = {}
    out: list[torch.Tensor] = []
    for item, pos in zip(items, positions, strict=True):
        itemsize = item.dtype.itemsize
        nbytes = item.numel * itemsize
        if pos < 0 or pos + nbytes > size:
            # The rules checked bounds already; this guards the pointer arithmetic below.
            raise WeightwireError(Reason.TENSOR_OUT_OF_BOUNDS, f"view [{pos}, +{nbytes}) beyond {size} bytes")
        if item.numel == 0:
            out.append(torch.empty(item.shape, dtype=item.dtype, device=base.device))
            continue
        if item.dtype in typed:
            t = typed[item.dtype]
        else:
            usable = size - size % itemsize
            t = base[:usable].view(item.dtype) if base.data_ptr() % itemsize == 0 and usable > 0 else None
            typed[item.dtype] = t
        if t is None or pos % itemsize:
            out.append(base[pos : pos + nbytes].clone().view(item.dtype).view(item.shape))
        else:
            out.append(t.as_strided(item.shape, item.stride, t.storage_offset() + pos // itemsize))
    return out
