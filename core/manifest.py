"""Shard manifests as Python values: what one worker owns, and its fingerprint.

Adapters build a ``ShardManifest``; the server publishes it (``to_proto``); the client reads it back
(``from_proto``) and plans routing from the union of all workers' manifests.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterable, Mapping

from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef
from weightwire.core.transports import table as transport_table
from weightwire.v1 import weight_transfer_pb2 as pb

# The parallel axes of an engine, in the order a worker's ranks are named (``tp0-pp1-dp0-sp1``).
PARALLEL_AXES = ("tp", "pp", "dp", "sp")


@dataclasses.dataclass(frozen=True)
class ParallelRank:
    """Where one worker sits in its engine's layout: its rank on each parallel axis and the axis's size."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    sp_rank: int = 0
    sp_size: int = 1

    def __post_init__(self) -> None:
        for axis in PARALLEL_AXES:
            r, s = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if s < 1 or not 0 <= r < s:
                raise ValueError(f"{axis}_rank={r} out of range for {axis}_size={s}")

    def to_proto(self) -> pb.ParallelRank:
        return pb.ParallelRank(**dataclasses.asdict(self))

    @classmethod
    def from_proto(cls, msg: pb.ParallelRank) -> ParallelRank:
        """An unset size (0) is 1."""
        ranks = {f"{a}_rank": getattr(msg, f"{a}_rank") for a in PARALLEL_AXES}
        return cls(**ranks, **{f"{a}_size": getattr(msg, f"{a}_size") or 1 for a in PARALLEL_AXES})

    def shown_axes(self) -> list[tuple[str, int, int]]:
        """``(axis, rank, size)`` of the axes a name shows: tp and pp always, dp and sp when their
        size is > 1 (``short`` and the torch adapter's worker ids)."""
        return [
            (a, getattr(self, f"{a}_rank"), size)
            for a in PARALLEL_AXES
            if (size := getattr(self, f"{a}_size")) > 1 or a in ("tp", "pp")
        ]

    def short(self) -> str:
        """The ranks for people: ``tp1/2 pp0/2`` (plus dp/sp when those sizes are > 1)."""
        return " ".join(f"{a}{r}/{s}" for a, r, s in self.shown_axes())


# Pieces one owned tensor may list (a fused tensor has one per component: 3 for q/k/v); more is a
# malformed manifest, refused before the pairwise overlap check below runs over it.
MAX_PIECES_PER_TENSOR = 64


@dataclasses.dataclass(frozen=True)
class TensorPiece:
    """Indices ``[offset, offset + length)`` along dimension ``dim`` of a checkpoint tensor, every
    other dimension whole: the part of it one worker keeps (its tensor-parallel slice)."""

    dim: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def to_proto(self) -> pb.TensorPiece:
        return pb.TensorPiece(dim=self.dim, offset=self.offset, length=self.length)


@dataclasses.dataclass(frozen=True)
class OwnedTensor:
    """A checkpoint tensor a worker consumes: the full checkpoint dtype and shape to be sent, and
    which part of it the worker keeps (``pieces``; empty: the whole tensor)."""

    name: str
    dtype: pb.DType.ValueType
    shape: tuple[int, ...]
    pieces: tuple[TensorPiece, ...] = ()

    def __post_init__(self) -> None:
        # Pieces are checked here, where a manifest is built or read back: a worker's slice that
        # leaves its tensor, or two pieces that overlap, would make every plan from it wrong.
        if len(self.pieces) > MAX_PIECES_PER_TENSOR:
            raise ValueError(f"{self.name}: {len(self.pieces)} pieces, at most {MAX_PIECES_PER_TENSOR}")
        seen: list[TensorPiece] = []
        for p in self.pieces:
            if not 0 <= p.dim < len(self.shape):
                raise ValueError(f"{self.name}: piece on dimension {p.dim} of a tensor of shape {self.shape}")
            if p.offset < 0 or p.length < 1 or p.end > self.shape[p.dim]:
                raise ValueError(
                    f"{self.name}: piece [{p.offset}, {p.end}) of dimension {p.dim} outside size {self.shape[p.dim]}"
                )
            for q in seen:
                if q.dim != p.dim:
                    raise ValueError(
                        f"{self.name}: pieces on dimensions {q.dim} and {p.dim}; one dimension per tensor"
                    )
                if p.offset < q.end and q.offset < p.end:
                    raise ValueError(
                        f"{self.name}: pieces [{q.offset}, {q.end}) and [{p.offset}, {p.end}) overlap"
                    )
            seen.append(p)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * dtypes.itemsize(self.dtype)

    @property
    def whole(self) -> bool:
        """Whether the worker keeps the whole tensor."""
        return not self.pieces or (sum(p.length for p in self.pieces) == self.shape[self.pieces[0].dim])

    @property
    def kept_bytes(self) -> int:
        """Bytes of the checkpoint tensor this worker keeps (``nbytes`` for a whole tensor)."""
        if not self.pieces:
            return self.nbytes
        dim = self.pieces[0].dim
        return self.nbytes // self.shape[dim] * sum(p.length for p in self.pieces) if self.shape[dim] else 0

    def to_proto(self) -> pb.OwnedTensor:
        return pb.OwnedTensor(
            name=self.name,
            dtype=self.dtype,
            shape=list(self.shape),
            pieces=[p.to_proto() for p in self.pieces],
        )

    @classmethod
    def from_proto(cls, msg: pb.OwnedTensor) -> OwnedTensor:
        return cls(
            msg.name,
            msg.dtype,
            tuple(msg.shape),
            tuple(TensorPiece(p.dim, p.offset, p.length) for p in msg.pieces),
        )


