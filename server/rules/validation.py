"""Checks on tensor specs and payload sizes, done before any memory is touched.

Called by the worker service for each bucket. Pure functions over protobuf messages and manifest
values; each failure raises a ``WeightwireError`` with its own reason.
"""

from __future__ import annotations

import dataclasses

import torch
from weightwire.core import dtypes
from weightwire.core.delta import VERIFIED_ALGORITHMS, read_delta
from weightwire.core.delta.errors import invalid_delta
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import OwnedTensor
from weightwire.v1 import weight_transfer_pb2 as pb

# Largest byte count a tensor or payload may claim, and the largest dimension. Far beyond any real
# buffer, small enough that offset + nbytes stays inside int64 and no size arithmetic downstream
# can overflow.
MAX_BYTES = 2**62
# Most dimensions a tensor spec may have (checkpoints use up to 5); checked before the shape is
# read, so a spec of millions of dimensions costs nothing.
MAX_DIMS = 32
# The read of a delta's bytes starts at a multiple of this below its first part, so that the
# parts keep their payload alignment in the bytes the worker reads (``views.ALIGN_BYTES``).
DELTA_READ_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class CheckedSpec:
    """A TensorSpec that passed ``check_spec``."""

    name: str
    dtype: pb.DType
    torch_dtype: torch.dtype
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int
    # A delta spec (TensorSpec.delta, in an update with a delta base): the TensorDelta, and the
    # payload bytes [read_start, end) its encoding lies in (checked by ``check_delta_spec``).
    delta: pb.TensorDelta | None = None
    delta_end: int = 0
    read_start: int = 0

    @property
    def end_bytes(self) -> int:
        """Where the spec's bytes end in the payload: the tensor's, or its encoding's for a delta."""
        return self.delta_end if self.delta is not None else self.offset_bytes + self.nbytes

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _shape_text(shape: tuple[int, ...] | list[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_spec(spec: pb.TensorSpec, *, deltas: bool = False) -> CheckedSpec:
    """Name present, dtype known, at most ``MAX_DIMS`` dimensions each in 0..``MAX_BYTES``, size and
    offset in 0..``MAX_BYTES``; a ``delta`` only when the update has a base (``deltas``), its
    encoding checked by ``check_delta_spec``."""
    if not spec.name:
        raise WeightwireError(Reason.MALFORMED_STREAM, "a tensor spec has an empty name")
    torch_dtype = dtypes.to_torch(spec.dtype) if spec.dtype != pb.DTYPE_UNSPECIFIED else None
    if torch_dtype is None:
        raise WeightwireError(
            Reason.DTYPE_UNSPECIFIED,
            f"tensor {spec.name!r} has dtype DTYPE_UNSPECIFIED; set it explicitly",
            tensor=spec.name,
        )
    if len(spec.shape) > MAX_DIMS:
        raise WeightwireError(
            Reason.INVALID_SHAPE,
            f"tensor {spec.name!r} has {len(spec.shape)} dimensions (at most {MAX_DIMS})",
            tensor=spec.name,
        )
    shape = tuple(int(d) for d in spec.shape)
    # The same verdict in any order of the dimensions: each is bounded, then the whole product is
    # (a zero dimension makes an empty tensor, whatever the others are, as long as each is bounded).
    for d in shape:
        if not 0 <= d <= MAX_BYTES:
            raise WeightwireError(
                Reason.INVALID_SHAPE,
                f"tensor {spec.name!r} has a dimension out of range (0..{MAX_BYTES}) in shape {_shape_text(shape)}",
                tensor=spec.name,
            )
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch_dtype.itemsize
    if nbytes > MAX_BYTES:
        raise WeightwireError(
            Reason.INVALID_SHAPE,
            f"tensor {spec.name!r} of shape {_shape_text(shape)} would exceed {MAX_BYTES} bytes",
            tensor=spec.name,
        )
    if spec.offset_bytes < 0 or spec.offset_bytes > MAX_BYTES:
        raise WeightwireError(
            Reason.INVALID_OFFSET,
            f"tensor {spec.name!r} has offset_bytes {spec.offset_bytes} (must be 0..{MAX_BYTES})",
            tensor=spec.name,
        )
    checked = CheckedSpec(spec.name, spec.dtype, torch_dtype, shape, spec.offset_bytes, nbytes)
    if not spec.HasField("delta"):
        return checked
    if not deltas:
        raise invalid_delta(
            f"tensor {spec.name!r} carries a TensorDelta but the update names no delta base "
            "(UpdateHeader.delta_base); send the tensor whole or set the base",
            tensor=spec.name,
        )
    return check_delta_spec(checked, spec.delta)


def check_delta_spec(spec: CheckedSpec, delta: pb.TensorDelta) -> CheckedSpec:
    """The delta's encoding, index dtype, count and parts, by ``read_delta`` itself over a payload
    of the largest size a payload may claim (a meta tensor: the checks need sizes, not bytes); the
    bytes its parts span. Each payload's own size is checked by ``check_in_bounds``."""
    sizes = torch.empty(MAX_BYTES, dtype=torch.uint8, device="meta")
    parts = read_delta(delta, spec.torch_dtype, spec.numel, sizes, spec.offset_bytes, tensor=spec.name)
    first = parts.indices if parts.indices is not None else parts.bitmap
    first_bytes = 0 if first is None else first.numel() * first.element_size()
    values_at = spec.offset_bytes if delta.encoding == pb.DELTA_ENCODING_DENSE else delta.values_offset_bytes
    values_bytes = parts.values.numel() * parts.values.element_size()
    start = min(spec.offset_bytes, values_at)
    end = max(spec.offset_bytes + first_bytes, values_at + values_bytes)
    return dataclasses.replace(spec, delta=delta, delta_end=end, read_start=start - start % DELTA_READ_ALIGN)


def check_result_checksums(spec: CheckedSpec, owned: OwnedTensor) -> None:
    """A delta carries a result checksum of a known algorithm for every part this worker keeps (its
    manifest's pieces, or the whole tensor), so that nothing is written that cannot be verified."""
    assert spec.delta is not None
    given: dict[tuple[int, int, int] | None, int] = {}
    for c in spec.delta.result_checksums:
        piece = (c.piece.dim, c.piece.offset, c.piece.length) if c.HasField("piece") else None
        given[piece] = c.checksum.algorithm
    wanted: list[tuple[int, int, int] | None] = [(p.dim, p.offset, p.length) for p in owned.pieces]
    for part in wanted or [None]:
        algorithm = given.get(part)
        if algorithm is None:
            what = "whole" if part is None else f"dim {part[0]} [{part[1]}, +{part[2]})"
            raise invalid_delta(
                f"tensor {spec.name!r}: its delta carries no result checksum for the part {what} this worker keeps",
                tensor=spec.name,
            )
        if algorithm not in VERIFIED_ALGORITHMS:
            raise invalid_delta(
                f"tensor {spec.name!r}: result checksum algorithm {algorithm} is unspecified or unknown; "
                "use one of the manifest's delta_checksum_algorithms",
                tensor=spec.name,
            )


def check_payload_size(payload: pb.Payload, index: int) -> None:
    if payload.size_bytes < 0 or payload.size_bytes > MAX_BYTES:
        raise WeightwireError(
            Reason.INVALID_SIZE,
            f"payload {index} has size_bytes {payload.size_bytes} (must be 0..{MAX_BYTES})",
            payload=str(index),
        )


def check_in_bounds(spec: CheckedSpec, size_bytes: int) -> None:
    """The tensor (a delta: every part of its encoding) ends at or before the payload's size_bytes."""
    if spec.end_bytes <= size_bytes:
        return
    if spec.delta is not None:
        raise invalid_delta(
            f"tensor {spec.name!r}: its delta's encoding covers bytes up to {spec.end_bytes} but the payload has "
            f"only {size_bytes} bytes",
            tensor=spec.name,
        )
    raise WeightwireError(
        Reason.TENSOR_OUT_OF_BOUNDS,
        f"tensor {spec.name!r} covers bytes [{spec.offset_bytes}, {spec.end_bytes}) but the payload has only "
        f"{size_bytes} bytes",
        tensor=spec.name,
    )


def check_against_manifest(spec: CheckedSpec, owned: OwnedTensor) -> None:
    """dtype and full shape equal to what this worker's manifest says it consumes."""
    if spec.dtype != owned.dtype:
        raise WeightwireError(
            Reason.DTYPE_MISMATCH,
            f"tensor {spec.name!r} arrived as {dtypes.name(spec.dtype)} but this worker expects {dtypes.name(owned.dtype)}",
            tensor=spec.name,
            expected=dtypes.name(owned.dtype),
            received=dtypes.name(spec.dtype),
        )
    if spec.shape != tuple(owned.shape):
        raise WeightwireError(
            Reason.SHAPE_MISMATCH,
            f"tensor {spec.name!r} arrived with shape {_shape_text(spec.shape)} but this worker expects the full "
            f"checkpoint shape {_shape_text(owned.shape)}",
            tensor=spec.name,
            expected=_shape_text(owned.shape),
            received=_shape_text(spec.shape),
        )
