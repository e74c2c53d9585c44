"""``StagingBuffer``: the flat byte buffer an exporter hands to workers, its CRC-32, and whether
this thread's payloads go only to workers that wait for their producer events. Re-exported by
``weightwire.client.transports.exporter``; below it so that what a bucket is sent as
(``weightwire.client.transports.route``) can name a buffer without importing the exporters.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import zlib
from collections.abc import Iterator

import torch
from weightwire.core.errors import Reason, WeightwireError

__all__ = ["StagingBuffer", "consumers_wait", "consumers_wait_for_events", "crc32_of"]

# Per pushing thread: whether every worker of the push it runs waits for a payload's producer event
# before reading (``consumers_wait_for_events``).
_push_scope = threading.local()


@contextlib.contextmanager
def consumers_wait_for_events(wait: bool) -> Iterator[None]:
    """Within this block, on this thread, ``StagingBuffer.ready`` may record a producer event that
    goes with the payload and return at once, instead of waiting until its writes finished:
    ``wait`` says every worker that gets this thread's payloads waits for that event before it
    reads (their manifests' ``waits_for_cuda_ipc_events``). Off everywhere else."""
    before = getattr(_push_scope, "wait", False)
    _push_scope.wait = wait
    try:
        yield
    finally:
        _push_scope.wait = before


def consumers_wait() -> bool:
    """Whether payloads exported on this thread now go only to workers that wait for their events."""
    return bool(getattr(_push_scope, "wait", False))


def crc32_of(data: torch.Tensor) -> int:
    """zlib CRC-32 of a flat uint8 tensor's bytes (the contract's CHECKSUM_ALGORITHM_CRC32)."""
    return zlib.crc32(data.detach().cpu().contiguous().numpy().data) & 0xFFFFFFFF


class StagingBuffer(abc.ABC):
    """A flat byte buffer an exporter can hand to workers.

    ``base_offset_bytes`` is where the caller's data starts inside the exported storage (non-zero
    when ``wrap`` exported a view into a larger buffer); tensor offsets sent on the wire are relative
    to the storage, so the pusher adds it to every spec.
    """

    capacity_bytes: int
    base_offset_bytes: int = 0

    @abc.abstractmethod
    def tensor(self) -> torch.Tensor:
        """1-D uint8 tensor over the usable bytes (starting at ``base_offset_bytes``)."""

    def ready(self) -> None:  # noqa: B027 - optional hook
        """Called after packing and before export: make the writes visible to other processes
        (a CUDA buffer synchronises here, or, within ``consumers_wait_for_events(True)``, records
        the event its next payload carries)."""

    def crc32(self, size_bytes: int) -> int:
        """zlib CRC-32 of the storage's first ``size_bytes`` bytes (for verify_checksums)."""
        if self.base_offset_bytes:
            raise WeightwireError(
                Reason.INVALID_CHECKSUM,
                "cannot checksum a wrapped buffer that does not start at its storage's first byte",
            )
        return crc32_of(self.tensor()[:size_bytes])

    def close(self) -> None:  # noqa: B027 - buffers that own nothing need no cleanup
        """Release the buffer (unlink a segment, free device memory). Idempotent."""
