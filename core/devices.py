"""Device identity: which physical device a payload lives on, and which one this process is.

Every payload carries a ``DeviceRef`` of the device it was exported from; a worker compares it with
its own through ``is_own_device``. CUDA devices are named by GPU UUID, never by an index (indices
depend on CUDA_VISIBLE_DEVICES, which differs per process). Host memory is named by the machine's
boot id, since host shared memory only means something on that machine.

UUIDs are compared only in normalised form: NVML prints ``GPU-1a2b...`` (or ``MIG-...``), torch
prints the bare lower-case UUID.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid as uuid_mod

from weightwire.core.errors import Reason, WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_PREFIXES = ("gpu-", "mig-")


def normalize_uuid(raw: str) -> str:
    """Canonical form of a device UUID: trimmed, lower-case, without a ``GPU-``/``MIG-`` prefix."""
    text = raw.strip().lower()
    for prefix in _PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix) :]
            break
    return text


@dataclasses.dataclass(frozen=True)
class DeviceRef:
    """A physical device: kind (``pb.DEVICE_KIND_CUDA`` / ``pb.DEVICE_KIND_HOST``) and normalised UUID."""

    kind: int
    uuid: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "uuid", normalize_uuid(self.uuid))

    @classmethod
    def cuda(cls, uuid: str) -> DeviceRef:
        return cls(pb.DEVICE_KIND_CUDA, uuid)

    @classmethod
    def host(cls, boot_id: str | None = None) -> DeviceRef:
        return cls(pb.DEVICE_KIND_HOST, boot_id if boot_id is not None else host_boot_id())

    @classmethod
    def from_proto(cls, msg: pb.DeviceId) -> DeviceRef:
        """Parse a label from the wire; an unspecified kind or an empty UUID is rejected."""
        if msg.kind == pb.DEVICE_KIND_UNSPECIFIED or msg.kind not in pb.DeviceKind.values():
            raise WeightwireError(
                Reason.DEVICE_KIND_UNSPECIFIED,
                f"payload device kind is {msg.kind} (unspecified or unknown); set DEVICE_KIND_CUDA or DEVICE_KIND_HOST",
            )
        if not normalize_uuid(msg.uuid):
            raise WeightwireError(Reason.PAYLOAD_LABEL_MISSING, "payload device label has an empty uuid")
        return cls(msg.kind, msg.uuid)

    def to_proto(self) -> pb.DeviceId:
        return pb.DeviceId(kind=self.kind, uuid=self.uuid)  # type: ignore[arg-type]

    @property
    def is_cuda(self) -> bool:
        return self.kind == pb.DEVICE_KIND_CUDA

    def __str__(self) -> str:
        kind = "cuda" if self.kind == pb.DEVICE_KIND_CUDA else "host" if self.kind == pb.DEVICE_KIND_HOST else "?"
        return f"{kind}:{self.uuid}"


def is_own_device(label: DeviceRef, own: DeviceRef) -> bool:
    """The one decision "is this payload mine": same kind and same normalised UUID."""
    return label.kind == own.kind and normalize_uuid(label.uuid) == normalize_uuid(own.uuid)


@functools.lru_cache(maxsize=1)
def host_boot_id() -> str:
    """This machine's boot id (stable until reboot, distinct per machine)."""
    try:
        with open(_BOOT_ID_PATH, encoding="ascii") as f:
            return normalize_uuid(f.read())
    except OSError:
        # Not Linux: fall back to a per-process id, so host payloads never match across machines.
        return str(uuid_mod.uuid4())


def cuda_device_uuid(index: int) -> str:
    """Normalised UUID of the process-local CUDA device ``index`` (as torch sees it)."""
    import torch

    return normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))


def local_cuda_devices() -> dict[str, int]:
    """Normalised UUID -> process-local index for every CUDA device this process can see."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {cuda_device_uuid(i): i for i in range(torch.cuda.device_count())}


def local_cuda_index(device: DeviceRef) -> int | None:
    """This process's index of a CUDA device given by UUID, or None if it is not visible here."""
    if not device.is_cuda:
        return None
    return local_cuda_devices().get(device.uuid)


def device_ref_of(device: object) -> DeviceRef:
    """The physical identity of a torch device: its GPU's UUID on CUDA, the host's boot id otherwise."""
    import torch

    dev = torch.device(device)  # type: ignore[call-overload]
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return DeviceRef.cuda(cuda_device_uuid(index))
    return DeviceRef.host()


def nvml_uuid_to_torch(nvml_uuid: str) -> str:
    """NVML prints ``GPU-xxxxxxxx-...``; torch prints the bare form. Both normalise equal."""
    return normalize_uuid(nvml_uuid)