def transports_for(device: DeviceRef) -> tuple[pb.TransportKind.ValueType, ...]:
    """What a worker on ``device`` can import (the transport table's rows for its device kind)."""
    return transport_table.for_worker(device)


# The manifest's fields that cross the wire as they are, both ways (``to_proto``, ``from_proto``).
_AS_IS = (
    "engine",
    "worker_id",
    "instance_id",
    "waits_for_cuda_ipc_events",
    "imports_cuda_ipc_storages",
    "receives_slices",
)


@dataclasses.dataclass(frozen=True)
class ShardManifest:
    """What one worker consumes (its owned tensors) and where it sits (device, ranks, layers), with
    what it can import; the worker publishes it, the trainer plans from it."""

    device: DeviceRef
    rank: ParallelRank
    tensors: Mapping[str, OwnedTensor]
    layer_start: int = 0
    layer_end: int = 0
    num_layers: int = 0
    engine: str = "torch"
    worker_id: str = ""
    transports: tuple[pb.TransportKind.ValueType, ...] = transport_table.HOST_WORKER_TRANSPORTS
    instance_id: str = ""
    # Set by the worker service that publishes the manifest (it knows its importers), not by adapters;
    # not part of the fingerprint.
    waits_for_cuda_ipc_events: bool = False
    # Set the same way: this worker reads CUDA IPC payloads of several storages (exported parameters).
    imports_cuda_ipc_storages: bool = False
    # Set the same way: this worker receives an M-to-N update's slices into the tensors it keeps.
    receives_slices: bool = False
    # Set the same way: the algorithms this worker verifies a delta's result with (empty: a worker
    # from before the field, or one that takes no deltas).
    delta_checksum_algorithms: tuple[pb.ChecksumAlgorithm.ValueType, ...] = ()

    @classmethod
    def build(
        cls, device: DeviceRef, rank: ParallelRank, tensors: Iterable[OwnedTensor], **kw: object
    ) -> ShardManifest:
        by_name: dict[str, OwnedTensor] = {}
        for t in tensors:
            if t.name in by_name:
                raise ValueError(f"manifest lists {t.name!r} twice")
            by_name[t.name] = t
        return cls(device=device, rank=rank, tensors=by_name, **kw)  # type: ignore[arg-type]

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 over device, ranks, layer range and every owned tensor (sorted, with the pieces it
        keeps), plus instance id.

        Computed once per manifest (the fields are frozen and the tensor map is never changed
        after ``build``): a worker reads it for every GetStatus and every update header, and
        hashing a few hundred tensor entries each time cost ~0.5 ms per read on a 400-tensor model.
        """
        h = hashlib.sha256()
        h.update(
            f"{self.device.kind}:{self.device.uuid}|{self.rank}|{self.layer_start}:{self.layer_end}:{self.num_layers}|{self.instance_id}".encode()
        )
        for name in sorted(self.tensors):
            t = self.tensors[name]
            h.update(f"\n{name}|{t.dtype}|{','.join(map(str, t.shape))}".encode())
            if t.pieces:  # only then, so a manifest without slice geometry keeps its fingerprint
                h.update(("|" + ";".join(f"{p.dim}:{p.offset}:{p.length}" for p in t.pieces)).encode())
        return h.hexdigest()[:32]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def kept_bytes(self) -> int:
        """Bytes of the checkpoint this worker keeps (its slices), what an M-to-N plan sends it."""
        return sum(t.kept_bytes for t in self.tensors.values())

    def to_proto(self) -> pb.ShardManifest:
        return pb.ShardManifest(
            device=self.device.to_proto(),
            rank=self.rank.to_proto(),
            tensors=[self.tensors[n].to_proto() for n in sorted(self.tensors)],
            layer_range=pb.LayerRange(
                start_layer=self.layer_start, end_layer=self.layer_end, num_layers=self.num_layers
            ),
            fingerprint=self.fingerprint,
            transports=list(self.transports),
            delta_checksum_algorithms=list(self.delta_checksum_algorithms),
            **{f: getattr(self, f) for f in _AS_IS},
        )

    @classmethod
    def from_proto(cls, msg: pb.ShardManifest) -> ShardManifest:
        return cls.build(
            DeviceRef(msg.device.kind, msg.device.uuid),
            ParallelRank.from_proto(msg.rank),
            (OwnedTensor.from_proto(t) for t in msg.tensors),
            layer_start=msg.layer_range.start_layer,
            layer_end=msg.layer_range.end_layer,
            num_layers=msg.layer_range.num_layers,
            transports=tuple(msg.transports),
            delta_checksum_algorithms=tuple(msg.delta_checksum_algorithms),
            **{f: getattr(msg, f) for f in _AS_IS},
        )
