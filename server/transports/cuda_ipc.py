"""The worker's CUDA IPC importer, plugged into ``weightwire.server.transports.importer``.

The transport table (``weightwire.core.transports.table.CUDA_IPC``) names ``CudaIpcImporter``;
``weightwire.server.transports.importer.make_importers`` makes one per worker service. The service has already picked the payload (its own GPU,
or with the header's consent a peer GPU of this host); this importer maps the payload's GPU UUID
to this process's device index (never an index from the sender: CUDA_VISIBLE_DEVICES differs per
process), reopens the storage there and hands out views. A peer payload is opened on the peer GPU;
the adapter's copy into its own GPU then crosses NVLink/PCIe.

Opened storages stay cached per importer (``weightwire.core.transports.cuda_ipc.CudaIpcCache``, bounded LRU)
so senders that reuse their staging buffers open each handle once per worker process.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Hashable, Sequence

import torch
from weightwire.core.devices import DeviceRef, local_cuda_index
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports import table as transports
from weightwire.core.transports.cuda_ipc import CudaIpcCache, CudaIpcFields, OpenedStorage
from weightwire.server.rules.views import ReadBatch
from weightwire.server.transports.importer import ImportContext, ImportedPayload, PayloadImporter
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["CudaIpcImporter", "CudaIpcMapping"]


class CudaIpcMapping:
    """One bucket's use of an opened CUDA storage; ``close`` leaves the cached mapping open.

    The first read of its bytes (``fetch``, ``view``, ``crc32``) waits for the producer's event when
    the payload carried one: a kept mapping is live memory the producer may still be writing. Views
    built over it may be kept in ``view_memo`` for later buckets of the same layout (the mapping's
    bytes stay where they are while the cache holds it).
    """

    copy_chunk_bytes: int | None = None

    def __init__(self, opened: OpenedStorage, source: DeviceRef, peer: bool) -> None:
        self._flat: torch.Tensor | None = opened.flat
        self._wait_ready: Callable[[], None] | None = opened.wait_ready if opened.ready_event is not None else None
        self.view_memo = opened.view_memo
        self.size_bytes = opened.size_bytes
        self.device_index = opened.device_index
        self.source_device = source
        self.handle_opened = opened.opened
        self.peer_device_import = peer
        self.open_duration_ns = opened.open_duration_ns

    def _bytes(self) -> torch.Tensor:
        if self._flat is None:
            raise WeightwireError(Reason.HANDLE_OPEN_FAILED, "CUDA IPC mapping used after close")
        if self._wait_ready is not None:
            self._wait_ready()
            self._wait_ready = None
        return self._flat

    def view(self, offset_bytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A tensor on the payload's GPU over bytes [offset, offset + nbytes); read it only."""
        flat = self._bytes()
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if offset_bytes < 0 or offset_bytes + nbytes > self.size_bytes:
            # The service validated bounds already; this guards the slicing below.
            raise WeightwireError(
                Reason.TENSOR_OUT_OF_BOUNDS,
                f"view [{offset_bytes}, +{nbytes}) lies beyond the CUDA storage of {self.size_bytes} bytes",
            )
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype, device=flat.device)
        raw = flat[offset_bytes : offset_bytes + nbytes]
        if offset_bytes % dtype.itemsize:
            # A misaligned element type cannot alias the bytes; one device copy keeps it correct.
            raw = raw.clone()
        return raw.view(dtype).view(tuple(shape))

    def fetch(self, batch: ReadBatch) -> torch.Tensor:
        """The storage as uint8 on its GPU, in place (``views.views_over`` views it)."""
        return self._bytes()[: self.size_bytes]

    def crc32(self, size_bytes: int) -> int:
        data = self._bytes()[:size_bytes].cpu().numpy().tobytes()
        return zlib.crc32(data)

    def close(self) -> None:
        self._flat = None
        self._wait_ready = None
        self.view_memo = None


class CudaIpcImporter(PayloadImporter):
    """CUDA IPC handles, opened on the GPU the payload's UUID names and cached across updates."""

    TRANSPORT = transports.CUDA_IPC
    reusable = True
    # Every mapping waits for its payload's producer event before its bytes are read (see
    # CudaIpcMapping); the worker's manifest says so (ShardManifest.waits_for_cuda_ipc_events).
    waits_for_producer_events = True

    def __init__(self, cache: CudaIpcCache | None = None) -> None:
        self._cache = cache
        self._lock = threading.Lock()

    @property
    def cache(self) -> CudaIpcCache:
        with self._lock:
            if self._cache is None:
                self._cache = CudaIpcCache()
            return self._cache

    @property
    def handles_opened(self) -> int:
        """Handles this importer opened since it was made (cache misses)."""
        return self.cache.opens

    def check(self, payload: pb.Payload) -> None:
        CudaIpcFields.from_proto(payload.cuda_ipc)

    def cache_key(self, payload: pb.Payload) -> Hashable | None:
        return (self.field_name, CudaIpcFields.from_proto(payload.cuda_ipc).cache_key)

    def open(self, payload: pb.Payload, ctx: ImportContext) -> tuple[ImportedPayload, bool]:
        fields = CudaIpcFields.from_proto(payload.cuda_ipc)
        index = self.local_index(ctx.source, peer=ctx.peer, own=ctx.own_device)
        opened = self.cache.open(fields, index)
        mapping = CudaIpcMapping(opened, ctx.source, ctx.peer)
        return mapping, opened.opened

    @staticmethod
    def local_index(source: DeviceRef, *, peer: bool, own: DeviceRef) -> int:
        """This process's index of the GPU named by ``source`` (a UUID), or a precise error."""
        if not source.is_cuda:
            raise WeightwireError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"a CUDA IPC handle is labelled with a non-CUDA device {source}; label it with the GPU UUID",
                source=str(source),
            )
        if not torch.cuda.is_available():
            raise WeightwireError(
                Reason.TRANSPORT_UNAVAILABLE,
                "this worker has no usable CUDA device, so it cannot import CUDA IPC payloads; "
                "send host shared memory or inline bytes instead",
                own_device=str(own),
            )
        index = local_cuda_index(source)
        if index is None:
            if peer:
                raise WeightwireError(
                    Reason.PEER_DEVICE_UNAVAILABLE,
                    f"peer import of a payload on {source} was allowed, but this worker process cannot see "
                    "that GPU (check CUDA_VISIBLE_DEVICES: a peer import needs both GPUs visible)",
                    source=str(source),
                    own_device=str(own),
                )
            raise WeightwireError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"the payload's GPU {source} is not visible to this worker process",
                source=str(source),
                own_device=str(own),
            )
        return index

    def held_mappings(self) -> int:
        return self.cache.open_mappings

    def release(self) -> None:
        self.cache.release_all()

