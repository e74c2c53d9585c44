"""The trainer's record of what its workers hold: the base the next delta is computed against.

One ``BaseKeeper`` per pusher (per trainer rank, for the slices that rank sends). An update goes
``begin(version)``, then per tensor ``diff(name, new)`` (the changes since the base, or None: send
it whole) and ``record(name, new, delta)`` (what this update sends), then ``commit(version)`` once
every worker committed, or ``drop()`` when any worker refused or failed. The base version only
advances at ``commit``; after ``drop`` there is no base, so the next push is sent whole (FULL) and
becomes the new base.

``update_all`` does diff, record and the result checksums of an update's tensors, casting each to
the dtype it is sent as. A host tensor whose base is on the host and whose recipients keep it whole
goes through ``host_pass``: one chunked pass, on ``delta_threads()`` threads over the tensors,
instead of a whole cast copy and separate whole-tensor diff, record and checksum.

Memory: exactly one copy of every tensor ever recorded (its bytes, contiguous), never two: the copy
is brought to the update's values in place at ``record`` (sparse writes for a sparse delta), which
is safe because an update that does not commit drops the whole base anyway. A copy lives on the
host by default; a tensor on a CUDA device keeps its copy on that device while the copies there fit
``device_budget_bytes`` (0: none do). A host copy of a CUDA tensor costs, at every ``diff``, one
upload of the copy to the device (the comparison runs there) and transient device memory of the
tensor's size plus a byte per element; a device copy costs neither. ``memory()`` reports both.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Iterable, Sequence

import torch
from weightwire.core.delta.checksums import checksum, running_crc, weighted_sum64, weighted_sum64_update
from weightwire.core.delta.encoding import Delta, Encoding, apply_delta, as_bits, changed_positions, encode
from weightwire.core.delta.host_pass import host_pass
from weightwire.core.delta.threads import delta_threads
from weightwire.v1 import weight_transfer_pb2 as pb


@dataclasses.dataclass
class _Kept:
    copy: torch.Tensor
    # WEIGHTED_SUM64 of the copy when known (kept up to date from sparse changes alone).
    weighted_sum: int | None = None
    # False after a drop until the next record: the workers may not hold these bytes.
    valid: bool = True


@dataclasses.dataclass(frozen=True)
class KeeperMemory:
    """What a ``BaseKeeper`` holds: its tensors and their bytes in host and in device memory."""

    tensors: int
    host_bytes: int
    device_bytes: int


Part = tuple[int, int, int]  # (dim, offset, length) of a tensor, as OwnedTensor.pieces; None: whole


@dataclasses.dataclass(frozen=True)
class KeptUpdate:
    """One tensor of an update (``BaseKeeper.update_all``): its changes (None: it goes whole), the
    tensor sent (in the sent dtype; with a delta only its shape and dtype are read) and, with a
    delta, the result checksums of the parts its recipients keep."""

    name: str
    tensor: torch.Tensor
    delta: Delta | None
    checksums: list[pb.DeltaChecksum]


@dataclasses.dataclass(frozen=True)
class TensorUpdate:
    """What ``BaseKeeper.update_all`` takes per tensor: its name, its value (any dtype), the dtype
    it is sent as, and the parts its recipients keep."""

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype
    parts: Sequence[Part | None] = (None,)


class BaseKeeper:
    """What the trainer last sent, per tensor name, and the version its workers committed it as."""

    def __init__(self, *, device_budget_bytes: int = 0, pin_memory: bool = False) -> None:
        if device_budget_bytes < 0:
            raise ValueError("device_budget_bytes must be >= 0")
        self.device_budget_bytes = device_budget_bytes
        self.pin_memory = pin_memory
        self._kept: dict[str, _Kept] = {}
        self._base_version: int | None = None
        self._pending: int | None = None

    @property
    def base_version(self) -> int | None:
        """The version every worker committed the kept tensors as; None: no base (send FULL)."""
        return self._base_version

    @property
    def pending_version(self) -> int | None:
        return self._pending

    def begin(self, version: int) -> None:
        """Start recording the update of ``version``. One still pending (neither committed nor
        dropped) is dropped first: its outcome is unknown, so its base cannot be trusted."""
        if self._pending is not None:
            self.drop()
        if self._base_version is not None and version <= self._base_version:
            raise ValueError(f"version {version} is not after the base version {self._base_version}")
        self._pending = version

    def _require_pending(self) -> None:
        if self._pending is None:
            raise RuntimeError("BaseKeeper: begin(version) before diff or record")

    def diff(self, name: str, new: torch.Tensor) -> Delta | None:
        """``new``'s changes since the base, or None when there is no base for it (send it whole)."""
        self._require_pending()
        kept = self._kept.get(name) if self._base_version is not None else None
        if kept is None or not kept.valid or kept.copy.shape != new.shape or kept.copy.dtype != new.dtype:
            return None
        base = kept.copy if kept.copy.device == new.device else kept.copy.to(new.device, non_blocking=True)
        return encode(base, new)

    def record(self, name: str, new: torch.Tensor, delta: Delta | None = None) -> None:
        """Make the kept copy of ``name`` equal ``new`` (what this update sends).

        ``delta``: what ``diff`` returned for it (its changes are written sparsely); None copies
        ``new`` whole (allocating the copy the first time).
        """
        self._require_pending()
        new = new.detach()  # a parameter's copy must not join its autograd graph
        kept = self._kept.get(name)
        if kept is not None and (kept.copy.shape != new.shape or kept.copy.dtype != new.dtype):
            del self._kept[name]
            kept = None
        if kept is None:
            kept = self._kept[name] = _Kept(self._allocate(new), valid=False)
        if delta is None or delta.encoding is Encoding.DENSE or not kept.valid:
            kept.copy.copy_(new)
            kept.weighted_sum = None
            kept.valid = True
            return
        if kept.weighted_sum is not None:
            positions = changed_positions(delta)
            assert positions is not None
            flat = as_bits(kept.copy).view(-1)
            old = flat[positions.to(flat.device)]
            kept.weighted_sum = weighted_sum64_update(
                kept.weighted_sum, positions.to(flat.device), old, delta.values.to(flat.device)
            )
        apply_delta(kept.copy, delta)

    def update_all(
        self, items: Sequence[TensorUpdate], algorithm: pb.ChecksumAlgorithm.ValueType
    ) -> list[KeptUpdate]:
        """``diff``, ``record`` and ``result_checksums`` of each item sent as its ``dtype``, in order;
        the host passes run on ``delta_threads()`` threads (one tensor per thread at a time), the
        rest on the calling thread."""
        self._require_pending()
        out: list[KeptUpdate | concurrent.futures.Future[KeptUpdate]] = []
        # a name twice (its second value diffed against its first) keeps the order on one thread
        threads = delta_threads() if len({i.name for i in items}) == len(items) else 1
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for item in items:
                kept = self._host_base(item, algorithm)
                if kept is None:
                    out.append(self._separately(item, algorithm))
                elif threads > 1:
                    out.append(pool.submit(self._pass, item, kept, algorithm, serial_cast=True))
                else:
                    out.append(self._pass(item, kept, algorithm, serial_cast=False))
            return [u.result() if isinstance(u, concurrent.futures.Future) else u for u in out]

    def _host_base(self, item: TensorUpdate, algorithm: pb.ChecksumAlgorithm.ValueType) -> _Kept | None:
        """The kept copy ``host_pass`` brings forward, or None where it does not apply: no valid
        base of the same shape and dtype, the tensor or the copy off the host, a non-contiguous
        tensor, a cast between non-float dtypes, recipients that keep pieces, or a checksum that
        is not continued over chunks (``running_crc``)."""
        self._require_pending()
        new = item.tensor
        kept = self._kept.get(item.name) if self._base_version is not None else None
        if (
            kept is None
            or not kept.valid
            or kept.copy.shape != new.shape
            or kept.copy.dtype != item.dtype
            or kept.copy.device.type != "cpu"
            or new.device.type != "cpu"
            or not new.is_contiguous()
            or running_crc(algorithm) is None
            or any(p is not None for p in item.parts)
        ):
            return None
        if new.dtype != item.dtype and not (new.dtype.is_floating_point and item.dtype.is_floating_point):
            return None
        return kept

    def _pass(
        self, item: TensorUpdate, kept: _Kept, algorithm: pb.ChecksumAlgorithm.ValueType, *, serial_cast: bool
    ) -> KeptUpdate:
        kept.weighted_sum = None
        result = host_pass(kept.copy, item.tensor, running=running_crc(algorithm), serial_cast=serial_cast)
        assert result.checksum is not None
        check = pb.DeltaChecksum(checksum=pb.Checksum(algorithm=algorithm, value=result.checksum))
        return KeptUpdate(item.name, kept.copy, result.delta, [check])

    def _separately(self, item: TensorUpdate, algorithm: pb.ChecksumAlgorithm.ValueType) -> KeptUpdate:
        new = item.tensor.detach()
        sent = new if new.dtype == item.dtype else new.to(item.dtype)
        delta = self.diff(item.name, sent)
        self.record(item.name, sent, delta)
        checks = self.result_checksums(item.name, algorithm, item.parts) if delta is not None else []
        return KeptUpdate(item.name, sent, delta, checks)

    def _allocate(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if like.device.type == "cuda" and self.memory().device_bytes + nbytes <= self.device_budget_bytes:
            return torch.empty(like.shape, dtype=like.dtype, device=like.device)
        pin = self.pin_memory and torch.cuda.is_available()
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)

    def result_checksum(
        self,
        name: str,
        algorithm: pb.ChecksumAlgorithm.ValueType,
        piece: tuple[int, int, int] | None = None,
    ) -> int:
        """The checksum a worker must find after applying this update's delta of ``name`` (call after
        ``record``); ``piece`` = (dim, offset, length) for a worker that keeps only that part."""
        kept = self._kept[name]
        if piece is not None:
            dim, offset, length = piece
            return checksum(kept.copy.narrow(dim, offset, length), algorithm)
        if algorithm == pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64:
            if kept.weighted_sum is None:
                kept.weighted_sum = weighted_sum64(kept.copy)
            return kept.weighted_sum
        return checksum(kept.copy, algorithm)

    def result_checksums(
        self,
        name: str,
        algorithm: pb.ChecksumAlgorithm.ValueType,
        parts: Iterable[Part | None] = (None,),
    ) -> list[pb.DeltaChecksum]:
        """``TensorDelta.result_checksums`` of ``name``: one per distinct part its recipients keep
        (None: the whole tensor; else an ``OwnedTensor.pieces`` entry as (dim, offset, length))."""
        out = []
        for part in dict.fromkeys(parts):
            msg = pb.DeltaChecksum(
                checksum=pb.Checksum(algorithm=algorithm, value=self.result_checksum(name, algorithm, part))
            )
            if part is not None:
                msg.piece.CopyFrom(pb.TensorPiece(dim=part[0], offset=part[1], length=part[2]))
            out.append(msg)
        return out

    def commit(self, version: int) -> None:
        """Every worker committed ``version``: it is the base of the next delta."""
        if self._pending != version:
            raise RuntimeError(f"commit of version {version}, but the pending update is {self._pending}")
        self._base_version = version
        self._pending = None

    def drop(self) -> None:
        """A worker refused or failed the update: forget the base, so the next push is sent whole.

        The copies stay allocated (the next push writes them again instead of allocating); every
        one is invalid until recorded again, and only recorded ones become the next base.
        """
        for kept in self._kept.values():
            kept.valid = False
            kept.weighted_sum = None
        self._base_version = None
        self._pending = None

    def release(self) -> None:
        """Free every copy (and the base with them)."""
        self._kept.clear()
        self._base_version = None
        self._pending = None

    def memory(self) -> KeeperMemory:
        host = device = 0
        for kept in self._kept.values():
            nbytes = kept.copy.numel() * kept.copy.element_size()
            if kept.copy.device.type == "cpu":
                host += nbytes
            else:
                device += nbytes
        return KeeperMemory(tensors=len(self._kept), host_bytes=host, device_bytes=device)
