"""A ``Delta`` in a payload's bytes and the contract's ``TensorDelta`` that describes it, both ways.

The trainer's packing calls ``packed_size_bytes`` to plan a bucket and ``pack_delta`` to write one
delta into it (its first part at the TensorSpec's ``offset_bytes``, its values after it, aligned to
the element size); the worker calls ``read_delta`` on the bytes it received, which checks every
offset and size against the payload before it makes a view, and never trusts a size the message
states: all of them derive from ``changed_count``, the element count and the dtypes.
"""

from __future__ import annotations

import torch
from weightwire.core import dtypes
from weightwire.core.delta.encoding import Delta, Encoding, as_bits, index_dtype_for
from weightwire.core.delta.errors import invalid_delta
from weightwire.v1 import weight_transfer_pb2 as pb

_TO_PB = {
    Encoding.INDICES: pb.DELTA_ENCODING_INDICES,
    Encoding.BITMAP: pb.DELTA_ENCODING_BITMAP,
    Encoding.DENSE: pb.DELTA_ENCODING_DENSE,
}
_FROM_PB = {v: k for k, v in _TO_PB.items()}
_INDEX_DTYPES = {pb.DTYPE_INT32: torch.int32, pb.DTYPE_INT64: torch.int64}


def _align(offset: int, to: int) -> int:
    return -(-offset // to) * to


def _first_part_bytes(delta: Delta) -> int:
    if delta.indices is not None:
        return delta.indices.numel() * delta.indices.element_size()
    if delta.bitmap is not None:
        return delta.bitmap.numel()
    return 0


def values_offset_bytes(delta: Delta, offset_bytes: int) -> int:
    """Where ``pack_delta`` puts the values of a delta whose first part starts at ``offset_bytes``."""
    if delta.encoding is Encoding.DENSE:
        return offset_bytes
    return _align(offset_bytes + _first_part_bytes(delta), delta.values.element_size())


def packed_size_bytes(delta: Delta, offset_bytes: int) -> int:
    """Bytes from ``offset_bytes`` to the end of the packed delta (alignment padding included)."""
    end = values_offset_bytes(delta, offset_bytes) + delta.values.numel() * delta.values.element_size()
    return end - offset_bytes


def _put(buffer: torch.Tensor, offset: int, part: torch.Tensor) -> None:
    if part.numel() == 0:
        return
    raw = part.reshape(-1).contiguous().view(torch.uint8)
    buffer[offset : offset + raw.numel()].copy_(raw)


def pack_delta(
    delta: Delta,
    buffer: torch.Tensor,
    offset_bytes: int,
    result_checksums: list[pb.DeltaChecksum] | None = None,
) -> pb.TensorDelta:
    """Write ``delta`` into ``buffer`` (flat uint8) at ``offset_bytes``; its ``TensorDelta``."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("pack_delta writes into a flat uint8 buffer")
    end = offset_bytes + packed_size_bytes(delta, offset_bytes)
    if offset_bytes < 0 or end > buffer.numel():
        raise ValueError(f"delta of bytes [{offset_bytes}, {end}) does not fit a buffer of {buffer.numel()}")
    values_at = values_offset_bytes(delta, offset_bytes)
    msg = pb.TensorDelta(
        encoding=_TO_PB[delta.encoding],
        changed_count=delta.changed_count,
        values_offset_bytes=values_at,
        result_checksums=result_checksums or [],
    )
    if delta.indices is not None:
        msg.index_dtype = dtypes.from_torch(delta.indices.dtype)
        _put(buffer, offset_bytes, delta.indices)
    elif delta.bitmap is not None:
        _put(buffer, offset_bytes, delta.bitmap)
    _put(buffer, values_at, delta.values)
    return msg


def _overlap(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    return a_bytes > 0 and b_bytes > 0 and a < b + b_bytes and b < a + a_bytes


def _view(payload: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` at byte ``offset`` (copied when the offset is misaligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = payload[offset : offset + count * size]
    if offset % size:
        raw = raw.clone()
    return raw.view(dtype)


def read_delta(
    msg: pb.TensorDelta,
    dtype: torch.dtype,
    numel: int,
    payload: torch.Tensor,
    offset_bytes: int,
    **where: str,
) -> Delta:
    """The ``Delta`` that ``msg`` describes in ``payload`` (flat uint8, the bytes received).

    Raises ``INVALID_DELTA`` for an unknown encoding or index dtype, a count outside [0, numel], or
    a part that does not lie inside the payload. The views share the payload's memory (a
    misaligned part is copied). The indices' order and the bitmap's bits are checked by
    ``check_delta`` (``apply_delta`` runs it) against the target.
    """
    label = ", ".join(f"{k} {v}" for k, v in where.items()) or "target"
    encoding = _FROM_PB.get(msg.encoding)
    if encoding is None:
        raise invalid_delta(f"{label}: delta encoding {msg.encoding} is not one this worker knows", **where)
    count = msg.changed_count
    if not 0 <= count <= numel:
        raise invalid_delta(f"{label}: changed_count {count} outside [0, {numel}]", **where)
    itemsize = torch.empty((), dtype=dtype).element_size()
    size = payload.numel()

    def inside(start: int, nbytes: int, what: str) -> None:
        if start < 0 or nbytes < 0 or start + nbytes > size:
            raise invalid_delta(
                f"{label}: {what} at bytes [{start}, {start + nbytes}) outside the payload of {size}", **where
            )

    bits = as_bits(torch.empty(0, dtype=dtype)).dtype
    if encoding is Encoding.DENSE:
        if count != numel:
            raise invalid_delta(f"{label}: a dense delta changes all {numel} elements, not {count}", **where)
        if msg.values_offset_bytes != offset_bytes:
            raise invalid_delta(f"{label}: a dense delta's values lie at offset_bytes", **where)
        inside(offset_bytes, numel * itemsize, "values")
        return Delta(encoding, numel, dtype, count, values=_view(payload, offset_bytes, numel, bits))
    values_at = msg.values_offset_bytes
    inside(values_at, count * itemsize, "values")
    values = _view(payload, values_at, count, bits)
    if encoding is Encoding.BITMAP:
        nbytes = (numel + 7) // 8
        inside(offset_bytes, nbytes, "bitmap")
        if _overlap(values_at, count * itemsize, offset_bytes, nbytes):
            raise invalid_delta(f"{label}: values overlap the bitmap", **where)
        bitmap = payload[offset_bytes : offset_bytes + nbytes]
        return Delta(encoding, numel, dtype, count, values=values, bitmap=bitmap)
    index_dtype = _INDEX_DTYPES.get(msg.index_dtype)
    if index_dtype is None:
        raise invalid_delta(f"{label}: index dtype must be DTYPE_INT32 or DTYPE_INT64", **where)
    if index_dtype == torch.int32 and index_dtype_for(numel) != torch.int32:
        raise invalid_delta(f"{label}: int32 indices cannot address {numel} elements", **where)
    index_size = torch.empty((), dtype=index_dtype).element_size()
    inside(offset_bytes, count * index_size, "indices")
    if _overlap(values_at, count * itemsize, offset_bytes, count * index_size):
        raise invalid_delta(f"{label}: values overlap the indices", **where)
    indices = _view(payload, offset_bytes, count, index_dtype)
    return Delta(encoding, numel, dtype, count, values=values, indices=indices)
