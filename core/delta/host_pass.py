"""The trainer's one pass over a host tensor: cast, diff against the base, base brought forward,
result checksum, chunk by chunk while each chunk is in the CPU's cache.

Done as separate whole-tensor steps, a delta push reads and writes the model several times over:
the cast writes a whole copy in the sent dtype, the diff reads it and the base, the base is
written, and the result checksum reads the base again. Here each chunk of ``HOST_CHUNK_ELEMENTS``
elements is cast into a cache-sized buffer, compared with the base's chunk, its changes gathered
and written into the base, and the checksum continued over it (``checksums.running_crc``), so
the source and the base are each read once from memory and the base written only where it
changed. Memory besides the result: a chunk's buffer and mask per thread; a BITMAP result also
needs a mask of one byte per element while its bitmap is made.

The result is the one ``encode`` gives for the same tensors (the encoding ``choose_encoding``
picks, the same indices, bitmap and values; the tests compare both), and the base equals the
sent tensor afterwards, as after ``BaseKeeper.record``. A DENSE result's values are the base's
own bytes: valid until the next update brings the base forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from weightwire.core.delta.encoding import HOST_CHUNK_ELEMENTS
from weightwire.core.delta.record import Delta, Encoding, as_bits, choose_encoding, index_dtype_for

# Elements of one cast call when several threads run passes: at most torch's grain size, so that
# each call runs on its own thread instead of all threads' calls sharing torch's intra-op pool.
_SERIAL_CAST_ELEMENTS = 32768

RunningChecksum = Callable[[np.ndarray, int], int]


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What one pass gave: the changes and the checksum of the whole sent tensor (None when no
    running checksum was asked for)."""

    delta: Delta
    checksum: int | None


def host_pass(
    base: torch.Tensor,
    new: torch.Tensor,
    *,
    running: RunningChecksum | None,
    serial_cast: bool = False,
) -> PassResult:
    """Bring ``base`` (host, contiguous, the sent dtype) to ``new`` cast to ``base.dtype`` (host,
    contiguous, same shape) and return the changes and ``running``'s checksum of the result.

    ``serial_cast``: cast in pieces small enough to run on the calling thread alone (for passes
    run on several threads at once).
    """
    numel = base.numel()
    base_bits = as_bits(base).view(-1).numpy()
    src = new.detach().view(-1)
    same_dtype = new.dtype == base.dtype
    src_bits = as_bits(src).numpy() if same_dtype else None
    itemsize = base.element_size()
    index_size = index_dtype_for(numel).itemsize
    dense_bytes = numel * itemsize
    chunk = min(HOST_CHUNK_ELEMENTS, max(numel, 1))
    buf = None if same_dtype else torch.empty(chunk, dtype=base.dtype)
    buf_bits = None if buf is None else as_bits(buf).numpy()
    mask = np.empty(chunk, dtype=np.bool_)
    crc = 0
    changed = 0
    values: list[np.ndarray] | None = []
    indices: list[np.ndarray] | None = []
    for start in range(0, numel, chunk):
        stop = min(start + chunk, numel)
        k = stop - start
        if src_bits is not None:
            fresh = src_bits[start:stop]
        else:
            assert buf is not None and buf_bits is not None
            step = _SERIAL_CAST_ELEMENTS if serial_cast else k
            for at in range(0, k, step):
                end = min(at + step, k)
                buf[at:end].copy_(src[start + at : start + end])
            fresh = buf_bits[:k]
        kept = base_bits[start:stop]
        m = mask[:k]
        np.not_equal(kept, fresh, out=m)
        found = np.flatnonzero(m)
        n = found.size
        if n:
            changed += n
            changes = fresh[found]
            if values is not None and indices is not None:
                values.append(changes)
                indices.append(found + start)
                # once the sparse encodings cannot win, the base's bytes are the values (DENSE)
                if (numel + 7) // 8 + changed * itemsize >= dense_bytes and changed * (
                    index_size + itemsize
                ) >= dense_bytes:
                    values = indices = None
            if n * 4 >= k:
                kept[:] = fresh
            else:
                kept[found] = changes
        if running is not None:
            crc = running(fresh, crc)
    checksum = crc if running is not None else None
    encoding = choose_encoding(numel, changed, itemsize) if values is not None else Encoding.DENSE
    if encoding is Encoding.DENSE or values is None or indices is None:
        bits = torch.from_numpy(base_bits)
        return PassResult(Delta(Encoding.DENSE, numel, base.dtype, numel, values=bits), checksum)
    vals = torch.from_numpy(np.concatenate(values) if values else base_bits[:0].copy())
    idx = np.concatenate(indices) if indices else np.zeros(0, dtype=np.int64)
    if encoding is Encoding.BITMAP:
        full = np.zeros(numel, dtype=np.bool_)
        full[idx] = True
        bitmap = torch.from_numpy(np.packbits(full, bitorder="little"))
        return PassResult(Delta(encoding, numel, base.dtype, changed, values=vals, bitmap=bitmap), checksum)
    idx_t = torch.from_numpy(idx.astype(np.int32 if index_size == 4 else np.int64, copy=False))
    return PassResult(Delta(encoding, numel, base.dtype, changed, values=vals, indices=idx_t), checksum)
