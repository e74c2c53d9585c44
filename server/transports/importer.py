"""Payload import: the interface a transport's importer implements, and one importer per transport.

The worker service calls ``make_importers()`` once (one importer per row of the transport table,
``weightwire.core.transports.table``, whose module imports here) and then, per bucket, the importer of the
payload's handle field: ``check`` (before any memory is touched), ``open`` and then
``ImportedPayload.fetch`` for each batch of owned tensors (``weightwire.server.rules.views``). The
importers: host shared memory in ``weightwire.server.transports.shm``, inline bytes in
``weightwire.server.transports.inline``, CUDA IPC in ``weightwire.server.transports.cuda_ipc``,
transfer groups in ``weightwire.server.transports.transfer_group``.

How a bucket loads is the importer's to say, never the worker's to guess from a handle's name: an
importer that loads some buckets itself, straight into the tensors the engine keeps, is
``FillsModel`` and says per payload whether it does (``fills_model``); every other bucket is opened
and viewed by its layout. What trainers must know of an importer (whether it waits for producer
events, reads several storages, receives slices) it writes into the worker's manifest itself
(``announce``); an importer that receives through the worker's transfer group is ``JoinsGroups``.

Mappings of ordinary importers belong to one update: the service opens each distinct handle once per
update (``cache_key``) and closes them all when the update ends. An importer with ``reusable = True``
keeps its own cache across updates (CUDA IPC handles are costly to open and senders reuse them); the
service then never closes its mappings and counts them through ``held_mappings``.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import torch
from weightwire.core.delta import Delta
from weightwire.core.devices import DeviceRef
from weightwire.core.transports import table as transports
from weightwire.server.rules.views import ReadBatch
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    from weightwire.core.manifest import ShardManifest
    from weightwire.server.rules.validation import CheckedSpec
    from weightwire.server.transports.transfer_group_membership import GroupMembership


@runtime_checkable
class ReceivesBytes(Protocol):
    """An opened payload whose bytes reached this worker over the network (a transfer group): how
    many, for the update's ``bytes_received``."""

    bytes_received: int


@runtime_checkable
class KeptByName(Protocol):
    """An opened payload this worker keeps under a name the trainer chose (a CUDA IPC storage set's
    ``storage_set_id``; empty: none), for the bucket's ack (``BucketAck.storage_set_kept``)."""

    kept_as: bytes


class ImportedPayload(Protocol):
    """An opened payload. ``size_bytes`` is the real size of the underlying storage.

    ``copy_chunk_bytes`` None: the bytes are in this process's memory and ``fetch`` returns them
    in place (a batch's positions are the tensors' offsets); a number: ``fetch`` copies the batch's
    segments into a staging buffer of at most that size per batch (``views.copy_plan``).
    """

    size_bytes: int
    copy_chunk_bytes: int | None

    def fetch(self, batch: ReadBatch) -> torch.Tensor:
        """The bytes of ``batch`` as a uint8 tensor, valid until the next fetch; read them only."""
        ...

    def crc32(self, size_bytes: int) -> int:
        """zlib CRC-32 of the first ``size_bytes`` bytes (only for verify_checksums)."""
        ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class ImportContext:
    """What an importer may need to know about where the bytes must end up.

    ``source`` is the payload's label, ``own_device`` the worker's device, ``peer`` True when the
    header allowed a peer-GPU import and this payload is one, ``target`` the torch device the engine
    loads into (a CUDA importer opens handles on it). ``owned``: the checked specs of the tensors
    this worker will read from the payload (an importer that receives only some byte ranges refuses
    one outside them before it waits for anything). ``call_ended``: set once the call carrying the
    update is over (cancelled, past its deadline); an importer that waits for bytes stops waiting then.
    """

    own_device: DeviceRef
    source: DeviceRef
    peer: bool
    target: torch.device
    owned: Sequence[CheckedSpec] = ()
    call_ended: threading.Event | None = None


