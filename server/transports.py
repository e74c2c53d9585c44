"""Payload import: turn a ``Payload``'s ``oneof handle`` into readable tensor views.

The worker service calls ``make_importers()`` once (one importer per row of the transport table,
``weightwire.core.transports``, whose module imports here) and then, per bucket, the importer of the
payload's handle field: ``check`` (before any memory is touched), ``open`` and finally
``ImportedPayload.view`` for each owned tensor. Here: host shared memory (mapped read-only, never
unlinked: the sender owns the segment) and inline bytes; CUDA IPC lives in
``weightwire.server.cuda_import``.

Mappings of ordinary importers belong to one update: the service opens each distinct handle once per
update (``cache_key``) and closes them all when the update ends. An importer with ``reusable = True``
keeps its own cache across updates (CUDA IPC handles are costly to open and senders reuse them); the
service then never closes its mappings and counts them through ``held_mappings``.
"""

from __future__ import annotations

import abc
import dataclasses
import mmap
import os
import stat
import warnings
import zlib
from collections.abc import Hashable, Sequence
from typing import ClassVar, Protocol

import torch
from weightwire.core import transports
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.shm import check_shm_name
from weightwire.v1 import weight_transfer_pb2 as pb

# torch warns once per process that a read-only buffer gives a writable-typed tensor. The views are
# only ever read (copied into the model), so the warning carries no information here: trigger the
# one-time warning now, silently, instead of changing the process's warning filters.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)

_SHM_DIR = "/dev/shm"


