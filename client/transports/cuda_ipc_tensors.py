"""The fresh-tensor pool side of ``CudaIpcExporter.export_tensors``: what a push of tensors exports.

``ExportedTensors`` is one payload of tensors exported where they live (or packed into the pool);
``PooledExports`` is the part of the exporter that decides, per push, which storages are fresh
(new every step) and packs those into the pool (``cuda_ipc_pool``) while the kept ones stay shared
where they live. Sharing a storage itself (``_share_storage``, torch's CUDA IPC) stays in
``weightwire.client.transports.cuda_ipc``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Collection, Sequence

import torch
from weightwire.client.transports import cuda_ipc_pool
from weightwire.client.transports.cuda_ipc_pool import (
    PoolRegion,
    cat_into,
    cat_runs,
    copy_into,
    lay_out,
    pack_fresh,
)
from weightwire.core.devices import DeviceRef
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["ExportedTensors", "PooledExports"]

# Storages sit in a payload at offsets aligned to this.
_STORAGE_ALIGN = 256


def _align(end: int) -> int:
    return -(-end // _STORAGE_ALIGN) * _STORAGE_ALIGN


@dataclasses.dataclass
class ExportedTensors:
    """Tensors exported where they live: each tensor's byte offset in the payload, the payload's
    size, and its ``CudaIpcStorage`` messages. Holds no storage: the push holds its tensors while
    workers read them, and a storage that dies makes the exporter build the next payload anew."""

    offsets: tuple[int, ...]
    size_bytes: int
    # Each recipient's own shares of the storages (the same storages, places and sizes).
    storages: dict[str, list[pb.CudaIpcStorage]]
    _payloads: dict[tuple[str, bool, bool], pb.Payload] = dataclasses.field(default_factory=dict)
    # Per bucket plan (by id): the plan, its specs at this payload's offsets, and their bytes.
    specs_memo: dict[int, tuple[object, list[object], int]] = dataclasses.field(default_factory=dict)
    # Tensors packed into the fresh-tensor pool (``cuda_ipc_pool``): their indices among the
    # exported tensors and the pool views they are copied into before each send; the region
    # holding those views (kept while this payload is).
    packs: tuple[int, ...] = ()
    pack_views: tuple[torch.Tensor, ...] = ()
    region: PoolRegion | None = None
    # The same places as runs of back-to-back tensors of one dtype (``cuda_ipc_pool.cat_runs``).
    pack_runs: list[tuple[torch.Tensor, list[int]]] = dataclasses.field(default_factory=list)

    def pack(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy this push's fresh tensors (``tensors``: the exported ones, in order) into the pool,
        on the current stream, before the payload's event is recorded."""
        if self.packs:
            if self.region is None:
                raise RuntimeError("this payload's pool buffers were discarded after a failed push")
            srcs = [tensors[i] for i in self.packs]
            if cuda_ipc_pool.PACK_WITH_CAT:
                cat_into(self.pack_runs, srcs)
            else:
                copy_into(self.pack_views, srcs)

    def discard(self) -> None:
        """A push of this payload failed: a cancelled worker may still read its pool buffers, so they
        are never packed into again (the exporter lays out new ones at the next packing push)."""
        if self.packs:
            self.region = None
            self.pack_views = ()
            self.pack_runs = []

    def payload(
        self, recipient: str, label: DeviceRef, event_handle: bytes | None, complete: bool
    ) -> pb.Payload:
        """``recipient``'s payload (built once per event mode and completeness, then the same object),
        named by a random ``storage_set_id``: once the worker acked that it keeps the set, later
        updates send it the name alone (``weightwire.client.update.payload_refs``)."""
        key = (recipient, event_handle is not None, complete)
        msg = self._payloads.get(key)
        if msg is None:
            handle = pb.CudaIpcHandle(
                storages=self.storages[recipient], storages_complete=complete, storage_set_id=os.urandom(16)
            )
            if event_handle is not None:
                handle.event_handle = event_handle
                handle.event_sync_required = True
            msg = pb.Payload(device=label.to_proto(), size_bytes=self.size_bytes, cuda_ipc=handle)
            self._payloads[key] = msg
        return msg


@dataclasses.dataclass(frozen=True)
class StorageShare:
    """One storage shared for ``export_tensors``: the weak reference whose callback forgets it,
    and one share per recipient as a ``CudaIpcStorage`` at payload offset 0."""

    ref: weakref.ref[torch.UntypedStorage]
    messages: dict[str, pb.CudaIpcStorage]


