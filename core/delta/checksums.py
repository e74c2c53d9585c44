"""Checksums of a tensor's bytes: what a worker verifies after applying a delta.

Three algorithms of the contract's ``ChecksumAlgorithm``, both over the target's elements in
row-major order, whatever its strides:

- ``CRC32C`` (CRC-32 with the Castagnoli polynomial, through the ``crc32c`` package; a process
  without the package neither lists nor sends it): the host's choice. CPUs have an instruction for it, so it runs several times faster than zlib's CRC-32 on
  the same bytes (BENCHMARKS.md, "Deltas"); it reads the tensor in place and releases the GIL. A
  trainer uses it only with workers that list it in their manifest
  (``ShardManifest.delta_checksum_algorithms``); workers from before it get ``CRC32``.
- ``CRC32`` (zlib's CRC-32 of the bytes, the algorithm buckets already use): what every worker
  verifies. On the host it reads the tensor in place, and zlib releases the GIL while it runs. A
  CUDA tensor must be copied to the host for either CRC, which is why there is a third algorithm.
- ``WEIGHTED_SUM64``: sum of (2i + 1) * bits(i) modulo 2^64, where bits(i) is element i's raw bits
  as an unsigned integer. It is computed with integer kernels on the tensor's own device, so a
  CUDA worker checks its weights at memory speed without moving them, and it is linear: the
  trainer updates a base's value from the changed elements alone (``weighted_sum64_update``),
  instead of reading the whole tensor again. Every weight is odd, hence invertible modulo 2^64, so
  a change of any one element always changes the sum. It detects drift (a worker that does not hold
  what the trainer thinks), not an adversary, which is all the check is for: the update stream is
  already authenticated.

``preferred_algorithm`` picks: the weighted sum when the tensors and every recipient are on CUDA,
else (``crc_algorithm``) CRC-32C when every recipient verifies it, else CRC-32. ``running_crc`` continues a CRC over
consecutive pieces of one tensor's bytes (the trainer's one pass over a tensor checksums it
chunk by chunk while the chunk is in cache).
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable, Collection, Iterable
from types import ModuleType

import numpy as np
import torch
from weightwire.core.delta.encoding import as_bits
from weightwire.v1 import weight_transfer_pb2 as pb

_crc32c: ModuleType | None
try:
    _crc32c = importlib.import_module("crc32c")
except ImportError:  # an image installed without it: this process neither lists nor sends CRC32C
    _crc32c = None

_MASK64 = (1 << 64) - 1
# Elements per kernel pass of the weighted sum: bounds its 64-bit temporaries (8 bytes per element
# twice) to 64 MiB on the host and 512 MiB on a GPU, where fewer, larger launches matter more.
_CHUNK_HOST = 1 << 22
_CHUNK_CUDA = 1 << 25
_WEIGHTS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _to_signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def crc32(t: torch.Tensor) -> int:
    """zlib CRC-32 of ``t``'s bytes in row-major order (host: read in place when contiguous)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    flat = as_bits(t).reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy())


def crc32c(t: torch.Tensor) -> int:
    """CRC-32C of ``t``'s bytes in row-major order (host: read in place when contiguous)."""
    if _crc32c is None:
        raise RuntimeError("CRC-32C needs the crc32c package (pip install crc32c)")
    if t.device.type != "cpu":
        t = t.to("cpu")
    flat = as_bits(t).reshape(-1)
    return int(_crc32c.crc32c(flat.view(torch.uint8).numpy()))


def _zlib_crc(data: np.ndarray, crc: int) -> int:
    return zlib.crc32(data.data, crc)


def _castagnoli_crc(data: np.ndarray, crc: int) -> int:
    assert _crc32c is not None
    return int(_crc32c.crc32c(data.data, crc))


# Algorithms whose value can be continued over consecutive pieces of the bytes, by their function
# (bytes, the value so far) -> the value with the bytes.
_RUNNING: dict[int, Callable[[np.ndarray, int], int]] = {pb.CHECKSUM_ALGORITHM_CRC32: _zlib_crc}
if _crc32c is not None:
    _RUNNING[pb.CHECKSUM_ALGORITHM_CRC32C] = _castagnoli_crc


def running_crc(algorithm: pb.ChecksumAlgorithm.ValueType) -> Callable[[np.ndarray, int], int] | None:
    """For CRC32 and CRC32C: a function (bytes, the value over the bytes before them) -> the value
    over both, starting from 0; None for an algorithm that is not continued this way."""
    return _RUNNING.get(algorithm)


def _unsigned64(bits: torch.Tensor) -> torch.Tensor:
    """Raw bits as int64 holding the unsigned value (for 64-bit elements: the same 64 bits)."""
    wide = bits.to(torch.int64)
    if bits.element_size() < 8:
        wide &= (1 << (8 * bits.element_size())) - 1
    return wide


_NP_WEIGHTS: dict[int, np.ndarray] = {}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _np_weighted_sum64(flat: torch.Tensor) -> int:
    # numpy's uint64 arithmetic wraps modulo 2^64 by definition, and its integer dot product runs
    # several times faster than torch's host kernels for the same sum.
    u = flat.numpy().view(_UNSIGNED[flat.element_size()])
    chunk = _CHUNK_HOST
    w = _NP_WEIGHTS.get(chunk)
    if w is None:
        w = _NP_WEIGHTS.setdefault(chunk, np.arange(chunk, dtype=np.uint64) * np.uint64(2) + np.uint64(1))
    total = 0
    for start in range(0, u.size, chunk):
        part = u[start : start + chunk].astype(np.uint64)
        total += int(np.dot(part, w[: part.size])) + 2 * start * int(part.sum(dtype=np.uint64))
    return _to_signed64(total)


