"""The M-to-N transfer plan as data: for every region of every tensor, which trainer rank sends it
to which workers. Pure: no I/O, no torch.

Inputs are what each side states about itself. A trainer rank *holds* a box of each tensor (one
index range per dimension): the local shard of a DTensor (``dtensor_box`` turns Shard / Replicate
placements on a device mesh into it, with torch's chunking), or the whole tensor. A worker *keeps*
the pieces its manifest lists (``OwnedTensor.pieces``; none: the whole tensor). The plan splits each
worker's needed boxes along the trainer's holding boundaries, so every needed element is in exactly
one transfer per worker; a region needed by several workers (TP ranks of a replicated tensor, the
same slice in every data-parallel replica) is one transfer with several destinations, which the
data plane may send as a broadcast. Among trainer ranks holding the same region (replicas) the
source is the one with the fewest bytes assigned so far, then the lowest rank, so no rank is a
funnel and the choice is the same on every member.

Every member computes the plan from the same inputs and compares ``TransferPlan.fingerprint``
before a byte moves (as group identities are compared now). When the trainer ranks do not cover
what a worker keeps, or a tensor's shape or dtype differs between the two sides, planning refuses
with a reason naming the tensor, the worker and the missing bytes.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
from collections.abc import Iterable, Mapping, Sequence

from weightwire.core import dtypes
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import OwnedTensor, ShardManifest

Interval = tuple[int, int]
"""``[start, stop)`` along one dimension."""
Box = tuple[Interval, ...]
"""One interval per dimension of a tensor."""


class TransferPlanError(WeightwireError):
    """A plan that cannot be made: the reason, and ``tensor`` / ``worker`` / ``missing_bytes``."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """DTensor ``Shard(dim)``: the mesh dimension splits tensor dimension ``dim`` into chunks."""

    dim: int


@dataclasses.dataclass(frozen=True)
class Replicate:
    """DTensor ``Replicate()``: every rank along the mesh dimension holds the same data."""


Placement = Shard | Replicate


def dtensor_box(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> Box | None:
    """The box the rank at ``coordinate`` of a device mesh holds of a DTensor of global ``shape``,
    or None when its chunk is empty. Placements apply in mesh-dimension order, each splitting what
    the ones before left (torch's ``DTensor`` semantics: ``torch.chunk`` sizes, ``ceil(n / m)`` per
    chunk, the last chunks short or empty). FSDP2 over TP uses ``_StridedShard`` for a tensor dimension
    sharded by both; that order is not this one, and such a trainer must state its boxes directly."""
    if not len(mesh_shape) == len(placements) == len(coordinate):
        raise ValueError(
            f"mesh {tuple(mesh_shape)}, placements {tuple(placements)} and coordinate {tuple(coordinate)} differ in length"
        )
    box = [(0, int(n)) for n in shape]
    for size, placement, index in zip(mesh_shape, placements, coordinate, strict=True):
        if not 0 <= index < size:
            raise ValueError(f"coordinate {tuple(coordinate)} outside mesh {tuple(mesh_shape)}")
        if isinstance(placement, Replicate):
            continue
        if not 0 <= placement.dim < len(shape):
            raise ValueError(f"Shard({placement.dim}) of a tensor of shape {tuple(shape)}")
        start, stop = box[placement.dim]
        chunk = -(-(stop - start) // size)
        lo = min(start + index * chunk, stop)
        box[placement.dim] = (lo, min(lo + chunk, stop))
    if any(b <= a for a, b in box):
        return None
    return tuple(box)


def whole_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def kept_boxes(owned: OwnedTensor) -> tuple[Box, ...]:
    """The boxes of ``owned``'s checkpoint tensor that its worker keeps."""
    full = whole_box(owned.shape)
    if not owned.pieces:
        return (full,)
    out = []
    for p in owned.pieces:
        box = list(full)
        box[p.dim] = (p.offset, p.end)
        out.append(tuple(box))
    return tuple(out)


