"""Payload exporters: the trainer-side half of a transport.

An exporter owns staging buffers (bounded, reused across buckets and updates) and turns the first
``size_bytes`` of one into a labelled ``weightwire.v1.Payload``. ``WeightPusher`` packs buckets into
buffers from ``allocate``, or exports a caller's already-flat buffer in place through ``wrap`` (no
packing copy), and asks ``export`` for the payload it puts into each worker's ``Bucket``.

Which exporters exist is the transport table's business (``weightwire.core.transports.table``): here live
``host_shm`` (POSIX shared memory under the ``ww-`` prefix; the client creates, writes, reuses and
finally unlinks segments; workers map them read-only) and ``inline`` (the bytes go inside the
message; bounded by the gRPC message limit); CUDA IPC lives in ``weightwire.client.transports.cuda_ipc``.
``make_exporter`` builds the exporter of a table row, and ``choose_transport`` picks one for
``transport="auto"`` from the workers' devices.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

# Re-exported: ``exporter`` is where the pusher, the other exporters and scripts find them.
from weightwire.client.transports.staging_buffer import StagingBuffer as StagingBuffer
from weightwire.client.transports.staging_buffer import consumers_wait as consumers_wait
from weightwire.client.transports.staging_buffer import consumers_wait_for_events as consumers_wait_for_events
from weightwire.client.transports.staging_buffer import crc32_of as crc32_of
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports import table as transports
from weightwire.core.transports.shm import SHM_DIR, new_shm_name
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    from weightwire.client.transports.route import Job
    from weightwire.core.manifest import ShardManifest


class Exporter(abc.ABC):
    """One transport on the trainer side.

    ``label`` is the device every payload of this exporter is labelled with, or None when the bytes
    are valid anywhere (inline), in which case the pusher labels each worker's payload with that
    worker's own device.
    """

    # The row of the transport table this exporter implements.
    TRANSPORT: transports.Transport
    label: DeviceRef | None = None
    # Largest bucket (bytes) this transport can carry; None = unbounded.
    max_bucket_bytes: int | None = None
    # Largest bucket ``push`` packs for this transport (a tensor larger goes alone, up to
    # ``max_bucket_bytes``); None = the pusher's bucket size.
    bucket_bytes_limit: int | None = None

    @property
    def name(self) -> str:
        return self.TRANSPORT.name

    @property
    def transport(self) -> pb.TransportKind.ValueType:
        return self.TRANSPORT.kind

    @classmethod
    def for_source(cls, source: torch.device) -> Exporter:
        """The exporter for tensors on ``source`` (host-memory transports ignore it)."""
        return cls()

    @classmethod
    def fits(cls, devices: Sequence[DeviceRef], source: torch.device) -> bool:
        """Whether ``transport="auto"`` should pick this transport for workers on ``devices`` and
        tensors on ``source`` (asked in the transport table's order)."""
        return False

    @abc.abstractmethod
    def allocate(self, capacity_bytes: int) -> StagingBuffer:
        """A new staging buffer of at least ``capacity_bytes`` (the pusher pools and reuses it)."""

    def wrap(self, flat: torch.Tensor) -> StagingBuffer | None:
        """Export an existing flat buffer in place, or None if this transport cannot (the pusher
        then copies it into a staging buffer)."""
        return None

    @abc.abstractmethod
    def export(self, buffer: StagingBuffer, size_bytes: int, label: DeviceRef) -> pb.Payload:
        """The payload for the storage's first ``size_bytes`` bytes, labelled ``label``."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release everything this exporter still holds."""

    # --- tensors exported where they live (no packing copy) -----------------------------------

    def scan_tensors(self, items: Sequence[tuple[str, torch.Tensor]]) -> TensorScan | None:
        """One pass over a push's named tensors: what planning and ``export_tensors`` need of each
        (``TensorScan``), or None when ``export_tensors`` cannot send them where they live
        (``can_export_tensors``; an exporter that can reads them all in one loop instead)."""
        tensors = [t for _, t in items]
        if not self.can_export_tensors(tensors):
            return None
        return TensorScan(
            tensors,
            tuple([(name, t.dtype, t.shape) for name, t in items]),
            [t.untyped_storage() for t in tensors],
            [t.storage_offset() for t in tensors],
        )

    def can_export_tensors(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``export_tensors`` can send these tensors where they live (CUDA IPC of a trainer's
        own parameters); the others pack them into staging buffers."""
        return False

    def export_tensors(
        self,
        tensors: Sequence[torch.Tensor],
        recipients: Sequence[str],
        places: tuple[Sequence[torch.UntypedStorage], Sequence[int | torch.SymInt]] | None = None,
    ) -> object | None:
        """``tensors`` exported where they live for each of ``recipients``, or None (pack them).
        ``places``: each tensor's storage and storage offset, when a ``TensorScan`` read them."""
        return None

    def tensors_payloads(self, exported: object, *, complete: bool) -> dict[str, pb.Payload]:
        """Each recipient's payload of what ``export_tensors`` returned."""
        raise NotImplementedError(f"{self.name} does not export tensors where they live")

    # --- one update ----------------------------------------------------------------------------

    # True for a transport whose bytes travel beside each worker's stream, on a channel of its own
    # that the worker reads while the trainer sends (a transfer group): its ``route_update`` makes
    # each worker's payloads, every update re-checks its workers (the channel names them), and no
    # update goes out as one PushUpdate call or on streams opened before it was routed.
    routes_each_update: ClassVar[bool] = False

    def route_update(
        self,
        jobs: Sequence[Job],
        manifests: Mapping[str, ShardManifest],
        statuses: Mapping[str, pb.GetStatusResponse] | None,
        sources: Mapping[str, torch.Tensor] | None,
        *,
        verify_checksums: bool,
    ) -> list[Job]:
        """The update's jobs as this transport sends them, once its workers were re-checked and
        before anything is sent (``statuses``: their GetStatus answers, when asked; ``sources``:
        the tensors ``push`` was given, by name). Most transports send each job as planned."""
        return list(jobs)

    def update_failed(self, failures: Mapping[str, WeightwireError]) -> bool:
        """An update over this exporter failed with ``failures``; True when the workers' manifests
        must be read again before the next one."""
        return False


# --------------------------------------------------------------------------------------------
# Host shared memory
# --------------------------------------------------------------------------------------------


class ShmSegment(StagingBuffer):
    """A POSIX shared-memory segment ``/dev/shm/<name>`` created by this process, mapped read-write."""

    def __init__(self, capacity_bytes: int, tag: str = "") -> None:
        self.capacity_bytes = max(int(capacity_bytes), 1)
        self.name = new_shm_name(tag)
        path = os.path.join(SHM_DIR, self.name)
        # O_EXCL: a name collision must never make two pushers share a segment.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.capacity_bytes)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, self.capacity_bytes)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        os.close(fd)
        self._tensor: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._closed = False

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError(f"shared-memory segment {self.name} is closed")
        return self._tensor

    def contains(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie inside this segment."""
        if self._tensor is None or t.device.type != "cpu":
            return False
        start = self._tensor.data_ptr()
        ptr = t.data_ptr()
        return start <= ptr and ptr + t.numel() * t.element_size() <= start + self.capacity_bytes

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))
        self._tensor = None
        mm, self._mmap = self._mmap, None
        if mm is not None:
            # Views a caller still holds keep the buffer exported; the mapping then goes with them.
            with contextlib.suppress(BufferError):
                mm.close()


class _ShmView(StagingBuffer):
    """A caller's flat tensor that lies inside one of our segments (exported with no copy)."""

    def __init__(self, segment: ShmSegment, flat: torch.Tensor, base_offset_bytes: int) -> None:
        self.segment = segment
        self.flat = flat
        self.base_offset_bytes = base_offset_bytes
        self.capacity_bytes = flat.numel()

    def tensor(self) -> torch.Tensor:
        return self.flat

    def crc32(self, size_bytes: int) -> int:
        return crc32_of(self.segment.tensor()[:size_bytes])


class HostShmExporter(Exporter):
    """Host shared memory on this machine, labelled with ``DeviceRef.host()`` (the boot id)."""

    TRANSPORT = transports.HOST_SHM

    @classmethod
    def fits(cls, devices: Sequence[DeviceRef], source: torch.device) -> bool:
        # Staging copies from any device, so the tensors' device does not matter here.
        own = DeviceRef.host()
        return bool(devices) and all(d == own for d in devices)

    def __init__(self) -> None:
        self.label = DeviceRef.host()
        self._segments: list[ShmSegment] = []
        self._lock = threading.Lock()

    def allocate(self, capacity_bytes: int) -> ShmSegment:
        seg = ShmSegment(capacity_bytes, tag=str(len(self._segments)))
        with self._lock:
            self._segments = [s for s in self._segments if not s._closed]
            self._segments.append(seg)
        return seg

    def wrap(self, flat: torch.Tensor) -> StagingBuffer | None:
        if flat.device.type != "cpu" or not flat.is_contiguous():
            return None
        if flat.dtype != torch.uint8:
            flat = flat.reshape(-1).view(torch.uint8)
        with self._lock:
            segments = list(self._segments)
        for seg in segments:
            if seg.contains(flat):
                base = flat.data_ptr() - seg.tensor().data_ptr()
                return _ShmView(seg, flat.reshape(-1), base)
        return None

    def export(self, buffer: StagingBuffer, size_bytes: int, label: DeviceRef) -> pb.Payload:
        seg = buffer.segment if isinstance(buffer, _ShmView) else buffer
        if not isinstance(seg, ShmSegment):
            raise TypeError(f"{self.name} cannot export a {type(buffer).__name__}")
        return pb.Payload(
            device=label.to_proto(), size_bytes=size_bytes, host_shm=pb.HostShmHandle(name=seg.name)
        )

    def close(self) -> None:
        with self._lock:
            segments, self._segments = self._segments, []
        for seg in segments:
            seg.close()


# --------------------------------------------------------------------------------------------
# Inline bytes
# --------------------------------------------------------------------------------------------

# The workers accept 64 MiB messages; an ordinary inline bucket stays well under gRPC's default
# 4 MiB so that it also passes proxies left at defaults. A tensor larger than that travels in a
# bucket of its own, up to INLINE_MAX_BYTES.
INLINE_BUCKET_BYTES = 4 * 1024 * 1024 - 64 * 1024
INLINE_MAX_BYTES = 60 * 1024 * 1024


class _HostBytes(StagingBuffer):
    """Ordinary CPU memory (inline transport: the bytes are copied into the message anyway)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.capacity_bytes = flat.numel()

    def tensor(self) -> torch.Tensor:
        return self.flat


class InlineExporter(Exporter):
    """The bytes themselves inside the Bucket message; valid on any device (label per worker)."""

    TRANSPORT = transports.INLINE
    label = None
    max_bucket_bytes = INLINE_MAX_BYTES
    bucket_bytes_limit = INLINE_BUCKET_BYTES

    @classmethod
    def fits(cls, devices: Sequence[DeviceRef], source: torch.device) -> bool:
        return True  # valid on any device: the fallback

    def allocate(self, capacity_bytes: int) -> StagingBuffer:
        return _HostBytes(torch.empty(max(int(capacity_bytes), 1), dtype=torch.uint8))

    def wrap(self, flat: torch.Tensor) -> StagingBuffer | None:
        if flat.device.type != "cpu" or not flat.is_contiguous():
            return None
        raw = flat.reshape(-1).view(torch.uint8)
        return _HostBytes(raw)

    def export(self, buffer: StagingBuffer, size_bytes: int, label: DeviceRef) -> pb.Payload:
        data = buffer.tensor()[:size_bytes].numpy().tobytes()
        return pb.Payload(device=label.to_proto(), size_bytes=size_bytes, inline_data=data)


# --------------------------------------------------------------------------------------------
# The table's exporters and the "auto" choice
# --------------------------------------------------------------------------------------------


def _exporter_class(row: transports.Transport) -> type[Exporter] | None:
    cls = row.load_exporter()
    if cls is not None and not (isinstance(cls, type) and issubclass(cls, Exporter)):
        raise TypeError(f"{row.exporter} (transport {row.name}) is not an Exporter")
    return cls


def available_transports() -> list[str]:
    """The transports this process can export (every table row whose exporter module imports)."""
    return [row.name for row in transports.TRANSPORTS if _exporter_class(row) is not None]


def choose_transport(devices: Sequence[DeviceRef], source: torch.device) -> str:
    """What ``transport="auto"`` means for workers on ``devices`` and tensors on ``source``: the
    first transport of the table whose exporter fits (CUDA IPC for tensors on a GPU sent to CUDA
    workers only; host shared memory when every worker is a host worker of this machine), else the
    table's last row (inline bytes), which fits everywhere."""
    for row in transports.TRANSPORTS:
        cls = _exporter_class(row)
        if cls is not None and cls.fits(devices, source):
            return row.name
    return transports.TRANSPORTS[-1].name


def make_exporter(name: str, source: torch.device) -> Exporter:
    row = transports.by_name(name)
    cls = _exporter_class(row) if row is not None else None
    if cls is None:
        raise WeightwireError(
            Reason.TRANSPORT_UNAVAILABLE,
            f"transport {name!r} is not available in this process; available: {', '.join(available_transports())}",
        )
    return cls.for_source(source)


@dataclasses.dataclass(frozen=True)
class TensorScan:
    """What one pass over a push's named tensors read of each, for every later step of the push
    of tensors exported where they live: the tensors, the rows the plan is keyed by (name, dtype,
    shape), and each tensor's storage and storage offset (the export's key and places). Every step
    used to walk the tensors again for its own part (the device and layout check, the plan's key,
    the export's key), which for a model of hundreds of parameters is a share of the push's fixed
    cost."""

    tensors: list[torch.Tensor]
    rows: tuple[tuple[str, torch.dtype, torch.Size], ...]
    storages: list[torch.UntypedStorage]
    offsets: list[int | torch.SymInt]