class PooledExports:
    """The exporter's fresh-tensor pool and the storage placement every tensor payload shares.

    Mixed into ``CudaIpcExporter``, which owns the lock, the device and the shares, and
    shares one storage per recipient (``_add_shares``)."""

    device: torch.device
    _lock: threading.RLock
    _generation: int
    _shares: dict[int, StorageShare]
    # At most this many bytes (None: as many as the tensors it packs; 0: never pack, share every
    # storage anew); per recipient group, its payload with the region it packs into; the recipient
    # groups exported to before (a first push shares); the storages the last packing push packed,
    # weakly (pushed again, they are kept ones, and go where they live from then on).
    pool_limit_bytes: int | None
    _pooled: dict[tuple[str, ...], tuple[tuple[object, ...], ExportedTensors]]
    _exported_to: set[tuple[str, ...]]
    _packed_seen: dict[tuple[str, ...], dict[int, weakref.ref[torch.UntypedStorage]]]
    tensors_packed: int

    def _init_pool(self) -> None:
        self.pool_limit_bytes = None
        self._pooled = {}
        self._exported_to = set()
        self._packed_seen = {}
        self.tensors_packed = 0

    def _drop_pool(self) -> object:
        """Forget every group's pool (caller holds the lock); the old buffers, for the caller to drop
        outside it."""
        pooled = self._pooled
        self._pooled = {}
        self._packed_seen = {}
        return pooled

    def _add_shares(
        self, messages: dict[str, list[pb.CudaIpcStorage]], storage: torch.UntypedStorage, at: int
    ) -> bool:
        raise NotImplementedError

    def _place_storages(
        self,
        messages: dict[str, list[pb.CudaIpcStorage]],
        storages: Sequence[torch.UntypedStorage],
        skip: Collection[int] = (),
    ) -> tuple[dict[int, int], int] | None:
        """Each distinct storage not in ``skip`` shared to every recipient, one after another in the
        payload: each storage's payload offset by id, and the payload's end; None when torch refuses
        one. An empty storage has nothing to share: its tensors view nothing, at offset 0."""
        places: dict[int, int] = {}
        end = 0
        for storage in storages:
            sid = id(storage)
            if sid in skip or sid in places:
                continue
            if storage.nbytes() == 0:
                places[sid] = 0
                continue
            at = _align(end)
            if not self._add_shares(messages, storage, at):
                return None
            places[sid] = at
            end = at + int(storage.nbytes())
        return places, end

    def _fresh_storages(self, storages: Sequence[torch.UntypedStorage], group: tuple[str, ...]) -> set[int]:
        """The storages (by id) this push packs into the pool, or none: storages neither shared nor
        packed by the push before (new every step), when there are enough of them to pack
        (``cuda_ipc_pool.pack_fresh``) and this group was exported to before (a first push shares
        where they live: nothing says yet whether the trainer keeps them)."""
        if self.pool_limit_bytes == 0 or group not in self._exported_to:
            return set()
        fresh: dict[int, int] = {}
        seen: set[int] = set()
        distinct = 0
        shares, packed = self._shares, self._packed_seen.get(group, {})
        for storage in storages:
            sid = id(storage)
            if sid in seen:
                continue
            seen.add(sid)
            nbytes = storage.nbytes()
            if nbytes == 0:
                continue
            distinct += 1
            share = shares.get(sid)
            if share is not None and share.ref() is storage:
                continue
            ref = packed.get(sid)
            if ref is not None and ref() is storage:
                continue
            fresh[sid] = nbytes
        if not pack_fresh(len(fresh), distinct, sum(fresh.values())):
            return set()
        return set(fresh)

    def _export_pooled(
        self,
        tensors: Sequence[torch.Tensor],
        storages: Sequence[torch.UntypedStorage],
        group: tuple[str, ...],
        fresh: set[int],
    ) -> ExportedTensors | None:
        """``tensors`` with those in ``fresh`` storages packed into this group's pool region and the
        others where they live, or None (the pool would exceed ``pool_limit_bytes``, the device has
        no room for it, or a storage cannot be shared: every storage is then shared anew). The same
        layout (kept storages and places, packed dtypes and shapes) gives the same payload object."""
        signature = (
            self._generation,
            tuple(
                [
                    (None, t.dtype, t.shape) if id(s) in fresh else (id(s), t.storage_offset())
                    for s, t in zip(storages, tensors, strict=True)
                ]
            ),
        )
        with self._lock:
            known = self._pooled.get(group)
        if known is not None and known[0] == signature and known[1].region is not None:
            self._remember_packed(group, storages, known[1].packs)
            return known[1]
        packs = tuple(
            i for i, (s, t) in enumerate(zip(storages, tensors, strict=True)) if id(s) in fresh and t.numel()
        )
        layout = lay_out([tensors[i].nbytes for i in packs])
        if self.pool_limit_bytes is not None:
            with self._lock:
                others = sum(
                    e.region.layout.total_bytes
                    for g, (_, e) in self._pooled.items()
                    if g != group and e.region is not None
                )
            if others + layout.total_bytes > self.pool_limit_bytes:
                return None
        region = known[1].region if known is not None else None
        if region is None or region.layout != layout:
            with self._lock:
                self._pooled.pop(group, None)
            del known, region  # the old buffers go before the new ones are allocated
            try:
                region = PoolRegion(layout, self.device)
            except torch.OutOfMemoryError:
                return None
        messages: dict[str, list[pb.CudaIpcStorage]] = {r: [] for r in group}
        placed = self._place_storages(messages, storages, fresh)
        if placed is None:
            return None
        places, end = placed
        chunk_at: list[int] = []
        for chunk in region.chunks:
            at = _align(end)
            if not self._add_shares(messages, chunk.untyped_storage(), at):
                return None
            chunk_at.append(at)
            end = at + int(chunk.nbytes)
        packed_at = {i: chunk_at[c] + off for i, (c, off) in zip(packs, layout.places, strict=True)}
        offsets = tuple(
            packed_at[i]
            if i in packed_at
            else (
                places[id(s)] + int(t.storage_offset()) * t.element_size()
                if t.numel() and id(s) in places
                else 0
            )
            for i, (s, t) in enumerate(zip(storages, tensors, strict=True))
        )
        shapes = [(tensors[i].dtype, tensors[i].shape) for i in packs]
        exported = ExportedTensors(
            offsets,
            end,
            messages,
            packs=packs,
            pack_views=tuple(region.views(shapes)),
            region=region,
            pack_runs=cat_runs(layout, region.chunks, shapes),
        )
        with self._lock:
            self._pooled[group] = (signature, exported)
        self._remember_packed(group, storages, packs)
        return exported

    def _remember_packed(
        self, group: tuple[str, ...], storages: Sequence[torch.UntypedStorage], packs: tuple[int, ...]
    ) -> None:
        """The storages this push packs for ``group``, weakly: pushed again, they are kept ones."""
        self._packed_seen[group] = {id(storages[i]): weakref.ref(storages[i]) for i in packs}
        self.tensors_packed += len(packs)