def box_elements(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def byte_runs(box: Box, shape: Sequence[int], itemsize: int) -> list[tuple[int, int]]:
    """``(offset, length)`` in bytes of the contiguous runs ``box`` covers in a row-major tensor of
    ``shape``, in order (one run when the box spans whole trailing dimensions)."""
    if not box:
        return [(0, itemsize)]
    # The trailing dimensions the box spans whole, plus the first one it does not, form one run.
    split = len(shape) - 1
    while split > 0 and box[split] == (0, shape[split]):
        split -= 1
    inner = itemsize
    for n in shape[split + 1 :]:
        inner *= n
    run = (box[split][1] - box[split][0]) * inner
    strides = [0] * len(shape)
    acc = itemsize
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= shape[d]
    runs = []
    for outer in itertools.product(*(range(a, b) for a, b in box[:split])):
        base = sum(i * s for i, s in zip(outer, strides, strict=False)) + box[split][0] * strides[split]
        runs.append((base, run))
    return runs


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor as the trainer has it: checkpoint name, full shape, dtype, and the box each trainer
    rank holds (ranks holding nothing of it are absent)."""

    name: str
    shape: tuple[int, ...]
    dtype: int
    holdings: Mapping[int, Box]

    @classmethod
    def whole_on(cls, name: str, shape: Sequence[int], dtype: int, ranks: Iterable[int]) -> TensorSpec:
        box = whole_box(shape)
        return cls(name, tuple(shape), dtype, {r: box for r in ranks})

    @classmethod
    def dtensor(
        cls,
        name: str,
        shape: Sequence[int],
        dtype: int,
        mesh_shape: Sequence[int],
        placements: Sequence[Placement],
        ranks: Sequence[int] | None = None,
    ) -> TensorSpec:
        """Holdings of a DTensor over a mesh whose coordinates, in row-major order, are ``ranks``
        (default ``0 .. size - 1``)."""
        coords = list(itertools.product(*(range(n) for n in mesh_shape)))
        ranks = list(range(len(coords))) if ranks is None else list(ranks)
        if len(ranks) != len(coords):
            raise ValueError(f"{len(ranks)} ranks for a mesh of {len(coords)}")
        held = {}
        for rank, coord in zip(ranks, coords, strict=True):
            box = dtensor_box(shape, mesh_shape, placements, coord)
            if box is not None:
                held[rank] = box
        return cls(name, tuple(shape), dtype, held)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """``box`` of ``tensor``, sent by trainer rank ``source`` to every worker in ``destinations``."""

    tensor: str
    box: Box
    source: int
    destinations: tuple[str, ...]
    nbytes: int
    shape: tuple[int, ...] = ()
    """The full tensor's shape."""

    @property
    def rows(self) -> bool:
        """Whether ``box`` is a range of rows (every dimension after the first whole): then it is
        one contiguous run in the full tensor, in a ``Shard(0)`` holding and in a worker's tensor
        kept as rows, so it can travel without packing."""
        return len(self.shape) > 0 and all(
            iv == (0, n) for iv, n in zip(self.box[1:], self.shape[1:], strict=True)
        )


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    transfers: tuple[Transfer, ...]
    fingerprint: str

    def bytes_to(self) -> dict[str, int]:
        """Bytes each worker receives."""
        out: dict[str, int] = {}
        for t in self.transfers:
            for d in t.destinations:
                out[d] = out.get(d, 0) + t.nbytes
        return out

    def bytes_from(self) -> dict[int, int]:
        """Bytes each trainer rank sends, counting a transfer to k workers k times (point to point)."""
        out: dict[int, int] = {}
        for t in self.transfers:
            out[t.source] = out.get(t.source, 0) + t.nbytes * len(t.destinations)
        return out

    def for_worker(self, worker: str) -> list[Transfer]:
        return [t for t in self.transfers if worker in t.destinations]

    def for_source(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.source == rank]


class _Grid:
    """A tensor's index space cut at every boundary of every holding: each cell is held whole by
    the ranks listed for it (none: a gap)."""

    def __init__(self, spec: TensorSpec) -> None:
        self.cuts = [sorted({0, n}) for n in spec.shape]
        for rank, box in spec.holdings.items():
            if len(box) != len(spec.shape) or any(
                not 0 <= a < b <= n for (a, b), n in zip(box, spec.shape, strict=False)
            ):
                raise TransferPlanError(
                    Reason.INVALID_SHAPE,
                    f"{spec.name}: trainer rank {rank} states it holds {box}, not a box of shape {spec.shape}",
                    tensor=spec.name,
                )
            for d, (a, b) in enumerate(box):
                self.cuts[d].extend((a, b))
        self.cuts = [sorted(set(c)) for c in self.cuts]
        self.holders: dict[tuple[int, ...], list[int]] = {}
        for rank in sorted(spec.holdings):
            for cell in itertools.product(*(self._span(d, iv) for d, iv in enumerate(spec.holdings[rank]))):
                self.holders.setdefault(cell, []).append(rank)

    def _span(self, d: int, iv: Interval) -> range:
        cuts = self.cuts[d]
        return range(bisect.bisect_right(cuts, iv[0]) - 1, bisect.bisect_left(cuts, iv[1]))

    def cells(self, box: Box) -> Iterable[tuple[tuple[int, ...], Box]]:
        """The cells ``box`` overlaps, each with its intersection with ``box``."""
        spans = [self._span(d, iv) for d, iv in enumerate(box)]
        for cell in itertools.product(*spans):
            yield (
                cell,
                tuple(
                    (max(self.cuts[d][i], box[d][0]), min(self.cuts[d][i + 1], box[d][1]))
                    for d, i in enumerate(cell)
                ),
            )


def plan_transfers(tensors: Iterable[TensorSpec], workers: Mapping[str, ShardManifest]) -> TransferPlan:
    """The plan that gives every worker exactly what its manifest keeps of ``tensors`` (tensors no
    worker owns are not sent; a worker owning a tensor that is not among ``tensors`` gets nothing of
    it: a partial update). Raises ``TransferPlanError`` when the trainer ranks do not cover a needed
    region, or a tensor's shape or dtype differs from a worker's manifest."""
    assigned: dict[int, int] = {}
    transfers: list[Transfer] = []
    for spec in sorted(tensors, key=lambda s: s.name):
        needs: dict[tuple[tuple[int, ...], Box], list[str]] = {}
        grid: _Grid | None = None
        for worker in sorted(workers):
            owned = workers[worker].tensors.get(spec.name)
            if owned is None:
                continue
            _check_same_tensor(spec, owned, worker)
            if grid is None:
                grid = _Grid(spec)
            for box in kept_boxes(owned):
                for cell, part in grid.cells(box):
                    needs.setdefault((cell, part), []).append(worker)
        if grid is None:
            continue
        itemsize = dtypes.itemsize(spec.dtype)
        missing: dict[str, int] = {}
        for (cell, part), dests in sorted(needs.items()):
            holders = grid.holders.get(cell)
            nbytes = box_elements(part) * itemsize
            if not holders:
                for d in dests:
                    missing[d] = missing.get(d, 0) + nbytes
                continue
            source = min(holders, key=lambda r: (assigned.get(r, 0), r))
            assigned[source] = assigned.get(source, 0) + nbytes * len(dests)
            transfers.append(Transfer(spec.name, part, source, tuple(dests), nbytes, spec.shape))
        if missing:
            worker, nbytes = min(missing.items())
            held = "no trainer rank holds any" if not spec.holdings else "the trainer ranks do not hold all"
            raise TransferPlanError(
                Reason.INCOMPLETE_UPDATE,
                f"{spec.name}: {held} of what worker {worker} keeps ({nbytes} bytes missing; "
                f"{len(missing)} worker(s) short); every region a worker keeps must be held by some trainer rank",
                tensor=spec.name,
                worker=worker,
                missing_bytes=str(nbytes),
            )
    return TransferPlan(tuple(transfers), _fingerprint(transfers))


def _check_same_tensor(spec: TensorSpec, owned: OwnedTensor, worker: str) -> None:
    if tuple(owned.shape) != spec.shape:
        raise TransferPlanError(
            Reason.SHAPE_MISMATCH,
            f"{spec.name}: the trainer's tensor has shape {spec.shape}, worker {worker}'s manifest {tuple(owned.shape)}",
            tensor=spec.name,
            worker=worker,
        )
    if owned.dtype != spec.dtype:
        raise TransferPlanError(
            Reason.DTYPE_MISMATCH,
            f"{spec.name}: the trainer's tensor is {dtypes.name(spec.dtype)}, worker {worker} keeps "
            f"{dtypes.name(owned.dtype)}; cast before planning",
            tensor=spec.name,
            worker=worker,
        )


def _fingerprint(transfers: Sequence[Transfer]) -> str:
    h = hashlib.sha256()
    for t in transfers:
        box = ",".join(f"{a}:{b}" for a, b in t.box)
        h.update(f"{t.tensor}|{box}|{t.source}|{','.join(t.destinations)}\n".encode())
    return h.hexdigest()[:32]
