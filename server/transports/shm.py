"""The worker's host shared-memory importer: reads a sender's POSIX segment, never maps it.

The transport table (``weightwire.core.transports.table.HOST_SHM``) names ``HostShmImporter``. A segment
is opened ``O_RDONLY | O_NOFOLLOW | O_NONBLOCK`` (a FIFO under a valid name must not block the
worker) and must be a regular file; the worker never unlinks it (the sender owns it).

Why read instead of map: the sender can shrink its segment while the worker copies out of it (a
bug, or on purpose), and touching a mapped page past the new end raises SIGBUS, which kills the
worker; a private mapping faults the same way. ``pread`` of a file that shrank returns fewer bytes
instead, so a shrinking segment costs the update (``INVALID_SIZE``) and never the worker. The owned
byte ranges are read into one staging buffer per importer, at most ``COPY_CHUNK_BYTES`` at a time
or one larger tensor (``weightwire.server.rules.views.copy_plan``); the engine then copies from there.
"""

from __future__ import annotations

import concurrent.futures
import os
import stat
import threading
import zlib
from collections.abc import Hashable

import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports import table as transports
from weightwire.core.transports.shm import SHM_DIR, check_shm_name
from weightwire.server.rules.views import ReadBatch
from weightwire.server.transports.importer import ImportContext, ImportedPayload, PayloadImporter
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["COPY_CHUNK_BYTES", "HostShmImporter"]

# Staging for one read batch: batches hold at most this many bytes, or one tensor larger than that.
COPY_CHUNK_BYTES = 64 * 1024 * 1024


class _Staging:
    """The importer's staging buffer: allocated once, reused for every batch (one update runs at a
    time, its buckets one after another, and the engine is done with a batch when load returns).
    It grows to the largest batch read (``COPY_CHUNK_BYTES``, or the largest single tensor) and is
    kept: a fresh buffer per batch would take a page fault on every page of it, every update."""

    def __init__(self, min_bytes: int) -> None:
        self._min_bytes = min_bytes
        self._kept: torch.Tensor | None = None
        # Every batch is read to the same place of the kept buffer each time, so its views (and the
        # adapter's prepared load of them: ``views.batch_views``) hold for as long as the buffer
        # does; emptied whenever the buffer is replaced or let go.
        self.view_memo: dict[int, object] = {}

    def get(self, nbytes: int) -> torch.Tensor:
        if self._kept is None or self._kept.numel() < nbytes:
            self.view_memo.clear()
            self._kept = None  # let the smaller one go before the larger one is made
            self._kept = torch.empty(max(nbytes, self._min_bytes), dtype=torch.uint8)
        return self._kept[:nbytes]

    def release(self) -> None:
        self.view_memo.clear()
        self._kept = None


def _pread_exact(fd: int, dst: memoryview, offset: int) -> int:
    """Read ``len(dst)`` bytes at ``offset``; returns how many were there (fewer: the file is shorter)."""
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


# Batches at least this large are read by two threads at once.
_SPLIT_READ_BYTES = 8 * 1024 * 1024
_PAGE = 4096
_READER_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_READER_POOL_LOCK = threading.Lock()
_Piece = tuple[torch.Tensor, int]


def _reader_pool() -> concurrent.futures.ThreadPoolExecutor:
    """One helper thread per process (a worker reads one batch at a time)."""
    global _READER_POOL
    with _READER_POOL_LOCK:
        if _READER_POOL is None:
            _READER_POOL = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="ww-shm-read"
            )
        return _READER_POOL


def _halves(pieces: list[_Piece], total: int) -> tuple[list[_Piece], list[_Piece]]:
    """The (destination, offset) pieces split into two runs of about ``total / 2`` bytes, cutting
    the piece the middle falls in at a page boundary."""
    half = total // 2
    first: list[_Piece] = []
    second: list[_Piece] = []
    used = 0
    for dst, offset in pieces:
        n = dst.numel()
        if used >= half:
            second.append((dst, offset))
        elif used + n <= half:
            first.append((dst, offset))
        else:
            cut = (half - used) // _PAGE * _PAGE
            if cut:
                first.append((dst[:cut], offset))
            second.append((dst[cut:], offset + cut))
        used += n
    return first, second


