"""Payloads of several CUDA storages: a trainer's own parameters exported where they live (no
packing copy), checked as a set, and the worker's bounded cache of the sets it keeps open.

``weightwire.core.transports.cuda_ipc`` has the primitives (one storage's handle fields, opening
it, producer events, the cache of single storages); this module builds on them for
``CudaIpcHandle.storages``. No gRPC.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports.cuda_ipc import (
    EventOpener,
    Opener,
    ReadyEvent,
    ipc_collect,
    open_cuda_storage,
    open_producer_event,
)
from weightwire.core.transports.cuda_ipc_fields import CudaIpcFields, check_event_fields
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------------------------
# Payloads of several storages (a trainer's own parameters, exported where they live)
# ---------------------------------------------------------------------------------------------

# Storages one payload may name (CudaIpcHandle.storages). A model's parameters are a few hundred to
# a few thousand allocations; a trainer with more sends several buckets.
MAX_STORAGES_PER_PAYLOAD = 8192
# Storage mappings a worker keeps open for such payloads, over all of them: one model's worth (a
# trainer's parameters) with room for a second while a trainer replaces its parameters.
DEFAULT_STORAGE_CAPACITY = 2 * MAX_STORAGES_PER_PAYLOAD
# Distinct payloads of several storages a worker keeps with their views (one per recipient group of
# a trainer's update, usually one); beyond this the oldest goes and its storages with it.
MAX_KEPT_STORAGE_SETS = 4
# CudaIpcHandle.storage_set_id: a trainer's random name for a handle it sends again every update.
MAX_STORAGE_SET_ID_BYTES = 64
# Names one kept set answers to (a trainer that rebuilds the same payload names it anew); beyond
# this the oldest name goes.
MAX_NAMES_PER_SET = 8


def has_storages(msg: pb.CudaIpcHandle) -> bool:
    """Whether a CUDA IPC handle is a payload of several storages (``CudaIpcHandle.storages``)."""
    return len(msg.storages) > 0


def names_storage_set(msg: pb.CudaIpcHandle) -> bool:
    """Whether a CUDA IPC handle is a payload of several storages, sent whole or named by its
    ``storage_set_id`` alone (a set the worker keeps)."""
    return len(msg.storages) > 0 or len(msg.storage_set_id) > 0


def storage_set_unknown(set_id: bytes, why: str) -> WeightwireError:
    return WeightwireError(
        Reason.STORAGE_SET_UNKNOWN,
        f"this worker keeps no CUDA IPC storage set under storage_set_id {set_id.hex()[:32]} ({why}); "
        "nothing of the bucket was loaded: send the payload with its storages",
    )


def _check_set_id(set_id: bytes) -> None:
    if len(set_id) > MAX_STORAGE_SET_ID_BYTES:
        raise WeightwireError(
            Reason.MALFORMED_STREAM,
            f"CUDA IPC storage_set_id is {len(set_id)} bytes; at most {MAX_STORAGE_SET_ID_BYTES}",
        )


def _check_reference(msg: pb.CudaIpcHandle) -> None:
    """A handle naming a kept set by ``storage_set_id`` carries nothing else (the kept handle's
    storages, event and completeness are what it means)."""
    _check_set_id(msg.storage_set_id)
    if (
        msg.memory_handle
        or msg.ref_counter_handle
        or msg.storage_offset_bytes
        or msg.storage_size_bytes
        or msg.ref_counter_offset
        or msg.event_handle
        or msg.event_sync_required
        or msg.storages_complete
    ):
        raise WeightwireError(
            Reason.HANDLE_MISSING,
            "a CUDA IPC payload that names a storage set by storage_set_id without its storages must leave "
            "every other handle field unset (the kept set's storages, event and completeness apply)",
        )


@dataclasses.dataclass(frozen=True)
class CudaIpcStorageSet:
    """A payload's bytes as several exported storages (``CudaIpcHandle.storages``), checked.

    ``storages[i]`` holds the payload's bytes [``offsets[i]``, ``offsets[i]`` + its size); offsets
    ascend and storages do not overlap, so a tensor's storage is found by bisection. ``event``
    (``event_key`` not None) is the producer event that covers every storage; ``complete`` says the
    sender lists here every storage it wants this worker to keep open.
    """

    storages: tuple[CudaIpcFields, ...]
    offsets: tuple[int, ...]
    event_handle: bytes
    event_sync_required: bool
    complete: bool

    @property
    def size_bytes(self) -> int:
        return self.offsets[-1] + self.storages[-1].storage_size_bytes

    @property
    def event_fields(self) -> CudaIpcFields | None:
        """The event as the fields ``open_producer_event`` takes (None: nothing to wait for). It is
        named with the first storage's share, which no other payload of any producer carries."""
        if not self.event_sync_required:
            return None
        return dataclasses.replace(self.storages[0], event_handle=self.event_handle, event_sync_required=True)

    def storage_at(self, offset_bytes: int, nbytes: int) -> tuple[int, int]:
        """(index of the storage holding payload bytes [offset, offset + nbytes), offset inside it);
        ``WeightwireError(TENSOR_OUT_OF_BOUNDS)`` when they are not all inside one storage."""

        i = bisect.bisect_right(self.offsets, offset_bytes) - 1
        if i < 0 or offset_bytes + nbytes > self.offsets[i] + self.storages[i].storage_size_bytes:
            raise WeightwireError(
                Reason.TENSOR_OUT_OF_BOUNDS,
                f"payload bytes [{offset_bytes}, +{nbytes}) do not lie inside one of the payload's exported "
                "storages (a tensor must lie inside one storage)",
            )
        return i, offset_bytes - self.offsets[i]

    @classmethod
    def from_proto(cls, msg: pb.CudaIpcHandle) -> CudaIpcStorageSet:
        """Parse and check a handle with storages; raises ``WeightwireError`` on anything unsafe."""
        count = len(msg.storages)
        if count > MAX_STORAGES_PER_PAYLOAD:
            raise WeightwireError(
                Reason.INVALID_SIZE,
                f"CUDA IPC payload names {count} storages; at most {MAX_STORAGES_PER_PAYLOAD} per payload "
                "(send several buckets)",
            )
        _check_set_id(msg.storage_set_id)
        if msg.memory_handle or msg.ref_counter_handle:
            raise WeightwireError(
                Reason.HANDLE_MISSING,
                "a CUDA IPC payload with storages must leave memory_handle and ref_counter_handle unset "
                "(each storage carries its own)",
            )
        storages: list[CudaIpcFields] = []
        offsets: list[int] = []
        end = 0
        for i, s in enumerate(msg.storages):
            fields = CudaIpcFields.from_proto(s)
            at = int(s.payload_offset_bytes)
            if at < end:
                raise WeightwireError(
                    Reason.INVALID_OFFSET,
                    f"CUDA IPC storage {i} starts at payload byte {at}, before the end of the storage before it "
                    f"({end}): storages must ascend and not overlap",
                )
            storages.append(fields)
            offsets.append(at)
            end = at + fields.storage_size_bytes
        out = cls(
            tuple(storages),
            tuple(offsets),
            bytes(msg.event_handle),
            bool(msg.event_sync_required),
            bool(msg.storages_complete),
        )
        check_event_fields(out.event_handle, out.event_sync_required)
        return out


