"""The trainer's CUDA IPC exporter: GPU staging buffers and in-place export of GPU buffers.

The transport table (``weightwire.core.transports.table.CUDA_IPC``) names ``CudaIpcExporter``;
``WeightPusher`` gets one for its source GPU (``transport="cuda_ipc"``, or ``"auto"`` when the
tensors are on a GPU and every receiving worker is a CUDA worker). Each staging buffer is a flat
uint8 allocation on that GPU, allocated once, exported once (``share_cuda_tensor``) and reused for
every bucket and update, so workers open each handle once. ``wrap`` exports a caller's flat GPU
buffer (say an all-gather output) in place, with no packing copy. Every payload is labelled with
the GPU's UUID, never an index.

Before a handle goes out, ``ready`` makes the packing copies visible: when every recipient waits
for a payload's event before reading (``exporters.consumers_wait_for_events``), it records the
buffer's interprocess event (``core.cuda_ipc.ProducerEvent``, one per exported buffer) and the
payload carries it, so packing the next bucket overlaps the workers' copies of this one; otherwise
it waits for the copies on the host, as a worker that does not wait reads a kept mapping at once.

``export_tensors`` exports a caller's ordinary CUDA tensors (a model's parameters, each its own
allocation) where they live, with no packing copy: each distinct storage is shared once per
receiving worker (torch's reference counter counts one release per share, so each worker gets its
own) and kept, by a weak reference, for as long as the trainer keeps it; a payload names them all
(``CudaIpcHandle.storages``), each tensor at its storage's place plus its own offset. The payload of
the same tensors in the same storages is built once and sent again every update; a storage that
dies (a parameter freed or replaced) is forgotten, and the next payload is built anew and says it is
complete when it lists everything the workers should keep, so they close the rest. Tensors in new
storages every push (gathers, conversions) are packed instead into the exporter's fresh-tensor
pool (``cuda_ipc_pool``; ``cuda_ipc_tensors`` decides), buffers of the same payload that every worker opened once; which
storages go which way is decided per push, from what was shared and packed before.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from collections.abc import Sequence

import torch
from weightwire.client.transports.cuda_ipc_tensors import ExportedTensors, PooledExports, StorageShare
from weightwire.client.transports.exporter import (
    Exporter,
    StagingBuffer,
    TensorScan,
    consumers_wait,
    crc32_of,
)
from weightwire.core.devices import DeviceRef, cuda_device_uuid
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports import table as transports
from weightwire.core.transports.cuda_ipc import (
    CudaIpcFields,
    ProducerEvent,
    SharedCudaBuffer,
    ipc_collect,
    share_cuda_tensor,
)
from weightwire.core.transports.cuda_ipc_storages import MAX_STORAGES_PER_PAYLOAD
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["CudaIpcExporter", "CudaStagingBuffer", "ExportedTensors", "cuda_auto_rule", "resolve_cuda_device"]

# Staging allocations are rounded up to this, so every tensor offset the packer aligns stays
# inside and the caching allocator gets sizes it can reuse.
_ALLOC_GRANULE = 2 * 1024 * 1024
# In-place exports remembered (by storage, weakly) so re-wrapping a persistent buffer reuses its handle.
_WRAP_CACHE_SIZE = 16
# Interprocess events one exporter creates at most (one per exported buffer). They are kept until
# the exporter closes: a worker names an event by its share and may still hold it open. Buffers
# exported beyond this (a trainer wrapping a new storage every step) make ``ready`` wait on the
# host instead.
_MAX_EVENTS = 64
# Storages one exporter keeps shared for ``export_tensors`` (live ones only: a dead storage is
# forgotten); beyond this the tensors are packed instead.
_MAX_STORAGE_SHARES = 4 * MAX_STORAGES_PER_PAYLOAD
# Payloads of exported tensors kept for reuse (one per recipient group of an update, usually one).
_MAX_EXPORTED = 8


def resolve_cuda_device(source: torch.device | str | int | None) -> torch.device:
    """The CUDA device an exporter stages on: ``source`` when it is a GPU, else the current GPU."""
    if not torch.cuda.is_available():
        raise WeightwireError(
            Reason.TRANSPORT_UNAVAILABLE,
            "transport cuda_ipc needs a CUDA GPU in the trainer process; use host_shm or inline",
        )
    dev = torch.device("cuda", source) if isinstance(source, int) else torch.device(source or "cuda")
    if dev.type != "cuda":
        dev = torch.device("cuda")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _whole(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """``storage`` as one flat uint8 tensor from its first byte (offsets on the wire count from there)."""
    whole = torch.empty((0,), dtype=torch.uint8, device=device)
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    return whole


class CudaStagingBuffer(StagingBuffer):
    """A flat uint8 region of a CUDA storage, exported once and reused.

    ``owner`` is the storage's tensor as the caller gave it (kept alive while this buffer is);
    ``flat`` the usable bytes, starting ``base_offset_bytes`` into the storage.
    """

    def __init__(
        self, flat: torch.Tensor, shared: SharedCudaBuffer, *, owned: bool, event: ProducerEvent | None = None
    ) -> None:
        self._flat: torch.Tensor | None = flat
        self._shared: SharedCudaBuffer | None = shared
        self._event = event
        # What the next payload of this buffer carries; ``ready`` sets it.
        self.fields: CudaIpcFields = shared.fields
        self.capacity_bytes = int(flat.numel())
        self.base_offset_bytes = shared.base_offset_bytes
        self.device = flat.device
        self.label = shared.device
        self.owned = owned

    @property
    def shared(self) -> SharedCudaBuffer:
        if self._shared is None:
            raise RuntimeError("CUDA staging buffer is closed")
        return self._shared

    def tensor(self) -> torch.Tensor:
        if self._flat is None:
            raise RuntimeError("CUDA staging buffer is closed")
        return self._flat

    def ready(self) -> None:
        # Packing copies ran on the current stream of this GPU.
        stream = torch.cuda.current_stream(self.device)
        if self._event is not None and consumers_wait():
            self.fields = self.shared.fields.with_event(self._event.record(stream))
            return
        self.fields = self.shared.fields
        event = torch.cuda.Event()
        event.record(stream)
        event.synchronize()

    def crc32(self, size_bytes: int) -> int:
        # Offsets on the wire count from the storage's first byte, so checksum the storage.
        storage = self.shared.owner.untyped_storage()
        whole = _whole(storage, self.device)
        return crc32_of(whole[:size_bytes])

    def close(self) -> None:
        self._flat = None
        self._shared = None


@dataclasses.dataclass(frozen=True)
class _WrapShare:
    """A caller's buffer shared once: the handle fields, a weak reference to its storage so a
    freed buffer whose address comes back is shared anew rather than confused with the old one,
    and the event paired with this share (None: beyond the exporter's event bound)."""

    storage: weakref.ref[torch.UntypedStorage]
    fields: CudaIpcFields
    device: DeviceRef
    device_index: int
    event: ProducerEvent | None


class CudaIpcExporter(PooledExports, Exporter):
    """CUDA IPC from one GPU of the trainer; payloads are labelled with that GPU's UUID."""

    TRANSPORT = transports.CUDA_IPC

    @classmethod
    def for_source(cls, source: torch.device) -> CudaIpcExporter:
        return cls(source)

    @classmethod
    def fits(cls, devices: Sequence[DeviceRef], source: torch.device) -> bool:
        return cuda_auto_rule(devices, source)

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self.device = resolve_cuda_device(device)
        self.label = DeviceRef.cuda(cuda_device_uuid(self.device.index or 0))
        # Reentrant: a shared storage's weak-reference callback takes it, and a storage can die on
        # this thread while it is held.
        self._lock = threading.RLock()
        self._buffers: list[CudaStagingBuffer] = []
        self._wrapped: collections.OrderedDict[tuple[int, int], _WrapShare] = collections.OrderedDict()
        self._events: list[ProducerEvent] = []
        # export_tensors: shared storages by id (a storage's Python object lives exactly as long as
        # the storage), a generation bumped whenever one dies, the payloads built, and the event
        # every such payload carries.
        self._shares: dict[int, StorageShare] = {}
        self._generation = 0
        self._exported: collections.OrderedDict[tuple[object, ...], ExportedTensors] = (
            collections.OrderedDict()
        )
        self._tensor_event: ProducerEvent | None = None
        self.storages_shared = 0
        # The fresh-tensor pool (``cuda_ipc_tensors.PooledExports``).
        self._init_pool()

    def _new_event(self) -> ProducerEvent | None:
        """The event for a newly exported buffer, or None beyond ``_MAX_EVENTS`` (caller holds no lock)."""
        with self._lock:
            if len(self._events) >= _MAX_EVENTS:
                return None
            event = ProducerEvent(self.device.index or 0)
            self._events.append(event)
            return event

    def allocate(self, capacity_bytes: int) -> CudaStagingBuffer:
        """A new GPU staging buffer, exported once (the pusher pools and reuses it)."""
        size = max(int(capacity_bytes), 1)
        rounded = -(-size // _ALLOC_GRANULE) * _ALLOC_GRANULE
        flat = torch.empty(rounded, dtype=torch.uint8, device=self.device)
        shared = share_cuda_tensor(flat)
        buf = CudaStagingBuffer(flat, shared, owned=True, event=self._new_event())
        with self._lock:
            self._buffers = [b for b in self._buffers if b._flat is not None]
            self._buffers.append(buf)
        return buf

    def wrap(self, flat: torch.Tensor) -> CudaStagingBuffer | None:
        """Export a caller's contiguous buffer on this GPU in place, or None (then it is packed)."""
        if flat.device.type != "cuda" or flat.device.index != self.device.index or not flat.is_contiguous():
            return None
        raw = flat.reshape(-1).view(torch.uint8)
        if raw.numel() == 0:
            return None
        storage = raw.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        whole = _whole(storage, self.device)
        with self._lock:
            known = self._wrapped.get(key)
            if known is not None and known.storage() is storage:
                self._wrapped.move_to_end(key)
            else:
                known = None
        if known is None:
            # Share the whole storage once; every later view into it reuses the same handle (and a
            # worker its cached mapping). Only a weak reference is kept: the caller owns the buffer.
            shared = share_cuda_tensor(whole)
            known = _WrapShare(
                weakref.ref(storage), shared.fields, shared.device, shared.device_index, self._new_event()
            )
            with self._lock:
                self._wrapped[key] = known
                while len(self._wrapped) > _WRAP_CACHE_SIZE:
                    self._wrapped.popitem(last=False)
        base = int(raw.storage_offset())
        view = SharedCudaBuffer(
            fields=known.fields,
            device=known.device,
            device_index=known.device_index,
            base_offset_bytes=base,
            size_bytes=base + int(raw.numel()),
            owner=whole,
        )
        return CudaStagingBuffer(raw, view, owned=False, event=known.event)

    def scan_tensors(self, items: Sequence[tuple[str, torch.Tensor]]) -> TensorScan | None:
        """One pass over ``items``: None unless each is a dense tensor on this GPU (at most a
        payload's storages), else what planning and ``export_tensors`` need of each."""
        if not items or len(items) > MAX_STORAGES_PER_PAYLOAD:
            return None
        index = self.device.index
        tensors: list[torch.Tensor] = []
        rows: list[tuple[str, torch.dtype, torch.Size]] = []
        storages: list[torch.UntypedStorage] = []
        offsets: list[int | torch.SymInt] = []
        # Bound once: this loop runs every push over every tensor.
        add_tensor, add_row, add_storage, add_offset = (
            tensors.append,
            rows.append,
            storages.append,
            offsets.append,
        )
        for name, t in items:
            if t.get_device() != index or not t.is_contiguous():
                return None
            add_tensor(t)
            add_row((name, t.dtype, t.shape))
            add_storage(t.untyped_storage())
            add_offset(t.storage_offset())
        return TensorScan(tensors, tuple(rows), storages, offsets)

    def can_export_tensors(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``export_tensors`` can send these tensors where they live: dense tensors on this
        GPU, at most a payload's storages."""
        if not tensors or len(tensors) > MAX_STORAGES_PER_PAYLOAD:
            return False
        # Whole-list checks (this runs every push): get_device is -1 for a CPU tensor.
        return {t.get_device() for t in tensors} == {self.device.index} and all(
            map(torch.Tensor.is_contiguous, tensors)
        )

    def export_tensors(
        self,
        tensors: Sequence[torch.Tensor],
        recipients: Sequence[str],
        places: tuple[Sequence[torch.UntypedStorage], Sequence[int | torch.SymInt]] | None = None,
    ) -> ExportedTensors | None:
        """``tensors`` as views into their own storages (no copy) for each of ``recipients``, or None
        when one cannot be shared (the caller packs them instead). The same tensors in the same
        storages for the same recipients give the same object. ``places``: each tensor's storage
        and storage offset, as ``scan_tensors`` read them (else read here)."""
        if places is None:
            storages: Sequence[torch.UntypedStorage] = [t.untyped_storage() for t in tensors]
            storage_offsets: Sequence[int | torch.SymInt] = [t.storage_offset() for t in tensors]
        else:
            storages, storage_offsets = places
        key = (
            self._generation,
            tuple(map(id, storages)),
            tuple(storage_offsets),
            tuple(recipients),
        )
        with self._lock:
            known = self._exported.get(key)
            if known is not None:
                self._exported.move_to_end(key)
                return known
        group = tuple(recipients)
        fresh = self._fresh_storages(storages, group)
        if fresh:
            pooled = self._export_pooled(tensors, storages, group, fresh)
            if pooled is not None:
                return pooled
        exported = self._export_shared(tensors, storages, recipients, key)
        if exported is not None:
            with self._lock:
                self._exported_to.add(group)
                # Nothing of this group is packed any more: its pool buffers go (a worker that still
                # maps them lets them go at this payload, which lists everything it should keep).
                self._pooled.pop(group, None)
                self._packed_seen.pop(group, None)
        return exported

    def _add_shares(
        self, messages: dict[str, list[pb.CudaIpcStorage]], storage: torch.UntypedStorage, at: int
    ) -> bool:
        """Each recipient's share of ``storage`` at payload offset ``at``; False when torch refuses."""
        for recipient, out in messages.items():
            share = self._share_storage(storage, recipient)
            if share is None:
                return False
            msg = pb.CudaIpcStorage()
            msg.CopyFrom(share)
            msg.payload_offset_bytes = at
            out.append(msg)
        return True

    def _export_shared(
        self,
        tensors: Sequence[torch.Tensor],
        storages: Sequence[torch.UntypedStorage],
        recipients: Sequence[str],
        key: tuple[object, ...],
    ) -> ExportedTensors | None:
        """Every storage shared where it lives (each once per recipient, then kept)."""
        messages: dict[str, list[pb.CudaIpcStorage]] = {r: [] for r in recipients}
        placed = self._place_storages(messages, storages)
        if placed is None:
            return None
        places, end = placed
        if not recipients or not messages[recipients[0]]:
            return None  # only empty tensors: nothing to export
        offsets = tuple(
            places[id(s)] + int(t.storage_offset()) * t.element_size() if t.numel() else 0
            for s, t in zip(storages, tensors, strict=True)
        )
        exported = ExportedTensors(offsets, end, messages)
        with self._lock:
            # A storage that died while this was built bumped the generation: its key is stale.
            key = (self._generation, *key[1:])
            self._exported[key] = exported
            while len(self._exported) > _MAX_EXPORTED:
                self._exported.popitem(last=False)
        return exported

    def _share_storage(self, storage: torch.UntypedStorage, recipient: str) -> pb.CudaIpcStorage | None:
        """``recipient``'s share of ``storage`` (made once), or None when torch refuses to share it."""
        sid = id(storage)
        with self._lock:
            known = self._shares.get(sid)
            if known is not None and known.ref() is not storage:
                known = None
            if known is not None and recipient in known.messages:
                return known.messages[recipient]
            if known is None and len(self._shares) >= _MAX_STORAGE_SHARES:
                return None
        try:
            whole = _whole(storage, self.device)
            fields = share_cuda_tensor(whole).fields
        except (RuntimeError, ValueError):
            # torch refuses to share this allocation (say, an allocator without IPC support).
            return None
        message = pb.CudaIpcStorage(
            memory_handle=fields.memory_handle,
            storage_offset_bytes=fields.storage_offset_bytes,
            storage_size_bytes=fields.storage_size_bytes,
            ref_counter_handle=fields.ref_counter_handle,
            ref_counter_offset=fields.ref_counter_offset,
        )
        with self._lock:
            known = self._shares.get(sid)
            if known is None or known.ref() is not storage:
                exporter = weakref.ref(self)

                def forget(_: object, sid: int = sid) -> None:
                    owner = exporter()
                    if owner is not None:
                        with owner._lock:
                            owner._shares.pop(sid, None)
                            owner._generation += 1
                            owner._exported.clear()

                known = StorageShare(weakref.ref(storage, forget), {})
                self._shares[sid] = known
            known.messages[recipient] = message
            self.storages_shared += 1
        return message

    def tensors_payloads(self, exported: ExportedTensors, *, complete: bool) -> dict[str, pb.Payload]:
        """Each recipient's payload of ``exported``, once the writes queued so far on this GPU's
        current stream (the trainer's step) are visible: an event the workers wait for when they all
        do (``consumers_wait``), else a wait here."""
        stream = torch.cuda.current_stream(self.device)
        event: bytes | None = None
        if consumers_wait():
            if self._tensor_event is None:
                self._tensor_event = ProducerEvent(self.device.index or 0)
            event = self._tensor_event.record(stream)
        else:
            stream.synchronize()
        return {r: exported.payload(r, self.label, event, complete) for r in exported.storages}

    def export(self, buffer: StagingBuffer, size_bytes: int, label: DeviceRef) -> pb.Payload:
        if not isinstance(buffer, CudaStagingBuffer):
            raise TypeError(f"{self.name} cannot export a {type(buffer).__name__}")
        shared = buffer.shared
        if label != shared.device:
            raise WeightwireError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"a CUDA buffer on {shared.device} cannot be labelled {label}: a label names the GPU that "
                "holds the bytes",
            )
        if size_bytes > shared.fields.storage_size_bytes:
            raise ValueError(
                f"payload of {size_bytes} bytes exceeds the CUDA storage of {shared.fields.storage_size_bytes}"
            )
        return pb.Payload(device=label.to_proto(), size_bytes=size_bytes, cuda_ipc=buffer.fields.to_proto())

    def close(self) -> None:
        """Drop every staging buffer and in-place share. Blocks still mapped by a worker stay in
        torch's limbo until that worker releases them; ``ipc_collect`` frees the rest."""
        with self._lock:
            buffers, self._buffers = self._buffers, []
            self._wrapped.clear()
            self._events.clear()
            self._exported.clear()
            self._shares.clear()
            self._tensor_event = None
            pooled = self._drop_pool()
        del pooled
        for buf in buffers:
            buf.close()
        del buffers
        ipc_collect()


def cuda_auto_rule(devices: Sequence[DeviceRef], source: torch.device) -> bool:
    """``transport="auto"`` picks CUDA IPC for tensors on a GPU sent to CUDA workers only."""
    return source.type == "cuda" and bool(devices) and all(d.is_cuda for d in devices)
