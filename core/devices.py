"""Device identity: which physical device a payload lives on, and which one this process is.

Every payload carries a ``DeviceRef`` of the device it was exported from; a worker compares it with
its own through ``is_own_device``. CUDA devices are named by GPU UUID, never by an index (indices
depend on CUDA_VISIBLE_DEVICES, which differs per process). Host memory is named by the machine's
boot id, since host shared memory only means something on that machine.

UUIDs are compared only in their one canonical form: NVML prints ``GPU-1a2b...`` (or ``MIG-...``),
torch prints the bare lower-case UUID. ``normalize_uuid`` makes the canonical form once (trimmed,
lower case, one ``GPU-``/``MIG-`` prefix removed); every ``DeviceRef`` holds it, and a label from
the wire that is not a device UUID in that form (a second prefix, control characters, hundreds of
characters) is refused rather than normalised further, so normalising is never applied twice.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import uuid as uuid_mod
from typing import TYPE_CHECKING

from weightwire.core.errors import Reason, WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    import torch

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_PREFIXES = ("gpu-", "mig-")
# A device UUID in canonical form (a GPU or MIG UUID, a boot id: 36 characters); room to spare.
MAX_UUID_CHARS = 128
_CANONICAL_RE = re.compile(r"[0-9a-z][0-9a-z._:/-]*")


def normalize_uuid(raw: str) -> str:
    """Canonical form of a device UUID: trimmed, lower-case, without a ``GPU-``/``MIG-`` prefix
    (one: ``GPU-GPU-x`` becomes ``gpu-x``, which ``uuid_problem`` refuses)."""
    text = raw.strip().lower()
    for prefix in _PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix) :]
            break
    return text


def uuid_problem(canonical: str) -> str | None:
    """Why ``canonical`` (a ``normalize_uuid`` result) cannot name a device, or None when it can."""
    if not canonical:
        return "it is empty"
    if len(canonical) > MAX_UUID_CHARS:
        return f"it is {len(canonical)} characters long (a device UUID has at most {MAX_UUID_CHARS})"
    if canonical.startswith(_PREFIXES):
        return "it carries a GPU-/MIG- prefix twice"
    if not _CANONICAL_RE.fullmatch(canonical):
        return "it has characters other than [0-9a-z._:/-]"
    return None


@dataclasses.dataclass(frozen=True)
class DeviceRef:
    """A physical device: kind (``pb.DEVICE_KIND_CUDA`` / ``pb.DEVICE_KIND_HOST``) and normalised UUID."""

    kind: pb.DeviceKind.ValueType
    uuid: str

    def __post_init__(self) -> None:
        canonical = normalize_uuid(self.uuid)
        if canonical.startswith(_PREFIXES):
            # Normalising this value again would change it: it has no one canonical form.
            raise ValueError(f"device UUID {self.uuid[:80]!r} carries a GPU-/MIG- prefix twice")
        object.__setattr__(self, "uuid", canonical)

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
        problem = uuid_problem(normalize_uuid(msg.uuid))
        if problem is not None:
            raise WeightwireError(
                Reason.PAYLOAD_LABEL_MISSING,
                f"payload device label uuid {msg.uuid[:80]!r}{'...' if len(msg.uuid) > 80 else ''} is not a device UUID: "
                f"{problem}; label payloads with the bare UUID torch reports (or NVML's GPU-/MIG- form)",
            )
        return cls(msg.kind, msg.uuid)

    def to_proto(self) -> pb.DeviceId:
        return pb.DeviceId(kind=self.kind, uuid=self.uuid)

    @property
    def is_cuda(self) -> bool:
        return self.kind == pb.DEVICE_KIND_CUDA

    def __str__(self) -> str:
        kind = (
            "cuda"
            if self.kind == pb.DEVICE_KIND_CUDA
            else "host"
            if self.kind == pb.DEVICE_KIND_HOST
            else "?"
        )
        return f"{kind}:{self.uuid}"


def is_own_device(label: DeviceRef, own: DeviceRef) -> bool:
    """The one decision "is this payload mine": same kind and same canonical UUID (both are
    canonical already; normalising again would let a second prefix through)."""
    return label.kind == own.kind and label.uuid == own.uuid


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


def device_ref_of(device: torch.device | str | int) -> DeviceRef:
    """The physical identity of a torch device: its GPU's UUID on CUDA, the host's boot id otherwise."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return DeviceRef.cuda(cuda_device_uuid(index))
    return DeviceRef.host()