@dataclasses.dataclass
class OpenedStorageSet:
    """A storage set this process keeps: its storages' mappings (opened when a tensor first needs
    one), its producer event once opened, and the views consumers built over it."""

    key: tuple[bytes, int]
    storages: CudaIpcStorageSet
    device_index: int
    flats: list[torch.Tensor | None]
    event: ReadyEvent | None = None
    view_memo: dict[int, object] = dataclasses.field(default_factory=dict)
    # The trainer's names for this set (CudaIpcHandle.storage_set_id), oldest first: a later
    # payload may be one of them alone.
    names: list[bytes] = dataclasses.field(default_factory=list)


class StorageSetCache:
    """Payloads of several storages this process reads, and the storage mappings they hold.

    A trainer sends the same payload message every update while its parameters stay where they are,
    so a set is found by the payload's serialized handle (the checks and the parse run once), and
    each storage is opened once, when a tensor first needs it, and kept while some kept set names it.
    Bounds: at most ``MAX_KEPT_SETS`` sets (the oldest goes first) and ``capacity`` open storages (a
    new one beyond it drops the oldest other sets). A set that says it is ``complete`` drops every
    other set and every storage it does not name: what the trainer no longer lists (a parameter it
    freed or replaced, the storages of a trainer process that restarted) is never read again, and
    its counter is released so the trainer can free that memory.

    A storage's key is every field of its share, the counter slot included, which the producer
    never gives another share: a freed and re-allocated parameter comes as a new storage, never as a
    mapping opened for the old one.

    A set sent with a ``storage_set_id`` is kept under that name too, while the set is kept: a
    later payload naming it alone (``CudaIpcHandle.storage_set_id`` without storages) is that
    handle, found without receiving, parsing or serializing its storages again (399 shares, ~45 KB,
    for an 8B model). A name of no kept set is STORAGE_SET_UNKNOWN. The name is no part of the
    set's key: the same storages sent under a new name (a trainer that built the same payload
    again) are the same kept set, with its views, answering to both names.
    """

    MAX_KEPT_SETS = MAX_KEPT_STORAGE_SETS
    _MAX_PARSED = 8

    def __init__(
        self,
        capacity: int = DEFAULT_STORAGE_CAPACITY,
        *,
        opener: Opener = open_cuda_storage,
        collect: Callable[[], None] = ipc_collect,
        event_opener: EventOpener = open_producer_event,
    ) -> None:
        if capacity < MAX_STORAGES_PER_PAYLOAD:
            raise ValueError(
                f"storage capacity must hold one payload's storages ({MAX_STORAGES_PER_PAYLOAD})"
            )
        self._capacity = capacity
        self._opener = opener
        self._collect = collect
        self._event_opener = event_opener
        self._lock = threading.Lock()
        self._parsed: collections.OrderedDict[bytes, CudaIpcStorageSet] = collections.OrderedDict()
        self._last: tuple[pb.CudaIpcHandle, bytes, CudaIpcStorageSet] | None = None
        self._sets: collections.OrderedDict[tuple[bytes, int], OpenedStorageSet] = collections.OrderedDict()
        # storage_set_id -> the handle kept under it (its serialized form and parse); an entry goes
        # when no kept set is that handle any more.
        self._ids: dict[bytes, tuple[bytes, CudaIpcStorageSet]] = {}
        # One mapping per storage share and device, with the sets holding it.
        self._flats: dict[
            tuple[tuple[bytes, int, int, bytes, int], int], tuple[torch.Tensor, set[tuple[bytes, int]]]
        ] = {}
        self.opens = 0
        self.event_opens = 0
        self.dropped_storages = 0

    @property
    def open_storages(self) -> int:
        with self._lock:
            return len(self._flats)

    @property
    def kept_sets(self) -> int:
        with self._lock:
            return len(self._sets)

    def parse(self, msg: pb.CudaIpcHandle) -> tuple[bytes, CudaIpcStorageSet]:
        """The checked set of ``msg`` and its key (the serialized handle), parsed once per message;
        for a handle naming a kept set by ``storage_set_id`` alone, that set's (STORAGE_SET_UNKNOWN
        when no kept set has the name)."""
        if not msg.storages and msg.storage_set_id:
            _check_reference(msg)
            with self._lock:
                known_id = self._ids.get(msg.storage_set_id)
            if known_id is None:
                raise storage_set_unknown(
                    msg.storage_set_id, "it restarted, or dropped the set for newer ones"
                )
            return known_id
        with self._lock:
            last = self._last
            if last is not None and last[0] is msg:
                # The same message again (checked, then opened, in one bucket): no second serialization.
                return last[1], last[2]
        if msg.storage_set_id:
            # The key is the handle without its name (sent whole only when a worker lacks the name);
            # the name is checked here, as a known key skips the parse below.
            _check_set_id(msg.storage_set_id)
            bare = pb.CudaIpcHandle()
            bare.CopyFrom(msg)
            bare.ClearField("storage_set_id")
            raw = bare.SerializeToString(deterministic=True)
        else:
            raw = msg.SerializeToString(deterministic=True)
        with self._lock:
            known = self._parsed.get(raw)
            if known is not None:
                self._parsed.move_to_end(raw)
                self._last = (msg, raw, known)
                return raw, known
        parsed = CudaIpcStorageSet.from_proto(msg)
        with self._lock:
            self._last = (msg, raw, parsed)
            self._parsed[raw] = parsed
            while len(self._parsed) > self._MAX_PARSED:
                self._parsed.popitem(last=False)
        return raw, parsed

    def open(self, msg: pb.CudaIpcHandle, device_index: int) -> tuple[OpenedStorageSet, bool]:
        """The kept set of ``msg`` on ``device_index`` (and whether it is new), its event opened."""
        raw, parsed = self.parse(msg)
        key = (raw, device_index)
        referred = not msg.storages
        dropped: list[object] = []
        with self._lock:
            entry = self._sets.get(key)
            new = entry is None
            if entry is None and referred:
                # Kept on another device only (a peer import of the same handle): name its storages.
                raise storage_set_unknown(msg.storage_set_id, f"it keeps none on device {device_index}")
            if entry is None:
                entry = OpenedStorageSet(key, parsed, device_index, [None] * len(parsed.storages))
                self._sets[key] = entry
                # Storages another kept set opened already are this set's too (a trainer that
                # replaced a few parameters sends a new set naming mostly the same storages).
                for i, fields in enumerate(parsed.storages):
                    known = self._flats.get((self._storage_key(fields), device_index))
                    if known is not None:
                        known[1].add(key)
                        entry.flats[i] = known[0]
                if parsed.complete:
                    for other in [k for k in self._sets if k != key]:
                        dropped.append(self._drop_set(other))
                    for skey in [k for k, (_, holders) in self._flats.items() if not holders]:
                        dropped.append(self._flats.pop(skey))
                while len(self._sets) > self.MAX_KEPT_SETS:
                    dropped.append(self._drop_set(next(iter(self._sets))))
            else:
                self._sets.move_to_end(key)
            if not referred and msg.storage_set_id:
                self._name(entry, bytes(msg.storage_set_id), raw, parsed)
            event_fields = parsed.event_fields
            if event_fields is not None and entry.event is None:
                try:
                    entry.event = self._event_opener(event_fields, device_index)
                    self.event_opens += 1
                except BaseException:
                    dropped.append(self._drop_set(key))
                    raise
        if dropped:
            del dropped
            self._collect()
        return entry, new

    def storage(self, entry: OpenedStorageSet, index: int) -> torch.Tensor:
        """Storage ``index`` of a kept set as flat uint8 bytes, opened at its first use."""
        flats = entry.flats  # emptied when the set is dropped
        flat = flats[index] if index < len(flats) else None
        if flat is not None:
            return flat
        fields = entry.storages.storages[index]
        skey = (self._storage_key(fields), entry.device_index)
        set_key = entry.key
        dropped: list[object] = []
        with self._lock:
            if self._sets.get(set_key) is not entry:
                raise WeightwireError(
                    Reason.HANDLE_OPEN_FAILED, "CUDA IPC storage set used after it was dropped"
                )
            known = self._flats.get(skey)
            if known is None:
                while len(self._flats) >= self._capacity and len(self._sets) > 1:
                    oldest = next(k for k in self._sets if k != set_key)
                    dropped.append(self._drop_set(oldest))
                    for k in [k for k, (_, holders) in self._flats.items() if not holders]:
                        dropped.append(self._flats.pop(k))
                if len(self._flats) >= self._capacity:
                    raise WeightwireError(
                        Reason.HANDLE_OPEN_FAILED,
                        f"this worker keeps at most {self._capacity} CUDA IPC storages open; a payload needs more",
                    )
                flat = self._opener(fields, entry.device_index)
                self.opens += 1
                known = (flat, set())
                self._flats[skey] = known
            known[1].add(set_key)
            entry.flats[index] = known[0]
        if dropped:
            del dropped
            self._collect()
        return known[0]

    def _name(self, entry: OpenedStorageSet, name: bytes, raw: bytes, parsed: CudaIpcStorageSet) -> None:
        """Keep ``entry`` under the trainer's ``name`` too (caller holds the lock)."""
        self._ids[name] = (raw, parsed)
        if name in entry.names:
            return
        entry.names.append(name)
        while len(entry.names) > MAX_NAMES_PER_SET:
            old = entry.names.pop(0)
            named = self._ids.get(old)
            if named is not None and named[0] == raw:
                del self._ids[old]

    @staticmethod
    def _storage_key(fields: CudaIpcFields) -> tuple[bytes, int, int, bytes, int]:
        return (*fields.cache_key, fields.ref_counter_offset)

    def _drop_set(self, key: tuple[bytes, int]) -> object:
        """Forget one set (caller holds the lock); storages no other set holds go with it. Returns
        what must be let go outside the lock before ``_collect`` (the mappings)."""
        entry = self._sets.pop(key)
        gone: list[object] = [entry]
        for fields in entry.storages.storages:
            skey = (self._storage_key(fields), entry.device_index)
            known = self._flats.get(skey)
            if known is None:
                continue
            known[1].discard(key)
            if not known[1]:
                gone.append(self._flats.pop(skey))
                self.dropped_storages += 1
        entry.flats = []
        # In place: a mapping object of an earlier bucket may still name this dict.
        entry.view_memo.clear()
        if not any(k[0] == key[0] for k in self._sets):
            for name in entry.names:
                named = self._ids.get(name)
                if named is not None and named[0] == key[0]:
                    del self._ids[name]
        return gone

    def release_all(self) -> int:
        """Drop every kept set and storage mapping; returns how many storages were open."""
        with self._lock:
            count = len(self._flats)
            self._sets.clear()
            self._flats.clear()
            self._parsed.clear()
            self._ids.clear()
            self._last = None
        self._collect()
        return count
