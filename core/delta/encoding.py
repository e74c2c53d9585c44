"""A tensor's changes since a base, encoded by density, and applied in place with every bound checked.

The trainer calls ``encode(old, new)`` per tensor (or per slice) to get the changed elements in
the smallest of the contract's three encodings (``DeltaEncoding``: indices + values, bitmap +
values, dense); the worker calls ``apply_delta(target, delta)`` to write them into the model.
Elements are compared and carried as raw bits (each tensor viewed as the integer dtype of its
width), so -0.0 / +0.0 and NaN payloads are kept exactly and a float comparison's rules never
decide what changed. Everything runs on the tensors' own device: torch kernels on CUDA
(``torch_ops``), numpy (zero-copy views, here) on the host, where its mask, nonzero and bit
packing are several times faster than torch's CPU kernels. Any strided view works: a non-contiguous ``old``/``new`` is read in
row-major order, and a non-contiguous target is written through its own strides.

``apply_delta`` checks the whole encoding against the target before it writes one element, and
raises ``INVALID_DELTA`` instead: an index past the target, indices not strictly ascending, a
bitmap of the wrong length or with bits past the end, a count of values or set bits that does not
match, values of another width or dtype. Nothing here reads the wire; ``weightwire.core.delta.wire``
turns the contract's ``TensorDelta`` and a payload's bytes into a ``Delta`` and back. The
``Delta`` record, the encodings and the raw-bit views live in ``record`` and are importable from here.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Any

import numpy as np
import torch
from weightwire.core.delta.errors import invalid_delta
from weightwire.core.delta.record import (
    INT32_INDEX_LIMIT,
    Delta,
    Encoding,
    as_bits,
    bits_dtype,
    choose_encoding,
    encoded_size_bytes,
    index_dtype_for,
)
from weightwire.core.delta.torch_ops import TorchOps

__all__ = [
    "HOST_CHUNK_ELEMENTS",
    "HOST_ENCODE_THREADS",
    "INT32_INDEX_LIMIT",
    "Delta",
    "Encoding",
    "NumpyOps",
    "TorchOps",
    "apply_delta",
    "as_bits",
    "bits_dtype",
    "changed_positions",
    "check_delta",
    "choose_encoding",
    "encode",
    "encoded_size_bytes",
    "host_threads",
    "index_dtype_for",
    "ops_for",
]

# ---------------------------------------------------------------------------------------------
# Host kernels: numpy on zero-copy views, the same results as TorchOps (the tests run both)
# ---------------------------------------------------------------------------------------------


class NumpyOps(TorchOps):
    """The same operations through numpy on zero-copy views of host tensors."""

    def ne(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.not_equal(a.numpy(), b.numpy()))

    def count(self, mask: torch.Tensor) -> int:
        return int(np.count_nonzero(mask.numpy()))

    def flatnonzero(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.flatnonzero(mask.numpy()))

    def pack(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))

    def unpack(self, bitmap: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.unpackbits(bitmap.numpy(), bitorder="little").view(np.bool_))

    def take(self, flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(flat.numpy()[indices.numpy()])

    def compress(self, mask: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.compress(mask.numpy(), flat.numpy()))

    def put(self, flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
        # indexed assignment with the indices as they came (int32 or int64): about twice as fast
        # as np.put, which converts them and bounds-checks each one (check_delta checked them all)
        flat.numpy()[indices.numpy()] = values.numpy()

    def place(self, flat: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> None:
        np.place(flat.numpy(), mask.numpy(), values.numpy())

    def ascending(self, indices: torch.Tensor) -> bool:
        i = indices.numpy()
        return i.size < 2 or bool(np.all(i[1:] > i[:-1]))

    def popcount(self, bitmap: torch.Tensor) -> int:
        bits = bitmap.numpy()
        if _BITWISE_COUNT is not None:  # numpy >= 2
            return int(_BITWISE_COUNT(bits).sum(dtype=np.int64))
        return int(_POPCOUNT[bits].sum(dtype=np.int64))

    def encode_flat(self, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> Delta:
        """In chunks small enough that each chunk's mask stays in the CPU's cache: the comparison,
        the count, the bit packing and the gathers each read a hot mask instead of one of the
        whole tensor from memory. With ``host_threads()`` above one, a large tensor is cut into one
        range per thread, encoded in parallel (numpy releases the GIL in each of these steps) and
        joined in order."""
        an, bn = a.numpy(), b.numpy()
        numel, itemsize = bn.size, bn.itemsize
        index_size = index_dtype_for(numel).itemsize
        bitmap = np.empty((numel + 7) // 8, dtype=np.uint8)
        threads = min(host_threads(), numel // (2 * HOST_CHUNK_ELEMENTS))
        watch = _DenseWatch(numel, itemsize, index_size)
        parts: list[_RangeChanges | None]
        if threads <= 1:
            parts = [_encode_range(an, bn, bitmap, 0, numel, watch, index_size)]
        else:
            # range bounds on chunk boundaries (multiples of 8): each range owns whole bitmap bytes
            per = -(-numel // threads // HOST_CHUNK_ELEMENTS) * HOST_CHUNK_ELEMENTS
            bounds = [(lo, min(lo + per, numel)) for lo in range(0, numel, per)]
            with concurrent.futures.ThreadPoolExecutor(len(bounds)) as pool:
                futures = [
                    pool.submit(_encode_range, an, bn, bitmap, lo, hi, watch, index_size) for lo, hi in bounds
                ]
                parts = [f.result() for f in futures]
        if watch.won:
            return Delta(Encoding.DENSE, numel, dtype, numel, values=b)
        changed = sum(p.changed for p in parts if p is not None)
        encoding = choose_encoding(numel, changed, itemsize)
        if encoding is Encoding.DENSE:
            return Delta(encoding, numel, dtype, numel, values=b)
        chunks = [v for p in parts if p is not None for v in p.values]
        vals = torch.from_numpy(np.concatenate(chunks) if chunks else bn[:0].copy())
        if encoding is Encoding.BITMAP:
            return Delta(encoding, numel, dtype, changed, values=vals, bitmap=torch.from_numpy(bitmap))
        found = [p.indices for p in parts if p is not None]
        if all(i is not None for i in found):
            pieces = [x for i in found if i is not None for x in i]
            idx = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        else:  # a range gave its indices up, yet they win over the whole tensor
            idx = np.flatnonzero(np.unpackbits(bitmap, count=numel, bitorder="little"))
        idx_t = torch.from_numpy(idx.astype(np.int32 if index_size == 4 else np.int64, copy=False))
        return Delta(encoding, numel, dtype, changed, values=vals, indices=idx_t)

    def place_bitmap(self, flat: torch.Tensor, bitmap: torch.Tensor, values: torch.Tensor) -> None:
        fn, bm, vn = flat.numpy(), bitmap.numpy(), values.numpy()
        numel, at = fn.size, 0
        step = HOST_CHUNK_ELEMENTS  # a multiple of 8: chunks start at a byte of the bitmap
        for start in range(0, numel, step):
            stop = min(start + step, numel)
            m = np.unpackbits(bm[start // 8 : (stop + 7) // 8], count=stop - start, bitorder="little").view(
                np.bool_
            )
            k = int(np.count_nonzero(m))
            if k:
                np.place(fn[start:stop], m, vn[at : at + k])
                at += k


@dataclasses.dataclass
class _RangeChanges:
    changed: int
    values: list[np.ndarray]
    indices: list[np.ndarray] | None


class _DenseWatch:
    """The changes counted so far over all ranges of one encode, and whether DENSE has won: the
    sparse encodings only grow with more changes, so once both reach the dense size every range
    can stop."""

    def __init__(self, numel: int, itemsize: int, index_size: int) -> None:
        self.dense_bytes = numel * itemsize
        self.bitmap_bytes = (numel + 7) // 8
        self.itemsize, self.index_size = itemsize, index_size
        self.changed = 0
        self.won = False
        self.lock = threading.Lock()

    def add(self, k: int) -> bool:
        with self.lock:
            self.changed += k
            c = self.changed
            if (
                self.bitmap_bytes + c * self.itemsize >= self.dense_bytes
                and c * (self.index_size + self.itemsize) >= self.dense_bytes
            ):
                self.won = True
            return self.won


def _encode_range(
    an: np.ndarray,
    bn: np.ndarray,
    bitmap: np.ndarray,
    lo: int,
    hi: int,
    watch: _DenseWatch,
    index_size: int,
) -> _RangeChanges | None:
    """Elements [lo, hi) of a host encode: their bitmap bytes, changed values and (while they can
    win) indices; None once DENSE has won (``watch``). Indices are given up by the range's own
    sizes: for the whole tensor that is exact, for a part the caller finds them again from the
    bitmap if they win overall."""
    mask = np.empty(min(hi - lo, HOST_CHUNK_ELEMENTS), dtype=np.bool_)
    out = _RangeChanges(0, [], [])
    span_bitmap = (hi - lo + 7) // 8
    for start in range(lo, hi, HOST_CHUNK_ELEMENTS):
        stop = min(start + HOST_CHUNK_ELEMENTS, hi)
        m = mask[: stop - start]
        np.not_equal(an[start:stop], bn[start:stop], out=m)
        k = int(np.count_nonzero(m))
        bitmap[start // 8 : (stop + 7) // 8] = np.packbits(m, bitorder="little")
        if k and out.indices is not None:
            # while indices may win they are found anyway, and gathering by them is cheaper
            # than a second pass over the mask
            found = np.flatnonzero(m)
            out.values.append(bn[start:stop][found])
            out.indices.append(found + start)
        elif k:
            out.values.append(np.compress(m, bn[start:stop]))
        out.changed += k
        # indices alone now take more than the bitmap: INDICES cannot win whatever follows
        if out.indices is not None and out.changed * index_size > span_bitmap:
            out.indices = None
        if watch.add(k):
            return None
    return out


# Threads of the host's encode. One until a parallel encode is measured faster on a quiet host:
# on a busy 2-core machine the ranges only contend (BENCHMARKS.md, "Deltas").
HOST_ENCODE_THREADS = 1


def host_threads() -> int:
    """Threads of the host's encode (``HOST_ENCODE_THREADS``)."""
    return max(1, HOST_ENCODE_THREADS)