class FillPlan(Protocol):
    """What a ``FillsModel`` importer checked of a payload before anything waits or is written."""

    @property
    def names(self) -> frozenset[str]:
        """The owned tensors the payload's bytes fill."""
        ...


@dataclasses.dataclass(frozen=True)
class RegionChange:
    """One checked delta of a region of a filled bucket, handed to the worker instead of applied
    (``FillTarget.changes``): the tensor, the region's box in the full checkpoint tensor, the
    trainer's result checksums of the region, and the changes of the region's elements in
    row-major order (its views valid until the update ends)."""

    tensor: str
    box: tuple[tuple[int, int], ...]
    result_checksums: Sequence[pb.DeltaChecksum]
    delta: Delta


@dataclasses.dataclass(frozen=True)
class FillTarget:
    """Where a filled bucket's bytes go: ``kept``, the adapter's kept tensors by name, of this
    ``manifest``. ``will_write`` is called once before the first byte may land; once ``call_ended``
    is set (the update's call is over) every wait of the receive stops. Bytes an importer can hold
    back until the update commits (a staged receive) are landed by what it appends to
    ``landings``, which the update runs at its commit. ``ordinal``: the bucket's place among the
    update's filled buckets (0 for its first). ``changes``: for an adapter that applies deltas
    itself, a delta bucket's checked region deltas are appended there, and none is applied into
    ``kept`` (nothing of the bucket is then written by the importer)."""

    kept: Mapping[str, torch.Tensor]
    manifest: ShardManifest
    will_write: Callable[[], None]
    call_ended: threading.Event | None = None
    landings: list[Callable[[], None]] | None = None
    ordinal: int = 0
    changes: list[RegionChange] | None = None


@runtime_checkable
class FillsModel(Protocol):
    """An importer that loads some buckets itself: their bytes go straight into the tensors the
    engine keeps (``KeepsTensors``), so the bucket carries no tensor specs and nothing is opened or
    viewed (a transfer group whose every trainer rank is a source). The update asks ``fills_model``
    of each payload's importer; for a bucket one says yes to, ``plan_fill`` checks the worker's
    payload against the manifest and ``fill`` receives it."""

    @property
    def field_name(self) -> str: ...

    @property
    def transport(self) -> pb.TransportKind.ValueType: ...

    def fills_model(self, payload: pb.Payload) -> bool:
        """Whether this importer loads the bucket of ``payload`` itself."""
        ...

    def plan_fill(self, payload: pb.Payload, manifest: ShardManifest) -> FillPlan:
        """Check the payload against the manifest (raise WeightwireError); nothing waits yet."""
        ...

    def stage(self, name: str, kept: torch.Tensor) -> torch.Tensor:
        """A tensor of ``kept``'s shape and dtype where bytes bound for ``name`` are held before
        they reach it: where they arrive. Its contents are undefined; the receive writes them all."""
        ...

    def fill(self, payload: pb.Payload, plan: FillPlan, into: FillTarget) -> int:
        """Receive the planned bytes into ``into.kept``; returns the bytes received."""
        ...


@runtime_checkable
class JoinsGroups(Protocol):
    """An importer that receives through the worker's transfer-group membership, which the service
    then owns for JoinTransferGroup / LeaveTransferGroup and the status."""

    membership: GroupMembership


class PayloadImporter(abc.ABC):
    """One transport's importer. Subclasses set ``TRANSPORT``, their row of the transport table."""

    TRANSPORT: ClassVar[transports.Transport | None] = None
    # True: the importer caches mappings across updates itself; the service never closes them.
    reusable: bool = False
    # True: its payloads carry the bytes in the message (too large to serialize again as a key of
    # the layout cache).
    bytes_in_message: ClassVar[bool] = False

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

    def announce(self, manifest: pb.ShardManifest, *, keeps_tensors: bool) -> None:  # noqa: B027 - optional hook
        """Write what trainers must know of how this importer reads payloads into the worker's
        manifest; ``keeps_tensors``: the engine adapter exposes the tensors it keeps."""

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
