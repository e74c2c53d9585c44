"""The worker's CUDA IPC importer, plugged into ``weightwire.server.transports.importer``.

The transport table (``weightwire.core.transports.table.CUDA_IPC``) names ``CudaIpcImporter``;
``weightwire.server.transports.importer.make_importers`` makes one per worker service. The service has already picked the payload (its own GPU,
or with the header's consent a peer GPU of this host); this importer maps the payload's GPU UUID
to this process's device index (never an index from the sender: CUDA_VISIBLE_DEVICES differs per
process), reopens the storage there and hands out views. A peer payload is opened on the peer GPU;
the adapter's copy into its own GPU then crosses NVLink/PCIe.

Opened storages stay cached per importer (``weightwire.core.transports.cuda_ipc.CudaIpcCache``, bounded LRU)
so senders that reuse their staging buffers open each handle once per worker process.

A payload of several storages (``CudaIpcHandle.storages``: a trainer's own parameters, exported
where they live) is kept by ``StorageSetCache``: each storage opened when a tensor first needs it,
the views over them built once per layout, and the mappings the trainer no longer lists dropped
(``CudaIpcStorageMapping``); a set sent with a ``storage_set_id`` may come in later updates as
that name alone.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch
from weightwire.core.devices import DeviceRef, local_cuda_index
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports import table as transports
from weightwire.core.transports.cuda_ipc import CudaIpcCache, CudaIpcFields, OpenedStorage
from weightwire.core.transports.cuda_ipc_storages import OpenedStorageSet, StorageSetCache, names_storage_set
from weightwire.server.rules.views import ReadBatch
from weightwire.server.transports.importer import ImportContext, ImportedPayload, PayloadImporter
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["CudaIpcImporter", "CudaIpcMapping", "CudaIpcStorageMapping"]

_Held = TypeVar("_Held")


class _ReadsAfterProducer:
    """What both mapping kinds do before a read: refuse a closed mapping, and wait for the
    producer's event (when the payload carried one) at the first read only."""

    _wait_ready: Callable[[], None] | None

    def _readable(self, held: _Held | None) -> _Held:
        if held is None:
            raise WeightwireError(Reason.HANDLE_OPEN_FAILED, "CUDA IPC mapping used after close")
        if self._wait_ready is not None:
            self._wait_ready()
            self._wait_ready = None
        return held


class CudaIpcMapping(_ReadsAfterProducer):
    """One bucket's use of an opened CUDA storage; ``close`` leaves the cached mapping open.

    The first read of its bytes (``fetch``, ``view``, ``crc32``) waits for the producer's event when
    the payload carried one: a kept mapping is live memory the producer may still be writing. Views
    built over it may be kept in ``view_memo`` for later buckets of the same layout (the mapping's
    bytes stay where they are while the cache holds it).
    """

    copy_chunk_bytes: int | None = None

    def __init__(self, opened: OpenedStorage, source: DeviceRef, peer: bool) -> None:
        self._flat: torch.Tensor | None = opened.flat
        self._wait_ready: Callable[[], None] | None = (
            opened.wait_ready if opened.ready_event is not None else None
        )
        self.view_memo = opened.view_memo
        self.size_bytes = opened.size_bytes
        self.device_index = opened.device_index
        self.source_device = source
        self.handle_opened = opened.opened
        self.peer_device_import = peer
        self.open_duration_ns = opened.open_duration_ns

    def _bytes(self) -> torch.Tensor:
        return self._readable(self._flat)

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