# Elements per chunk of the host's encode and apply: a 256 KiB mask, which stays in L2.
HOST_CHUNK_ELEMENTS = 1 << 18
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)
_BITWISE_COUNT = getattr(np, "bitwise_count", None)

_TORCH_OPS = TorchOps()
_NUMPY_OPS = NumpyOps()


def ops_for(device: torch.device) -> TorchOps:
    return _NUMPY_OPS if device.type == "cpu" else _TORCH_OPS


def _flat_bits(t: torch.Tensor) -> torch.Tensor:
    """Row-major raw bits of ``t`` as one dimension (a view when ``t`` is contiguous, else a copy)."""
    return as_bits(t).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Encode
# ---------------------------------------------------------------------------------------------


def encode(old: torch.Tensor, new: torch.Tensor, *, ops: TorchOps | None = None) -> Delta:
    """The changes from ``old`` to ``new`` (same shape, dtype and device), in the smallest encoding.

    Computed on the tensors' device. Temporary memory besides the result: on the host a bitmap
    (an eighth of a byte per element) and a cache-sized mask; elsewhere a mask of one byte per
    element and the indices (8 bytes per changed element, while they are found). A non-contiguous
    ``old`` or ``new`` is first copied in row-major order.
    """
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(
            f"encode needs tensors of one shape and dtype, got {tuple(old.shape)} {old.dtype} "
            f"and {tuple(new.shape)} {new.dtype}"
        )
    if old.device != new.device:
        raise ValueError(f"encode needs tensors on one device, got {old.device} and {new.device}")
    ops = ops or ops_for(new.device)
    return ops.encode_flat(_flat_bits(old), _flat_bits(new), new.dtype)


