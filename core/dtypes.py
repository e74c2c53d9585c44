"""The contract's DType enum <-> torch dtypes. One table; nothing else maps dtypes."""

from __future__ import annotations

import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb

_TABLE: tuple[tuple[pb.DType.ValueType, torch.dtype], ...] = (
    (pb.DTYPE_FLOAT32, torch.float32),
    (pb.DTYPE_FLOAT16, torch.float16),
    (pb.DTYPE_BFLOAT16, torch.bfloat16),
    (pb.DTYPE_FLOAT64, torch.float64),
    (pb.DTYPE_INT8, torch.int8),
    (pb.DTYPE_UINT8, torch.uint8),
    (pb.DTYPE_INT16, torch.int16),
    (pb.DTYPE_INT32, torch.int32),
    (pb.DTYPE_INT64, torch.int64),
    (pb.DTYPE_BOOL, torch.bool),
    (pb.DTYPE_FLOAT8_E4M3FN, torch.float8_e4m3fn),
    (pb.DTYPE_FLOAT8_E5M2, torch.float8_e5m2),
)
_TO_TORCH: dict[int, torch.dtype] = dict(_TABLE)
_FROM_TORCH: dict[torch.dtype, pb.DType.ValueType] = {t: p for p, t in _TABLE}


def to_torch(dtype: int) -> torch.dtype:
    """Contract dtype -> torch dtype; DTYPE_UNSPECIFIED and unknown values are rejected."""
    if dtype == pb.DTYPE_UNSPECIFIED:
        raise WeightwireError(
            Reason.DTYPE_UNSPECIFIED, "tensor dtype is DTYPE_UNSPECIFIED; set it explicitly"
        )
    try:
        return _TO_TORCH[dtype]
    except KeyError:
        raise WeightwireError(
            Reason.DTYPE_UNSPECIFIED,
            f"unknown dtype enum value {dtype}; this worker knows {sorted(_TO_TORCH)}",
        ) from None


def from_torch(dtype: torch.dtype) -> pb.DType.ValueType:
    """torch dtype -> contract dtype. Raises ValueError for a dtype the contract cannot carry."""
    try:
        return _FROM_TORCH[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no weightwire.v1.DType") from None


def itemsize(dtype: int) -> int:
    """Bytes per element of a contract dtype."""
    return to_torch(dtype).itemsize


def name(dtype: int) -> str:
    """Readable name for messages, e.g. 'bfloat16' (or 'DTYPE_UNSPECIFIED')."""
    t = _TO_TORCH.get(dtype)
    return (
        str(t).removeprefix("torch.")
        if t is not None
        else pb.DType.Name(dtype)
        if dtype in pb.DType.values()
        else f"dtype#{dtype}"
    )