class CudaIpcStorageMapping(_ReadsAfterProducer):
    """One bucket's use of a kept payload of several storages; ``close`` leaves it kept.

    ``views_of`` places each tensor in its own storage (``views.batch_views`` asks it instead of
    viewing one flat buffer); ``fetch`` is where the producer event is waited for, once per use, as
    for a single storage. Views are kept in ``view_memo`` while the set is kept. ``kept_as``: the
    trainer's name for the set, which this worker keeps it under (the bucket's ack says so).
    """

    copy_chunk_bytes: int | None = None

    def __init__(
        self,
        cache: StorageSetCache,
        entry: OpenedStorageSet,
        source: DeviceRef,
        peer: bool,
        opened: bool,
        device: torch.device | None = None,
        kept_as: bytes = b"",
    ) -> None:
        self._device = device if device is not None else torch.device("cuda", entry.device_index)
        self._cache: StorageSetCache | None = cache
        self._entry = entry
        event = entry.event
        self._wait_ready: Callable[[], None] | None = event.synchronize if event is not None else None
        self.view_memo: dict[int, object] | None = entry.view_memo
        self.size_bytes = entry.storages.size_bytes
        self.device_index = entry.device_index
        self.source_device = source
        self.handle_opened = opened
        self.peer_device_import = peer
        self.open_duration_ns = 0
        self.kept_as = kept_as

    def _ready(self) -> StorageSetCache:
        return self._readable(self._cache)

    def fetch(self, batch: ReadBatch) -> torch.Tensor:
        """Nothing to fetch (each tensor is viewed in its own storage by ``views_of``); waits for
        the producer's event."""
        self._ready()
        return torch.empty((0,), dtype=torch.uint8, device=self._device)

    def views_of(self, batch: ReadBatch) -> list[torch.Tensor]:
        """The tensor of each item of ``batch``, in the storage that holds its payload bytes."""
        cache = self._ready()
        entry = self._entry
        sets = entry.storages
        typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        out: list[torch.Tensor] = []
        for item, pos in zip(batch.items, batch.positions, strict=True):
            if item.numel == 0:
                out.append(torch.empty(item.shape, dtype=item.dtype, device=self._device))
                continue
            itemsize = item.dtype.itemsize
            index, local = sets.storage_at(pos, item.numel * itemsize)
            if local % itemsize:
                raise WeightwireError(
                    Reason.INVALID_OFFSET,
                    f"a tensor at payload byte {pos} is not aligned to its {itemsize}-byte elements inside its storage",
                )
            t = typed.get((index, item.dtype))
            if t is None:
                flat = cache.storage(entry, index)
                t = flat[: flat.numel() - flat.numel() % itemsize].view(item.dtype)
                typed[(index, item.dtype)] = t
            out.append(t.as_strided(item.shape, item.stride, t.storage_offset() + local // itemsize))
        return out

    def crc32(self, size_bytes: int) -> int:
        """CRC-32 of the payload's first ``size_bytes`` bytes, gaps between storages read as zeros."""
        cache = self._ready()
        sets = self._entry.storages
        crc, at = 0, 0
        for i, start in enumerate(sets.offsets):
            if start >= size_bytes:
                break
            if start > at:
                crc = zlib.crc32(bytes(start - at), crc)
            flat = cache.storage(self._entry, i)
            end = min(size_bytes, start + int(flat.numel()))
            crc = zlib.crc32(flat[: end - start].cpu().numpy().tobytes(), crc)
            at = end
        if at < size_bytes:
            crc = zlib.crc32(bytes(size_bytes - at), crc)
        return crc

    def close(self) -> None:
        self._cache = None
        self._wait_ready = None
        self.view_memo = None


class CudaIpcImporter(PayloadImporter):
    """CUDA IPC handles, opened on the GPU the payload's UUID names and cached across updates."""

    TRANSPORT = transports.CUDA_IPC
    reusable = True

    def __init__(
        self, cache: CudaIpcCache | None = None, storage_sets: StorageSetCache | None = None
    ) -> None:
        self._cache = cache
        self._sets = storage_sets
        self._lock = threading.Lock()

    def announce(self, manifest: pb.ShardManifest, *, keeps_tensors: bool) -> None:
        # Every mapping waits for its payload's producer event before its bytes are read (see
        # CudaIpcMapping), so trainers skip their own wait; payloads of several storages
        # (CudaIpcHandle.storages) are read, so trainers export tensors where they live.
        manifest.waits_for_cuda_ipc_events = True
        manifest.imports_cuda_ipc_storages = True

    def _caches(self) -> tuple[CudaIpcCache, StorageSetCache]:
        """The mapping caches of single handles and of storage sets, made at first use."""
        with self._lock:
            if self._cache is None:
                self._cache = CudaIpcCache()
            if self._sets is None:
                self._sets = StorageSetCache()
            return self._cache, self._sets

    @property
    def storage_sets(self) -> StorageSetCache:
        return self._caches()[1]

    @property
    def cache(self) -> CudaIpcCache:
        return self._caches()[0]

    @property
    def handles_opened(self) -> int:
        """Handles this importer opened since it was made (cache misses)."""
        return self.cache.opens + self.storage_sets.opens

    def check(self, payload: pb.Payload) -> None:
        if names_storage_set(payload.cuda_ipc):
            self.storage_sets.parse(payload.cuda_ipc)
            return
        CudaIpcFields.from_proto(payload.cuda_ipc)

    def cache_key(self, payload: pb.Payload) -> Hashable | None:
        if names_storage_set(payload.cuda_ipc):
            return (self.field_name, self.storage_sets.parse(payload.cuda_ipc)[0])
        return (self.field_name, CudaIpcFields.from_proto(payload.cuda_ipc).cache_key)

    def open(self, payload: pb.Payload, ctx: ImportContext) -> tuple[ImportedPayload, bool]:
        index = self.local_index(ctx.source, peer=ctx.peer, own=ctx.own_device)
        if names_storage_set(payload.cuda_ipc):
            sets = self.storage_sets
            entry, new = sets.open(payload.cuda_ipc, index)
            # Opened: the set is kept under the payload's name (sent with it, or the one it names).
            name = bytes(payload.cuda_ipc.storage_set_id)
            return CudaIpcStorageMapping(sets, entry, ctx.source, ctx.peer, new, kept_as=name), new
        fields = CudaIpcFields.from_proto(payload.cuda_ipc)
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
        # A kept payload of several storages counts as one mapping, as it counts as one handle
        # opened (``storage_sets.open_storages`` says how many storages it maps).
        return self.cache.open_mappings + self.storage_sets.kept_sets

    def release(self) -> None:
        self.cache.release_all()
        self.storage_sets.release_all()
