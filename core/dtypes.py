"""The contract's DType enum <-> torch dtypes. One table; nothing else maps dtypes.

The table is plain data (the torch attribute name and the bytes per element of each dtype) and torch
is imported only by the functions that return or take a torch dtype: sizes and names are what the
command line's ``manifest``, ``status`` and ``plan`` need, and they should not wait seconds for torch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from weightwire.core.errors import Reason, WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    import torch

# The torch attribute names of each element width; a name's contract value is DTYPE_<NAME> (one
# the contract lacks fails here, at import).
_NAMES_BY_SIZE: dict[int, tuple[str, ...]] = {
    1: ("int8", "uint8", "bool", "float8_e4m3fn", "float8_e5m2"),
    2: ("float16", "bfloat16", "int16"),
    4: ("float32", "int32"),
    8: ("float64", "int64"),
}
# (contract dtype, torch attribute name, bytes per element)
_TABLE: tuple[tuple[pb.DType.ValueType, str, int], ...] = tuple(
    (pb.DType.Value(f"DTYPE_{name.upper()}"), name, size)
    for size, names in _NAMES_BY_SIZE.items()
    for name in names
)
_NAMES: dict[int, str] = {p: n for p, n, _ in _TABLE}
_ITEMSIZE: dict[int, int] = {p: s for p, _, s in _TABLE}


@functools.cache
def _to_torch_table() -> dict[int, torch.dtype]:
    import torch

    return {p: getattr(torch, n) for p, n, _ in _TABLE}


@functools.cache
def _from_torch_table() -> dict[torch.dtype, pb.DType.ValueType]:
    return {t: pb.DType.ValueType(p) for p, t in _to_torch_table().items()}


def _known(dtype: int) -> None:
    if dtype == pb.DTYPE_UNSPECIFIED:
        raise WeightwireError(
            Reason.DTYPE_UNSPECIFIED, "tensor dtype is DTYPE_UNSPECIFIED; set it explicitly"
        )
    if dtype not in _NAMES:
        raise WeightwireError(
            Reason.DTYPE_UNSPECIFIED,
            f"unknown dtype enum value {dtype}; this worker knows {sorted(_NAMES)}",
        )


def to_torch(dtype: int) -> torch.dtype:
    """Contract dtype -> torch dtype; DTYPE_UNSPECIFIED and unknown values are rejected."""
    _known(dtype)
    return _to_torch_table()[dtype]


def from_torch(dtype: torch.dtype) -> pb.DType.ValueType:
    """torch dtype -> contract dtype. Raises ValueError for a dtype the contract cannot carry."""
    try:
        return _from_torch_table()[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no weightwire.v1.DType") from None


def itemsize(dtype: int) -> int:
    """Bytes per element of a contract dtype."""
    _known(dtype)
    return _ITEMSIZE[dtype]


def name(dtype: int) -> str:
    """Readable name for messages, e.g. 'bfloat16' (or 'DTYPE_UNSPECIFIED')."""
    n = _NAMES.get(dtype)
    return n if n is not None else pb.DType.Name(dtype) if dtype in pb.DType.values() else f"dtype#{dtype}"