class ImportedPayload(Protocol):
    """An opened payload. ``size_bytes`` is the real size of the underlying storage."""

    size_bytes: int

    def view(self, offset_bytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A tensor over bytes [offset, offset + nbytes) of the storage; read it, never write it."""
        ...

    def crc32(self, size_bytes: int) -> int:
        """zlib CRC-32 of the first ``size_bytes`` bytes (only for verify_checksums)."""
        ...

    def close(self) -> None:
        ...


@dataclasses.dataclass(frozen=True)
class ImportContext:
    """What an importer may need to know about where the bytes must end up.

    ``source`` is the payload's label, ``own_device`` the worker's device, ``peer`` True when the
    header allowed a peer-GPU import and this payload is one, ``target`` the torch device the engine
    loads into (a CUDA importer opens handles on it).
    """

    own_device: DeviceRef
    source: DeviceRef
    peer: bool
    target: torch.device


class PayloadImporter(abc.ABC):
    """One transport's importer. Subclasses set ``TRANSPORT``, their row of the transport table."""

    TRANSPORT: ClassVar[transports.Transport | None] = None
    # True: the importer caches mappings across updates itself; the service never closes them.
    reusable: bool = False

    @property
    def field_name(self) -> str:
        """The ``Payload.handle`` field this importer reads."""
        row = self.TRANSPORT
        return row.handle_field if row is not None else ""

    @property
    def transport(self) -> pb.TransportKind.ValueType:
        """The ``TransportKind`` its acks report."""
        row = self.TRANSPORT
        return row.kind if row is not None else pb.TRANSPORT_KIND_UNSPECIFIED

    def check(self, payload: pb.Payload) -> None:  # noqa: B027 - optional hook
        """Validate handle fields before any memory is touched; raise WeightwireError."""

    def cache_key(self, payload: pb.Payload) -> Hashable | None:
        """Payloads with equal keys in one update share one mapping; None: never share."""
        return None

    @abc.abstractmethod
    def open(self, payload: pb.Payload, ctx: ImportContext) -> tuple[ImportedPayload, bool]:
        """Open the payload; returns the mapping and whether a new handle was opened (False: cached).

        Raise WeightwireError(HANDLE_OPEN_FAILED, ...) when the handle cannot be opened.
        """

    def held_mappings(self) -> int:
        """Mappings a reusable importer keeps open between updates."""
        return 0

    def release(self) -> None:  # noqa: B027 - optional hook
        """Drop every cached mapping (worker shutdown, or the sender said it is done with them)."""


def make_importers() -> dict[str, PayloadImporter]:
    """Fresh importer instances (one per worker service), keyed by handle field name: one per row
    of the transport table whose importer module can be imported in this process."""
    out: dict[str, PayloadImporter] = {}
    for entry in transports.TRANSPORTS:
        cls = entry.load_importer()
        if cls is None:
            continue
        if not (isinstance(cls, type) and issubclass(cls, PayloadImporter)) or cls.TRANSPORT != entry:
            raise TypeError(f"{entry.importer} is not the PayloadImporter of transport {entry.name}")
        out[entry.handle_field] = cls()
    return out


def transport_name(field_name: str) -> str:
    """A payload handle field for people (``"host shared memory"``)."""
    return transports.field_description(field_name)


# ---------------------------------------------------------------------------------------------
# Shared buffer views (host memory)
# ---------------------------------------------------------------------------------------------


def _view_buffer(buf: object, size_bytes: int, offset_bytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if offset_bytes + numel * dtype.itemsize > size_bytes:
        # The service validated bounds already; this guards the raw pointer arithmetic below.
        raise WeightwireError(Reason.TENSOR_OUT_OF_BOUNDS, f"view [{offset_bytes}, +{numel * dtype.itemsize}) beyond {size_bytes} bytes")
    if offset_bytes % dtype.itemsize:
        # A misaligned element type cannot alias the bytes safely; one host copy keeps it correct.
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=numel * dtype.itemsize, offset=offset_bytes).clone()  # type: ignore[arg-type]
        return raw.view(dtype).view(tuple(shape))
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset_bytes).view(tuple(shape))  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class ViewItem:
    """Where one tensor lies in a payload, with its contiguous strides worked out once.

    Built by the worker service when a bucket's layout is first validated and reused for every
    later bucket of that layout (``strided_views``)."""

    offset_bytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int

    @classmethod
    def of(cls, offset_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> ViewItem:
        stride: list[int] = []
        step = 1
        for d in reversed(shape):
            stride.append(step)
            step *= max(d, 1)
        numel = 1
        for d in shape:
            numel *= d
        return cls(offset_bytes, dtype, shape, tuple(reversed(stride)), numel)


def strided_views(mapping: ImportedPayload, items: Sequence[ViewItem]) -> list[torch.Tensor]:
    """``mapping.view(...)`` of every item, the same tensors, built faster.

    A mapping with ``byte_tensor()`` (the built-in ones) gives one uint8 tensor over its storage;
    each aligned, non-empty item is then one ``as_strided`` of a typed view of it instead of a
    buffer wrap, a slice and two reshapes. Anything else (empty, misaligned, a mapping without
    ``byte_tensor``) goes through ``mapping.view``, which applies its own bounds guard.
    """
    byte_tensor = getattr(mapping, "byte_tensor", None)
    if byte_tensor is None:
        return [mapping.view(i.offset_bytes, i.dtype, i.shape) for i in items]
    base: torch.Tensor = byte_tensor()
    size = base.numel()
    typed: dict[torch.dtype, torch.Tensor | None] = {}
    out: list[torch.Tensor] = []
    for item in items:
        itemsize = item.dtype.itemsize
        if item.dtype in typed:
            t = typed[item.dtype]
        else:
            usable = size - size % itemsize
            t = base[:usable].view(item.dtype) if base.storage_offset() % itemsize == 0 and usable > 0 else None
            typed[item.dtype] = t
        if (
            t is None
            or item.numel == 0
            or item.offset_bytes % itemsize
            or item.offset_bytes + item.numel * itemsize > size
        ):
            out.append(mapping.view(item.offset_bytes, item.dtype, item.shape))
        else:
            out.append(t.as_strided(item.shape, item.stride, t.storage_offset() + item.offset_bytes // itemsize))
    return out


class _HostShmMapping:
    def __init__(self, name: str, mm: mmap.mmap, size_bytes: int) -> None:
        self.name = name
        self._mm: mmap.mmap | None = mm
        self.size_bytes = size_bytes

    def view(self, offset_bytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        if self._mm is None:
            raise WeightwireError(Reason.HANDLE_OPEN_FAILED, f"shared memory {self.name!r} was already closed")
        return _view_buffer(self._mm, self.size_bytes, offset_bytes, dtype, shape)

    def byte_tensor(self) -> torch.Tensor:
        """The whole segment as uint8 (read only); see ``strided_views``."""
        if self._mm is None:
            raise WeightwireError(Reason.HANDLE_OPEN_FAILED, f"shared memory {self.name!r} was already closed")
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=self.size_bytes)  # type: ignore[call-overload]

    def crc32(self, size_bytes: int) -> int:
        if self._mm is None:
            raise WeightwireError(Reason.HANDLE_OPEN_FAILED, f"shared memory {self.name!r} was already closed")
        with memoryview(self._mm) as mv:
            return zlib.crc32(mv[:size_bytes])

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


class HostShmImporter(PayloadImporter):
    """POSIX shared memory created by the sender; mapped O_RDONLY + PROT_READ, never unlinked."""

    TRANSPORT = transports.HOST_SHM

    def check(self, payload: pb.Payload) -> None:
        check_shm_name(payload.host_shm.name)

    def cache_key(self, payload: pb.Payload) -> Hashable | None:
        return (self.field_name, check_shm_name(payload.host_shm.name))

    def open(self, payload: pb.Payload, ctx: ImportContext) -> tuple[ImportedPayload, bool]:
        bare = check_shm_name(payload.host_shm.name)
        path = os.path.join(_SHM_DIR, bare)
        try:
            # O_NONBLOCK: a FIFO under a valid name must not block the worker in open().
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
                    Reason.HANDLE_OPEN_FAILED, f"shared memory {bare!r} is not a regular file (a segment is one)", name=bare
                )
            size = info.st_size
            if size == 0:
                raise WeightwireError(Reason.INVALID_SIZE, f"shared memory {bare!r} is empty", name=bare)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as e:
            raise WeightwireError(Reason.HANDLE_OPEN_FAILED, f"cannot map shared memory {bare!r}: {e}", name=bare) from None
        finally:
            os.close(fd)
        return _HostShmMapping(bare, mm, size), True


class _InlineMapping:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self.size_bytes = len(data)

    def view(self, offset_bytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        return _view_buffer(self._data, self.size_bytes, offset_bytes, dtype, shape)

    def byte_tensor(self) -> torch.Tensor:
        """The carried bytes as uint8 (read only); see ``strided_views``."""
        if not self.size_bytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._data, dtype=torch.uint8, count=self.size_bytes)  # type: ignore[call-overload]

    def crc32(self, size_bytes: int) -> int:
        return zlib.crc32(memoryview(self._data)[:size_bytes])

    def close(self) -> None:
        self._data = b""


class InlineImporter(PayloadImporter):
    """Bytes carried in the message itself (small updates, fallback). Length must equal size_bytes."""

    TRANSPORT = transports.INLINE

    def check(self, payload: pb.Payload) -> None:
        if len(payload.inline_data) != payload.size_bytes:
            raise WeightwireError(
                Reason.INVALID_SIZE,
                f"inline payload carries {len(payload.inline_data)} bytes but size_bytes says {payload.size_bytes}",
            )

    def open(self, payload: pb.Payload, ctx: ImportContext) -> tuple[ImportedPayload, bool]:
        return _InlineMapping(payload.inline_data), True