class _HostShmFile:
    """An open segment (one per segment per update): fetch reads the batch's ranges into staging."""

    copy_chunk_bytes: int | None = COPY_CHUNK_BYTES

    def __init__(self, name: str, fd: int, size_bytes: int, staging: _Staging) -> None:
        self.name = name
        self._fd: int | None = fd
        self.size_bytes = size_bytes
        self._staging = staging

    @property
    def view_memo(self) -> dict[int, object]:
        """The staging buffer's remembered views: a batch's bytes land at the same place every time."""
        return self._staging.view_memo

    def _open_fd(self) -> int:
        if self._fd is None:
            raise WeightwireError(
                Reason.HANDLE_OPEN_FAILED, f"shared memory {self.name!r} was already closed"
            )
        return self._fd

    def _read(self, dst: torch.Tensor, offset: int) -> None:
        fd = self._open_fd()
        got = _pread_exact(fd, dst.numpy().data, offset)
        if got < dst.numel():
            now = os.fstat(fd).st_size
            raise WeightwireError(
                Reason.INVALID_SIZE,
                f"shared memory {self.name!r} shrank to {now} bytes while this worker read it (it needed bytes up to "
                f"{offset + dst.numel()}); the sender must leave a segment as it is until the bucket is acked",
                name=self.name,
            )

    def fetch(self, batch: ReadBatch) -> torch.Tensor:
        base = self._staging.get(batch.size_bytes)
        pieces = [
            (base[seg.staging_at : seg.staging_at + seg.end - seg.start], seg.start) for seg in batch.segments
        ]
        if batch.size_bytes < _SPLIT_READ_BYTES:
            self._read_all(pieces)
            return base
        # A large batch is read in two halves at once (pread releases the interpreter lock, and
        # one thread alone copies well below memory speed): a helper thread takes the second half.
        first, second = _halves(pieces, batch.size_bytes)
        helper = _reader_pool().submit(self._read_all, second)
        try:
            self._read_all(first)
        finally:
            helper.result()
        return base

    def _read_all(self, pieces: list[tuple[torch.Tensor, int]]) -> None:
        for dst, offset in pieces:
            self._read(dst, offset)

    def crc32(self, size_bytes: int) -> int:
        crc = 0
        for start in range(0, size_bytes, COPY_CHUNK_BYTES):
            chunk = self._staging.get(min(COPY_CHUNK_BYTES, size_bytes - start))
            self._read(chunk, start)
            crc = zlib.crc32(chunk.numpy().data, crc)
        return crc

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class HostShmImporter(PayloadImporter):
    """POSIX shared memory created by the sender; opened read-only, read with pread, never unlinked."""

    TRANSPORT = transports.HOST_SHM

    def __init__(self) -> None:
        self._staging = _Staging(COPY_CHUNK_BYTES)

    def check(self, payload: pb.Payload) -> None:
        check_shm_name(payload.host_shm.name)

    def cache_key(self, payload: pb.Payload) -> Hashable | None:
        return (self.field_name, check_shm_name(payload.host_shm.name))

    def open(self, payload: pb.Payload, ctx: ImportContext) -> tuple[ImportedPayload, bool]:
        bare = check_shm_name(payload.host_shm.name)
        path = os.path.join(SHM_DIR, bare)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            raise WeightwireError(
                Reason.HANDLE_OPEN_FAILED,
                f"cannot open shared memory {bare!r}: {e.strerror}; the sender must keep the segment alive until acked",
                name=bare,
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise WeightwireError(
                    Reason.HANDLE_OPEN_FAILED,
                    f"shared memory {bare!r} is not a regular file (a segment is one)",
                    name=bare,
                )
            if info.st_size == 0:
                raise WeightwireError(Reason.INVALID_SIZE, f"shared memory {bare!r} is empty", name=bare)
        except BaseException:
            os.close(fd)
            raise
        return _HostShmFile(bare, fd, info.st_size, self._staging), True

    def release(self) -> None:
        self._staging.release()