def changed_positions(delta: Delta, *, ops: TorchOps | None = None) -> torch.Tensor | None:
    """Row-major positions (int64, ascending) of a checked delta's changed elements; None for DENSE."""
    if delta.encoding is Encoding.DENSE:
        return None
    if delta.encoding is Encoding.INDICES:
        assert delta.indices is not None
        return delta.indices.to(torch.int64)
    assert delta.bitmap is not None
    ops = ops or ops_for(delta.bitmap.device)
    return ops.flatnonzero(ops.unpack(delta.bitmap)[: delta.numel])


# ---------------------------------------------------------------------------------------------
# Check and apply
# ---------------------------------------------------------------------------------------------


def check_delta(target: torch.Tensor, delta: Delta, *, ops: TorchOps | None = None, **where: str) -> None:
    """Raise ``INVALID_DELTA`` unless ``delta`` fits ``target`` exactly; reads the encoding, writes nothing.

    ``where`` (e.g. ``tensor=name``) goes into the error's metadata and message.
    """
    label = ", ".join(f"{k} {v}" for k, v in where.items()) or "target"
    numel = target.numel()
    if delta.numel != numel:
        raise invalid_delta(f"{label}: delta is for {delta.numel} elements, the target has {numel}", **where)
    if delta.dtype != target.dtype:
        raise invalid_delta(f"{label}: delta of {delta.dtype}, the target is {target.dtype}", **where)
    want_bits = as_bits(torch.empty(0, dtype=target.dtype)).dtype
    if delta.values.dtype not in (want_bits, target.dtype) or delta.values.dim() != 1:
        raise invalid_delta(
            f"{label}: values must be one dimension of {target.dtype} or {want_bits}, "
            f"got {delta.values.dtype} of {delta.values.dim()} dimensions",
            **where,
        )
    expected_values = numel if delta.encoding is Encoding.DENSE else delta.changed_count
    if not 0 <= delta.changed_count <= numel:
        raise invalid_delta(f"{label}: {delta.changed_count} changed of {numel} elements", **where)
    if delta.values.numel() != expected_values:
        raise invalid_delta(
            f"{label}: {delta.values.numel()} values for {expected_values} changed elements", **where
        )
    if delta.encoding is Encoding.DENSE:
        if delta.changed_count != numel:
            raise invalid_delta(f"{label}: a dense delta changes all {numel} elements", **where)
        return
    ops = ops or ops_for(_device_of(delta))
    if delta.encoding is Encoding.INDICES:
        _check_indices(delta, numel, label, where, ops)
    else:
        _check_bitmap(delta, numel, label, where, ops)


