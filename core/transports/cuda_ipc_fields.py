"""The fields of one exported CUDA storage (``weightwire.v1.CudaIpcHandle``) and their checks.

Everything on the wire is checked before it reaches torch: the sizes and offsets, the handles'
lengths, the producer event a consumer must wait for, and the counter file name, which must be one
torch makes (``/torch_...``), with its slot inside the file, because the consumer writes to that
slot. ``weightwire.core.transports.cuda_ipc`` (which names all of these too) exports and opens
storages; ``weightwire.core.transports.cuda_ipc_storages`` checks a payload of several.
"""

from __future__ import annotations

import dataclasses
import re

from weightwire.core.errors import Reason, WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb

# torch's counter files hold this many int64 slots (torch/csrc/CudaIPCTypes.h,
# CUDA_IPC_REF_COUNTER_FILE_SIZE); the consumer decrements slot ``ref_counter_offset``.
REF_COUNTER_SLOTS = 10000
# torch names counter files with at::NewProcessWideShmHandle(): "/torch_<pid>_<random>_<n>".
# Matched with fullmatch (a `$` would let a final newline through).
_REF_COUNTER_RE = re.compile(r"/torch_[0-9A-Za-z_]{1,120}")
# A cudaIpcMemHandle_t is 64 bytes; torch prefixes a type byte (and expandable segments carry a
# little more). Anything far larger is not a handle.
MAX_MEMORY_HANDLE_BYTES = 4096
MAX_EVENT_HANDLE_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class CudaIpcFields:
    """The values that reopen one exported CUDA storage in another process (``CudaIpcHandle``)."""

    memory_handle: bytes
    storage_offset_bytes: int
    storage_size_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def to_proto(self) -> pb.CudaIpcHandle:
        return pb.CudaIpcHandle(**dataclasses.asdict(self))

    @classmethod
    def from_proto(cls, msg: pb.CudaIpcHandle | pb.CudaIpcStorage) -> CudaIpcFields:
        """Parse and check a handle from the wire, or one storage of a handle with several (which
        has no event of its own: the handle's covers them all); raises ``WeightwireError`` on
        anything unsafe."""
        event = (b"", False)
        if isinstance(msg, pb.CudaIpcHandle):
            event = (bytes(msg.event_handle), bool(msg.event_sync_required))
        fields = cls(
            bytes(msg.memory_handle),
            int(msg.storage_offset_bytes),
            int(msg.storage_size_bytes),
            bytes(msg.ref_counter_handle),
            int(msg.ref_counter_offset),
            *event,
        )
        fields.validate()
        return fields

    def validate(self) -> None:
        if not self.memory_handle:
            raise WeightwireError(Reason.HANDLE_MISSING, "CUDA IPC payload has an empty memory_handle")
        if len(self.memory_handle) > MAX_MEMORY_HANDLE_BYTES:
            raise WeightwireError(
                Reason.HANDLE_MISSING,
                f"CUDA IPC memory_handle is {len(self.memory_handle)} bytes; a CUDA IPC handle is at most "
                f"{MAX_MEMORY_HANDLE_BYTES}",
            )
        if self.storage_offset_bytes < 0:
            raise WeightwireError(
                Reason.INVALID_OFFSET,
                f"CUDA IPC storage_offset_bytes is negative ({self.storage_offset_bytes})",
            )
        if self.storage_size_bytes <= 0:
            raise WeightwireError(
                Reason.INVALID_SIZE,
                f"CUDA IPC storage_size_bytes must be positive, got {self.storage_size_bytes}",
            )
        check_event_fields(self.event_handle, self.event_sync_required)
        check_ref_counter(self.ref_counter_handle, self.ref_counter_offset)

    @property
    def cache_key(self) -> tuple[bytes, int, int, bytes]:
        """Identity of the exported storage: same allocation, same place, same size, and the same
        producer (its counter file, named after its pid), so a restarted sender can never be
        served a mapping of the process before it."""
        return (
            self.memory_handle,
            self.storage_offset_bytes,
            self.storage_size_bytes,
            self.ref_counter_handle,
        )

    @property
    def ref_counter(self) -> tuple[bytes, int]:
        return (self.ref_counter_handle, self.ref_counter_offset)

    @property
    def event_key(self) -> tuple[bytes, bytes, int] | None:
        """Identity of the producer event to wait for before reading, or None (nothing to wait for).

        An event is named together with the share it came with (counter file and slot, unique per
        share in the producer process): a producer pairs each share with one event for the share's
        lifetime, so a new share, whose event handle may reuse the bytes of an event destroyed
        since, is never served an event opened for an older one."""
        if not self.event_sync_required:
            return None
        return (self.event_handle, self.ref_counter_handle, self.ref_counter_offset)

    def with_event(self, event_handle: bytes) -> CudaIpcFields:
        """The same storage, to be read only after the producer event ``event_handle`` completed."""
        fields = dataclasses.replace(self, event_handle=bytes(event_handle), event_sync_required=True)
        fields.validate()
        return fields


def check_ref_counter(handle: bytes, offset: int) -> None:
    """Refuse a counter file the consumer must not write to (it decrements one int64 slot there)."""
    try:
        name = handle.decode("ascii")
    except UnicodeDecodeError:
        name = ""
    if not _REF_COUNTER_RE.fullmatch(name):
        raise WeightwireError(
            Reason.INVALID_SHM_NAME,
            f"CUDA IPC ref_counter_handle {handle[:80]!r} is not a torch counter file name "
            "('/torch_' followed by [0-9A-Za-z_]); export with weightwire.core.transports.cuda_ipc.share_cuda_tensor",
            name=handle[:80].decode("ascii", "replace"),
        )
    if not 0 <= offset < REF_COUNTER_SLOTS:
        raise WeightwireError(
            Reason.INVALID_OFFSET,
            f"CUDA IPC ref_counter_offset {offset} is outside the counter file's {REF_COUNTER_SLOTS} slots",
        )


def check_event_fields(event_handle: bytes, sync_required: bool) -> None:
    """Refuse a producer event handle that cannot be one, or a wait asked for without one."""
    if len(event_handle) > MAX_EVENT_HANDLE_BYTES:
        raise WeightwireError(
            Reason.HANDLE_MISSING, f"CUDA IPC event_handle is {len(event_handle)} bytes, too long"
        )
    if sync_required and not event_handle:
        raise WeightwireError(
            Reason.HANDLE_MISSING, "CUDA IPC payload requires an event sync but carries no event_handle"
        )
