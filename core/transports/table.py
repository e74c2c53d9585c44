"""The transport table: every way a bucket's bytes can travel, and the one place each is named.

A row says what the transport is called (``transport="host_shm"``, ``PushResult.transport``), its
``TransportKind`` on the wire (acks, manifests), the ``Payload.handle`` field that carries it, the
device kind its payloads live on, which workers can import it, a name for messages, and where its
two halves are: the trainer's ``Exporter`` (``weightwire.client``) and the worker's
``PayloadImporter`` (``weightwire.server``), as ``"module:Class"``. The client, the server and the
manifests look transports up here; nothing else spells one.

Adding a transport is one row here (and the ``oneof handle`` field in the proto) plus its exporter and
importer classes. The order of ``TRANSPORTS`` is the order ``transport="auto"`` asks the exporters
whether they fit (``Exporter.fits``); the last row fits everywhere.
"""

from __future__ import annotations

import dataclasses

from weightwire.core.devices import DeviceRef
from weightwire.core.optional import load_optional
from weightwire.v1 import weight_transfer_pb2 as pb

_CUDA = pb.DEVICE_KIND_CUDA
_HOST = pb.DEVICE_KIND_HOST


@dataclasses.dataclass(frozen=True)
class Transport:
    """One transport. ``label_kind`` is the kind of device its payloads must be labelled with
    (None: the bytes are valid anywhere, each worker's copy is labelled with its own device);
    ``worker_kinds`` the kinds of worker devices that can import it; ``exports_local_buffers`` marks
    the transport that exports a caller's own buffer on a ``label_kind`` device in place
    (``push_gathered``'s local buffers, ``export_payload``); ``carries_deltas`` the transports a
    delta update's encoded bytes may travel over (docs/deltas.md, "Transports"): bytes a worker
    reads into its own memory before anything is written, never a peer's memory it copies from."""

    name: str
    kind: pb.TransportKind.ValueType
    handle_field: str
    human_name: str
    label_kind: pb.DeviceKind.ValueType | None
    worker_kinds: tuple[pb.DeviceKind.ValueType, ...]
    exporter: str
    importer: str
    exports_local_buffers: bool = False
    carries_deltas: bool = False

    @property
    def per_source_device(self) -> bool:
        """Whether a trainer process needs one exporter per source device (device memory) rather
        than one in all (host memory, or bytes in the message)."""
        return self.label_kind is not None and self.label_kind != _HOST

    def load_exporter(self) -> object | None:
        """The trainer-side exporter class, or None when its module cannot be imported here."""
        return load_optional(self.exporter)

    def load_importer(self) -> object | None:
        """The worker-side importer class, or None when its module cannot be imported here."""
        return load_optional(self.importer)


CUDA_IPC = Transport(
    name="cuda_ipc",
    kind=pb.TRANSPORT_KIND_CUDA_IPC,
    handle_field="cuda_ipc",
    human_name="CUDA IPC",
    label_kind=_CUDA,
    worker_kinds=(_CUDA,),
    exporter="weightwire.client.transports.cuda_ipc:CudaIpcExporter",
    importer="weightwire.server.transports.cuda_ipc:CudaIpcImporter",
    exports_local_buffers=True,
)
HOST_SHM = Transport(
    name="host_shm",
    kind=pb.TRANSPORT_KIND_HOST_SHM,
    handle_field="host_shm",
    human_name="host shared memory",
    label_kind=_HOST,
    worker_kinds=(_HOST, _CUDA),
    exporter="weightwire.client.transports.exporter:HostShmExporter",
    importer="weightwire.server.transports.shm:HostShmImporter",
    exports_local_buffers=True,
    carries_deltas=True,
)
INLINE = Transport(
    name="inline",
    kind=pb.TRANSPORT_KIND_INLINE,
    handle_field="inline_data",
    human_name="inline bytes",
    label_kind=None,
    worker_kinds=(_HOST, _CUDA),
    exporter="weightwire.client.transports.exporter:InlineExporter",
    importer="weightwire.server.transports.inline:InlineImporter",
    carries_deltas=True,
)

TRANSFER_GROUP = Transport(
    name="transfer_group",
    kind=pb.TRANSPORT_KIND_TRANSFER_GROUP,
    handle_field="transfer_group",
    human_name="a transfer group (torch.distributed)",
    # The bytes land in the receiving worker's own staging buffer: each worker's payload is
    # labelled with its own device. Never picked by transport="auto" (it needs a group formed).
    label_kind=None,
    worker_kinds=(_HOST, _CUDA),
    exporter="weightwire.client.transports.transfer_group:GroupExporter",
    importer="weightwire.server.transports.transfer_group:GroupImporter",
    # One source's buckets (point-to-point, broadcast): the ranges sent are the encodings' bytes,
    # received into the worker's staging buffer. Slices handles take their regions whole.
    carries_deltas=True,
)

TRANSPORTS: tuple[Transport, ...] = (CUDA_IPC, HOST_SHM, TRANSFER_GROUP, INLINE)

_BY_NAME = {t.name: t for t in TRANSPORTS}
_BY_KIND = {t.kind: t for t in TRANSPORTS}
_BY_FIELD = {t.handle_field: t for t in TRANSPORTS}


def names() -> list[str]:
    return [t.name for t in TRANSPORTS]


def by_name(name: str) -> Transport | None:
    return _BY_NAME.get(name)


def by_kind(kind: pb.TransportKind.ValueType) -> Transport | None:
    return _BY_KIND.get(kind)


def by_field(handle_field: str) -> Transport | None:
    return _BY_FIELD.get(handle_field)


def kind_name(kind: pb.TransportKind.ValueType) -> str:
    """The name of a wire ``TransportKind`` (``"host_shm"``), also for a kind this table does not know
    (a newer worker's): its enum name without the prefix, lower case."""
    row = by_kind(kind)
    if row is not None:
        return row.name
    try:
        return pb.TransportKind.Name(kind).removeprefix("TRANSPORT_KIND_").lower()
    except ValueError:
        return f"transport {kind}"


def field_description(handle_field: str) -> str:
    """A payload handle field for people: ``"host shared memory"`` (the field name if unknown)."""
    row = by_field(handle_field)
    return row.human_name if row is not None else handle_field


def for_worker(device: DeviceRef) -> tuple[pb.TransportKind.ValueType, ...]:
    """What a worker on ``device`` can import (its manifest's ``transports``), in table order."""
    return tuple(t.kind for t in TRANSPORTS if device.kind in t.worker_kinds)


def for_local_buffer(device_type: str) -> Transport:
    """The transport that exports a caller's buffer on a torch device of ``device_type`` in place."""
    kind = _CUDA if device_type == "cuda" else _HOST
    for t in TRANSPORTS:
        if t.exports_local_buffers and t.label_kind == kind:
            return t
    raise LookupError(f"no transport exports buffers on {device_type} in place")


HOST_WORKER_TRANSPORTS: tuple[pb.TransportKind.ValueType, ...] = tuple(
    t.kind for t in TRANSPORTS if _HOST in t.worker_kinds
)


__all__ = [
    "CUDA_IPC",
    "HOST_SHM",
    "HOST_WORKER_TRANSPORTS",
    "INLINE",
    "TRANSFER_GROUP",
    "TRANSPORTS",
    "Transport",
    "by_field",
    "by_kind",
    "by_name",
    "field_description",
    "for_local_buffer",
    "for_worker",
    "kind_name",
    "names",
]