def _device_of(delta: Delta) -> torch.device:
    part = delta.bitmap if delta.bitmap is not None else delta.indices
    return part.device if part is not None else delta.values.device


def _check_indices(delta: Delta, numel: int, label: str, where: dict[str, str], ops: TorchOps) -> None:
    idx = delta.indices
    if idx is None or delta.bitmap is not None:
        raise invalid_delta(f"{label}: an indices delta needs indices and no bitmap", **where)
    if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
        raise invalid_delta(
            f"{label}: indices must be one dimension of int32 or int64, got {idx.dtype}", **where
        )
    if idx.dtype == torch.int32 and numel >= INT32_INDEX_LIMIT:
        raise invalid_delta(f"{label}: int32 indices cannot address {numel} elements", **where)
    if idx.numel() != delta.changed_count:
        raise invalid_delta(f"{label}: {idx.numel()} indices for {delta.changed_count} changes", **where)
    if idx.numel() == 0:
        return
    lo, hi = int(idx[0]), int(idx[-1])
    if lo < 0 or hi >= numel:
        raise invalid_delta(f"{label}: index {lo if lo < 0 else hi} outside [0, {numel})", **where)
    if not ops.ascending(idx):
        raise invalid_delta(f"{label}: indices are not strictly ascending (duplicated or unsorted)", **where)


def _check_bitmap(delta: Delta, numel: int, label: str, where: dict[str, str], ops: TorchOps) -> None:
    bm = delta.bitmap
    if bm is None or delta.indices is not None:
        raise invalid_delta(f"{label}: a bitmap delta needs a bitmap and no indices", **where)
    if bm.dtype != torch.uint8 or bm.dim() != 1:
        raise invalid_delta(f"{label}: the bitmap must be one dimension of uint8, got {bm.dtype}", **where)
    if bm.numel() != (numel + 7) // 8:
        raise invalid_delta(
            f"{label}: bitmap of {bm.numel()} bytes for {numel} elements (needs {(numel + 7) // 8})", **where
        )
    tail = numel % 8
    if tail and int(bm[-1]) >> tail:
        raise invalid_delta(f"{label}: the bitmap has bits set past element {numel}", **where)
    set_bits = ops.popcount(bm)
    if set_bits != delta.changed_count:
        raise invalid_delta(
            f"{label}: the bitmap sets {set_bits} bits for {delta.changed_count} changes", **where
        )


def apply_delta(
    target: torch.Tensor, delta: Delta, *, ops: TorchOps | None = None, checked: bool = False, **where: str
) -> None:
    """Write ``delta``'s values into ``target`` in place (any strides, any device).

    The whole delta is checked first (``check_delta``; ``checked=True`` when the caller just did)
    and nothing is written when it does not fit. Indices, bitmap and values are moved to the
    target's device if they are elsewhere.
    """
    if not checked:
        check_delta(target, delta, ops=ops, **where)
    if delta.changed_count == 0:
        return
    device = target.device
    ops = ops or ops_for(device)
    bits = as_bits(target)
    values = _moved(delta.values, device).view(bits.dtype)
    if delta.encoding is Encoding.DENSE:
        bits.copy_(values.view(bits.shape))
        return
    if delta.encoding is Encoding.BITMAP:
        assert delta.bitmap is not None
        bitmap = _moved(delta.bitmap, device)
        if bits.is_contiguous():
            ops.place_bitmap(bits.view(-1), bitmap, values)
        else:
            mask = ops.unpack(bitmap)[: delta.numel]
            bits.masked_scatter_(mask.view(bits.shape), values)
        return
    assert delta.indices is not None
    idx = _moved(delta.indices, device)
    if bits.is_contiguous():
        ops.put(bits.view(-1), idx, values)
    else:
        bits.index_put_(torch.unravel_index(idx.to(torch.int64), bits.shape), values)


def _moved(t: torch.Tensor, device: torch.device) -> Any:
    return t if t.device == device else t.to(device)
