"""What one tensor's changes are: the contract's three encodings, the ``Delta`` record, raw-bit views.

The data that ``weightwire.core.delta.encoding`` (encode, check, apply), ``torch_ops`` (the torch
kernels) and ``wire`` (a payload's layout) share, and the size rule by which the trainer picks an
encoding. Import it through ``weightwire.core.delta`` or ``weightwire.core.delta.encoding``.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

# Indices are int32 while they fit (4 bytes each instead of 8); a target of 2^31 or more elements
# needs int64 ones.
INT32_INDEX_LIMIT = 2**31

_BITS_DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Encoding(enum.Enum):
    """The contract's ``DeltaEncoding`` values (same names without the prefix)."""

    INDICES = 1
    BITMAP = 2
    DENSE = 3


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of the same width as ``dtype``: what elements are compared and carried as."""
    size = torch.empty((), dtype=dtype).element_size()
    try:
        return _BITS_DTYPES[size]
    except KeyError:
        raise ValueError(f"no integer dtype of {size} bytes for {dtype}") from None


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its width (same storage, same strides)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(bits_dtype(t.dtype))


def index_dtype_for(numel: int) -> torch.dtype:
    return torch.int32 if numel < INT32_INDEX_LIMIT else torch.int64


def encoded_size_bytes(encoding: Encoding, numel: int, changed: int, itemsize: int) -> int:
    """Bytes an encoding of ``changed`` of ``numel`` elements of ``itemsize`` bytes takes on the wire."""
    if encoding is Encoding.INDICES:
        return changed * (index_dtype_for(numel).itemsize + itemsize)
    if encoding is Encoding.BITMAP:
        return (numel + 7) // 8 + changed * itemsize
    return numel * itemsize


def choose_encoding(numel: int, changed: int, itemsize: int) -> Encoding:
    """The smallest encoding for this density; a tie goes to the simpler one (dense, then indices)."""
    sizes = {e: encoded_size_bytes(e, numel, changed, itemsize) for e in Encoding}
    return min((Encoding.DENSE, Encoding.INDICES, Encoding.BITMAP), key=lambda e: sizes[e])


@dataclasses.dataclass(frozen=True)
class Delta:
    """The changes of one target of ``numel`` elements of ``dtype`` (row-major order).

    ``values`` are raw bits (``as_bits`` of the target's dtype): ``changed_count`` of them, or every
    element for DENSE (which may then be a view of the tensor it was encoded from). ``indices``
    (INDICES: int32/int64, strictly ascending) and ``bitmap`` (BITMAP: uint8, ``ceil(numel / 8)``
    bytes, least significant bit first) say where they go.
    """

    encoding: Encoding
    numel: int
    dtype: torch.dtype
    changed_count: int
    values: torch.Tensor
    indices: torch.Tensor | None = None
    bitmap: torch.Tensor | None = None

    @property
    def size_bytes(self) -> int:
        """Bytes of this delta on the wire (indices or bitmap, then values)."""
        extra = 0
        if self.indices is not None:
            extra = self.indices.numel() * self.indices.element_size()
        elif self.bitmap is not None:
            extra = self.bitmap.numel()
        return extra + self.values.numel() * self.values.element_size()
