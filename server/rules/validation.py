"""Checks on tensor specs and payload sizes, done before any memory is touched.

Called by the worker service for each bucket. Pure functions over protobuf messages and manifest
values; each failure raises a ``WeightwireError`` with its own reason.
"""

from __future__ import annotations

import dataclasses

import torch
from weightwire.core import dtypes
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


@dataclasses.dataclass(frozen=True)
class CheckedSpec:
    """A TensorSpec that passed ``check_spec``."""

    name: str
    dtype: pb.DType
    torch_dtype: torch.dtype
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.nbytes


def _shape_text(shape: tuple[int, ...] | list[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_spec(spec: pb.TensorSpec) -> CheckedSpec:
    """Name present, dtype known, at most ``MAX_DIMS`` dimensions each in 0..``MAX_BYTES``, size and
    offset in 0..``MAX_BYTES``."""
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
    return CheckedSpec(spec.name, spec.dtype, torch_dtype, shape, spec.offset_bytes, nbytes)


def check_payload_size(payload: pb.Payload, index: int) -> None:
    if payload.size_bytes < 0 or payload.size_bytes > MAX_BYTES:
        raise WeightwireError(
            Reason.INVALID_SIZE,
            f"payload {index} has size_bytes {payload.size_bytes} (must be 0..{MAX_BYTES})",
            payload=str(index),
        )


def check_in_bounds(spec: CheckedSpec, size_bytes: int) -> None:
    """The tensor ends at or before the payload's size_bytes."""
    if spec.end_bytes > size_bytes:
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
