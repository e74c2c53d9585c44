"""The trainer's record of what its workers hold: the base the next delta is computed against.

One ``BaseKeeper`` per pusher (per trainer rank, for the slices that rank sends). An update goes
``begin(version)``, then per tensor ``diff(name, new)`` (the changes since the base, or None: send
it whole) and ``record(name, new, delta)`` (what this update sends), then ``commit(version)`` once
every worker committed, or ``drop()`` when any worker refused or failed. The base version only
advances at ``commit``; after ``drop`` there is no base, so the next push is sent whole (FULL) and
becomes the new base.

Memory: exactly one copy of every tensor ever recorded (its bytes, contiguous), never two: the copy
is brought to the update's values in place at ``record`` (sparse writes for a sparse delta), which
is safe because an update that does not commit drops the whole base anyway. A copy lives on the
host by default; a tensor on a CUDA device keeps its copy on that device while the copies there fit
``device_budget_bytes`` (0: none do). A host copy of a CUDA tensor costs, at every ``diff``, one
upload of the copy to the device (the comparison runs there) and transient device memory of the
tensor's size plus a byte per element; a device copy costs neither. ``memory()`` reports both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from weightwire.core.delta.checksums import checksum, weighted_sum64, weighted_sum64_update
from weightwire.core.delta.encoding import Delta, Encoding, apply_delta, as_bits, changed_positions, encode
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
        parts: Iterable[tuple[int, int, int] | None] = (None,),
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