def _weights(device: torch.device, length: int) -> torch.Tensor:
    key = (device, length)
    w = _WEIGHTS.get(key)
    if w is None:
        w = _WEIGHTS.setdefault(key, torch.arange(length, dtype=torch.int64, device=device) * 2 + 1)
    return w


def weighted_sum64(t: torch.Tensor) -> int:
    """sum((2i + 1) * bits(i)) mod 2^64 over ``t``'s row-major elements, as a signed int64 value."""
    flat = as_bits(t).reshape(-1)
    if flat.device.type == "cpu":
        return _np_weighted_sum64(flat)
    chunk = _CHUNK_CUDA
    total = 0
    n = flat.numel()
    for start in range(0, n, chunk):
        part = _unsigned64(flat[start : start + chunk])
        w = _weights(flat.device, chunk)[: part.numel()]
        # element start + j weighs 2 * start + (2j + 1): the chunk's weights are reused and the
        # offset enters through the plain sum (torch's int64 arithmetic wraps modulo 2^64).
        weighted = int((part * w).sum())
        plain = int(part.sum())
        total += weighted + 2 * start * plain
    return _to_signed64(total)


def weighted_sum64_update(
    base_sum: int, positions: torch.Tensor, old_bits: torch.Tensor, new_bits: torch.Tensor
) -> int:
    """The weighted sum after the elements at ``positions`` (row-major, int64) went from ``old_bits``
    to ``new_bits``: ``base_sum`` plus their change, at the cost of the changed elements only."""
    if positions.numel() == 0:
        return _to_signed64(base_sum)
    if positions.device.type == "cpu":
        unsigned = _UNSIGNED[new_bits.element_size()]
        w = positions.numpy().astype(np.uint64) * np.uint64(2) + np.uint64(1)
        old = old_bits.numpy().view(unsigned).astype(np.uint64)
        new = new_bits.numpy().view(unsigned).astype(np.uint64)
        return _to_signed64(base_sum + int(np.dot(w, new - old)))
    w = positions.to(torch.int64) * 2 + 1
    change = int((w * (_unsigned64(new_bits) - _unsigned64(old_bits))).sum())
    return _to_signed64(base_sum + change)


def checksum(t: torch.Tensor, algorithm: pb.ChecksumAlgorithm.ValueType) -> int:
    """The value of ``algorithm`` over ``t``, as the contract's ``Checksum.value`` carries it."""
    if algorithm == pb.CHECKSUM_ALGORITHM_CRC32C:
        return crc32c(t)
    if algorithm == pb.CHECKSUM_ALGORITHM_CRC32:
        return crc32(t)
    if algorithm == pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64:
        return weighted_sum64(t)
    raise ValueError(f"no delta checksum algorithm {algorithm}")


# What a manifest that lists no algorithm means: a worker from before CRC32C. What a worker of this
# version verifies a delta's result with (its manifest lists them): those, and CRC32C where the
# crc32c package is installed (a dependency, but an image may leave out its compiled wheel; such a
# worker is then sent CRC32, and such a trainer sends it).
UNLISTED_ALGORITHMS = (pb.CHECKSUM_ALGORITHM_CRC32, pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64)
VERIFIED_ALGORITHMS = ((pb.CHECKSUM_ALGORITHM_CRC32C,) if _crc32c is not None else ()) + UNLISTED_ALGORITHMS


def _listed(
    verified: Iterable[Collection[pb.ChecksumAlgorithm.ValueType]],
) -> list[tuple[pb.ChecksumAlgorithm.ValueType, ...]]:
    """Each recipient's list, an empty one (a worker from before the lists) as what it verifies."""
    return [tuple(v) or UNLISTED_ALGORITHMS for v in verified]


def crc_algorithm(
    verified: Iterable[Collection[pb.ChecksumAlgorithm.ValueType]],
) -> pb.ChecksumAlgorithm.ValueType:
    """CRC32C when every recipient's ``verified`` (its manifest's ``delta_checksum_algorithms``;
    empty: a worker from before CRC32C, which verifies CRC32) lists it and this process has the
    crc32c package, else CRC32; CRC32 for no recipient."""
    lists = _listed(verified)
    if _crc32c is not None and lists and all(pb.CHECKSUM_ALGORITHM_CRC32C in v for v in lists):
        return pb.CHECKSUM_ALGORITHM_CRC32C
    return pb.CHECKSUM_ALGORITHM_CRC32


def preferred_algorithm(
    source: torch.device,
    recipients: Iterable[torch.device | str],
    verified: Iterable[Collection[pb.ChecksumAlgorithm.ValueType]] = (),
) -> pb.ChecksumAlgorithm.ValueType:
    """WEIGHTED_SUM64 when the source and every recipient are CUDA devices and every recipient's
    ``verified`` list has it (an empty list: a worker from before the lists, which verifies it),
    else ``crc_algorithm`` of the lists (none given: CRC32)."""
    lists = _listed(verified)
    kinds = {torch.device(d).type for d in recipients} | {source.type}
    if kinds == {"cuda"} and all(pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64 in v for v in lists):
        return pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64
    return crc_algorithm(lists)
