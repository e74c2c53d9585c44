"""CUDA IPC export and import of device buffers, without pickle and without gRPC.

Both sides of the CUDA transport use this module: the client (``weightwire.client.transports.cuda_ipc``)
exports a CUDA tensor or a flat staging buffer as the fields of ``weightwire.v1.CudaIpcHandle``
plus the GPU UUID it lives on; the worker (``weightwire.server.transports.cuda_ipc``) maps that UUID to its
own local device index, reopens the storage and views tensors in it.

torch's own CUDA sharing (``torch.multiprocessing.reductions``) pickles a rebuild function; here
the same primitives are called directly: ``UntypedStorage._share_cuda_()`` on the producer and
``UntypedStorage._new_shared_cuda(...)`` on the consumer, and only plain values cross the wire.

Reference counting follows torch: each ``_share_cuda_()`` registers one consumer reference in a
small shared-memory counter file owned by the producer; the consumer decrements it when its
storage is released. The producer keeps a freed shared block in a limbo until the count is zero
(``torch.cuda.ipc_collect()`` frees those). A consumer that gets a second share of a storage it has
already opened releases the new count at once (``CudaIpcCache``), as torch does.

Readiness: the producer records an interprocess CUDA event after writing a buffer
(``ProducerEvent``) and sends its handle (``event_handle``, ``event_sync_required``); the consumer
waits for it before every read, also from a mapping it already holds (``OpenedStorage.wait_ready``),
so the producer's host does not wait for its own writes before it sends the handle.

Everything on the wire is checked before it reaches torch (``CudaIpcFields.from_proto``, in
``weightwire.core.transports.cuda_ipc_fields`` and named here too).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from weightwire.core.devices import DeviceRef, cuda_device_uuid
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports.cuda_ipc_fields import (
    MAX_EVENT_HANDLE_BYTES,
    MAX_MEMORY_HANDLE_BYTES,
    REF_COUNTER_SLOTS,
    CudaIpcFields,
    check_event_fields,
    check_ref_counter,
)
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_CACHE_CAPACITY",
    "MAX_EVENTS_PER_MAPPING",
    "MAX_EVENT_HANDLE_BYTES",
    "MAX_MEMORY_HANDLE_BYTES",
    "REF_COUNTER_SLOTS",
    "CudaIpcCache",
    "CudaIpcFields",
    "OpenedStorage",
    "ProducerEvent",
    "ReadyEvent",
    "SharedCudaBuffer",
    "check_event_fields",
    "check_ref_counter",
    "ipc_collect",
    "open_cuda_storage",
    "open_producer_event",
    "release_ref_counter",
    "share_cuda_tensor",
    "synchronize_producer",
]

# A sender that reuses its staging buffers needs a handful of entries per worker (pipeline depth x
# trainers feeding it). Entries of a sender that went away keep its device memory mapped until they
# are evicted, so the bound stays small.
DEFAULT_CACHE_CAPACITY = 8
# Producer events a mapping keeps open: one per share of its storage that carried one (a sender
# shares each staging buffer once), so a few; the oldest is closed beyond this.
MAX_EVENTS_PER_MAPPING = 8


# ---------------------------------------------------------------------------------------------
# Producer side
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SharedCudaBuffer:
    """A CUDA buffer exported for IPC: the handle fields, its GPU, and where the tensor starts.

    ``base_offset_bytes`` is where the exported tensor's first byte sits inside the shared storage
    (the consumer sees the whole storage), so a TensorSpec's ``offset_bytes`` is
    ``base_offset_bytes + offset inside the tensor``. ``size_bytes`` is what a Payload may address.
    ``owner`` holds the producer's tensor: the buffer must stay alive until every consumer acked.
    """

    fields: CudaIpcFields
    device: DeviceRef
    device_index: int
    base_offset_bytes: int
    size_bytes: int
    owner: torch.Tensor

    def payload(self) -> pb.Payload:
        """The labelled ``Payload`` for this buffer (the UUID label, never an index)."""
        return pb.Payload(
            device=self.device.to_proto(), size_bytes=self.size_bytes, cuda_ipc=self.fields.to_proto()
        )


def share_cuda_tensor(tensor: torch.Tensor) -> SharedCudaBuffer:
    """Export the storage under a CUDA tensor for IPC, labelled with its GPU UUID.

    Call once per buffer and reuse the result for every bucket and update that writes into that
    buffer: each call registers a fresh consumer reference, and a consumer that already mapped the
    storage keeps using its mapping. Before a consumer reads, the producer must have finished
    writing: send ``fields.with_event(ProducerEvent.record())`` to a consumer that waits for it
    (this package's, from the version whose manifests say so), or ``synchronize_producer`` first.
    The event torch records here covers only the writes before this call.
    """
    if tensor.device.type != "cuda":
        raise ValueError(f"share_cuda_tensor needs a CUDA tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("share_cuda_tensor needs a contiguous tensor (a dense flat buffer)")
    storage = tensor.untyped_storage()
    (
        device_index,
        memory_handle,
        storage_size_bytes,
        storage_offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    if memory_handle is None:
        raise ValueError("cannot export an empty CUDA storage (no allocation behind it)")
    fields = CudaIpcFields(
        memory_handle=bytes(memory_handle),
        storage_offset_bytes=int(storage_offset_bytes),
        storage_size_bytes=int(storage_size_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle) if event_handle is not None else b"",
        event_sync_required=bool(event_sync_required),
    )
    base = int(tensor.storage_offset()) * tensor.element_size()
    return SharedCudaBuffer(
        fields=fields,
        device=DeviceRef.cuda(cuda_device_uuid(int(device_index))),
        device_index=int(device_index),
        base_offset_bytes=base,
        size_bytes=base + int(tensor.numel()) * tensor.element_size(),
        owner=tensor,
    )


class ProducerEvent:
    """An interprocess CUDA event a producer records after each write into one exported buffer.

    ``record()`` marks the end of the writes queued so far on the stream (the current one by
    default) and returns the event's IPC handle for ``CudaIpcFields.with_event``; a consumer waits
    for that point before it reads. Pair one event with one share for the share's lifetime and keep
    it until the buffer is no longer exported (consumers identify the event by that share).
    Re-recording is safe once the consumer acked the previous contents: a consumer that waits
    later waits for the later record, which completes after the earlier one.
    """

    def __init__(self, device_index: int) -> None:
        import torch

        self.device_index = device_index
        # blocking=False: a consumer's host wait spins instead of sleeping (lower latency).
        self._event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
        self._handle: bytes | None = None

    def record(self, stream: torch.cuda.Stream | None = None) -> bytes:
        import torch

        self._event.record(stream or torch.cuda.current_stream(self.device_index))
        if self._handle is None:
            self._handle = bytes(self._event.ipc_handle())
        return self._handle


def synchronize_producer(device_index: int, stream: torch.cuda.Stream | None = None) -> None:
    """Wait until writes into an exported buffer finished, so a consumer may read it.

    For consumers that do not wait for a ``ProducerEvent`` (older ones read a mapping they keep
    without waiting for anything), the producer synchronises the stream that wrote the buffer (the
    current one by default) before it sends the handle.
    """
    import torch

    (stream or torch.cuda.current_stream(device_index)).synchronize()


# ---------------------------------------------------------------------------------------------
# Consumer side
# ---------------------------------------------------------------------------------------------


def open_cuda_storage(fields: CudaIpcFields, device_index: int) -> torch.Tensor:
    """Reopen an exported storage on local device ``device_index`` as a flat uint8 tensor.

    The tensor's length is the real storage size. Nothing here waits for the producer's event
    (``open_producer_event`` opens it; ``CudaIpcCache.open`` does both). Raises ``WeightwireError(HANDLE_OPEN_FAILED)``
    when CUDA refuses the handle (wrong GPU, producer gone, same process as the producer).
    """
    import torch

    fields.validate()
    try:
        torch.cuda._lazy_init()
        with torch.cuda.device(device_index):
            storage = torch.UntypedStorage._new_shared_cuda(
                device_index,
                fields.memory_handle,
                fields.storage_size_bytes,
                fields.storage_offset_bytes,
                fields.ref_counter_handle,
                fields.ref_counter_offset,
                # The producer event is the caller's to wait for (``CudaIpcCache.open`` opens it and
                # ``OpenedStorage.wait_ready`` waits on the host), not torch's: it would queue a
                # wait on this thread's stream only, and only for this first open.
                b"",
                False,
            )
            flat = torch.empty((0,), dtype=torch.uint8, device=torch.device("cuda", device_index))
            flat.set_(storage, 0, (storage.nbytes(),), (1,))
    except RuntimeError as exc:  # torch.AcceleratorError is a RuntimeError
        raise WeightwireError(
            Reason.HANDLE_OPEN_FAILED,
            f"could not open the CUDA IPC handle on local device {device_index}: {exc}. The producer must "
            "be another live process on this host and must keep the buffer alive until acked.",
            device_index=str(device_index),
        ) from exc
    return flat


def open_producer_event(fields: CudaIpcFields, device_index: int) -> torch.cuda.Event:
    """Open the producer event ``fields`` names (``event_key`` is not None) on ``device_index``.

    Raises ``WeightwireError(HANDLE_OPEN_FAILED)`` when CUDA refuses the handle.
    """
    import torch

    try:
        return torch.cuda.Event.from_ipc_handle(torch.device("cuda", device_index), fields.event_handle)
    except RuntimeError as exc:
        raise WeightwireError(
            Reason.HANDLE_OPEN_FAILED,
            f"could not open the CUDA IPC event_handle on local device {device_index}: {exc}. The producer "
            "must record it with weightwire.core.transports.cuda_ipc.ProducerEvent and keep it while the buffer is exported.",
            device_index=str(device_index),
        ) from exc


def release_ref_counter(fields: CudaIpcFields) -> None:
    """Give back the consumer reference a share registered, for a share we do not open anew."""
    import torch

    check_ref_counter(fields.ref_counter_handle, fields.ref_counter_offset)
    # Best effort in torch as well: a counter file of a producer that already exited is ignored.
    torch.UntypedStorage._release_ipc_counter_cuda(fields.ref_counter_handle, fields.ref_counter_offset)


def ipc_collect() -> None:
    """Free producer blocks whose consumers all released them, and flush released mappings."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


Opener = Callable[[CudaIpcFields, int], "torch.Tensor"]
CounterRelease = Callable[[CudaIpcFields], None]


class ReadyEvent(Protocol):
    """What a consumer does with an opened producer event (``torch.cuda.Event``)."""

    def synchronize(self) -> None: ...


EventOpener = Callable[[CudaIpcFields, int], ReadyEvent]


@dataclasses.dataclass
class _Entry:
    flat: torch.Tensor
    device_index: int
    counters: set[tuple[bytes, int]]
    open_duration_ns: int
    events: collections.OrderedDict[tuple[bytes, bytes, int], ReadyEvent] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    view_memo: dict[int, object] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class OpenedStorage:
    """One use of a (possibly cached) mapping: the flat bytes, whether this use opened it, and the
    producer event to wait for before reading (None: the share carried none to wait for)."""

    flat: torch.Tensor
    device_index: int
    opened: bool
    open_duration_ns: int
    ready_event: ReadyEvent | None = None
    # Tensor views over ``flat`` a consumer built and may use again while this mapping lives (its
    # bytes stay where they are); dropped with the mapping. See ``server.views.batch_views``.
    view_memo: dict[int, object] | None = None

    @property
    def size_bytes(self) -> int:
        return int(self.flat.numel())

    def wait_ready(self) -> None:
        """Block until the producer's writes before its event completed (no-op without an event).

        A host wait rather than a wait of one stream: the engine may copy on a stream of its own,
        on another thread, and a host wait orders every one of them after the producer's writes."""
        if self.ready_event is not None:
            self.ready_event.synchronize()


class CudaIpcCache:
    """Opened CUDA IPC storages of this process, keyed by the exported storage, bounded LRU.

    Reusing the same staging buffers across buckets and updates opens each handle once. Eviction
    and ``release_all`` drop this cache's references and run ``torch.cuda.ipc_collect()``; a view
    still held elsewhere keeps its mapping until it is dropped too (torch closes the mapping when
    the last reference goes). ``opens`` counts every handle opened since the process started.
    """

    def __init__(
        self,
        capacity: int = DEFAULT_CACHE_CAPACITY,
        *,
        opener: Opener = open_cuda_storage,
        release_counter: CounterRelease = release_ref_counter,
        collect: Callable[[], None] = ipc_collect,
        event_opener: EventOpener = open_producer_event,
    ) -> None:
        if capacity < 1:
            raise ValueError("cache capacity must be at least 1")
        self._capacity = capacity
        self._opener = opener
        self._event_opener = event_opener
        self._release_counter = release_counter
        self._collect = collect
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[tuple[bytes, int, int, bytes, int], _Entry] = (
            collections.OrderedDict()
        )
        self.opens = 0
        self.evictions = 0
        self.event_opens = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def open_mappings(self) -> int:
        """Mappings this cache holds open now."""
        return len(self)

    def open(self, fields: CudaIpcFields, device_index: int) -> OpenedStorage:
        """The mapping of ``fields`` on ``device_index``, opened now or taken from the cache, with
        the producer event of this share (opened once per share, then kept with the mapping)."""
        key = (*fields.cache_key, device_index)
        evicted: list[_Entry] = []
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                if fields.ref_counter not in entry.counters:
                    # The producer shared the same storage again: that share expects one release,
                    # and the mapping we hold already accounts for our reference.
                    entry.counters.add(fields.ref_counter)
                    self._release_counter(fields)
                event = self._event_of(entry, fields, device_index)
                return OpenedStorage(
                    entry.flat,
                    device_index,
                    opened=False,
                    open_duration_ns=0,
                    ready_event=event,
                    view_memo=entry.view_memo,
                )
            start = time.perf_counter_ns()
            flat = self._opener(fields, device_index)
            took = time.perf_counter_ns() - start
            self.opens += 1
            entry = _Entry(flat, device_index, {fields.ref_counter}, took)
            memo = entry.view_memo
            self._entries[key] = entry
            while len(self._entries) > self._capacity:
                # No local name for the evicted entry: it must be gone before ``_collect`` runs.
                evicted.append(self._entries.popitem(last=False)[1])
                self.evictions += 1
            error: BaseException | None = None
            try:
                event = self._event_of(entry, fields, device_index)
            except BaseException as e:
                # The share's event cannot be opened: do not keep a mapping nobody may read.
                evicted.append(self._entries.pop(key))
                error = e
        if evicted:
            del evicted, entry
            self._collect()
        if error is not None:
            del flat
            raise error
        return OpenedStorage(
            flat, device_index, opened=True, open_duration_ns=took, ready_event=event, view_memo=memo
        )

    def _event_of(self, entry: _Entry, fields: CudaIpcFields, device_index: int) -> ReadyEvent | None:
        key = fields.event_key
        if key is None:
            return None
        event = entry.events.get(key)
        if event is not None:
            entry.events.move_to_end(key)
            return event
        event = self._event_opener(fields, device_index)
        self.event_opens += 1
        entry.events[key] = event
        while len(entry.events) > MAX_EVENTS_PER_MAPPING:
            entry.events.popitem(last=False)
        return event

    def release_all(self) -> int:
        """Drop every cached mapping; returns how many were held."""
        with self._lock:
            count = len(self._entries)
            self._entries.clear()
        self._collect()
        return count
