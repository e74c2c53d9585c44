"""Which payload of a bucket this worker imports: ``select_own_payload``, the one place that decides.

Called by the worker service for every bucket that holds at least one owned tensor. Pure: the set of
locally visible CUDA devices is passed in (``is_local_cuda``), so tests run it from tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from weightwire.core.devices import DeviceRef, is_own_device, local_cuda_index
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.text import bounded_join
from weightwire.v1 import weight_transfer_pb2 as pb

# Labels listed in an error message before it says "... and N more" (metadata has them all).
_MAX_LABELS_IN_MESSAGE = 8


@dataclasses.dataclass(frozen=True)
class Selection:
    payload: pb.Payload
    device: DeviceRef
    peer: bool


def payload_labels(payloads: Sequence[pb.Payload]) -> list[DeviceRef]:
    """Every payload's device label, parsed; missing, unspecified and duplicate labels are errors."""
    labels: list[DeviceRef] = []
    seen: set[DeviceRef] = set()
    for i, payload in enumerate(payloads):
        if not payload.HasField("device"):
            raise WeightwireError(
                Reason.PAYLOAD_LABEL_MISSING,
                f"payload {i} has no device label; every payload must say which device it lives on",
                payload=str(i),
            )
        label = DeviceRef.from_proto(payload.device)
        if label in seen:
            raise WeightwireError(
                Reason.DUPLICATE_PAYLOAD_LABEL,
                f"two payloads are labelled {label}; each device may appear once per bucket",
                label=str(label),
            )
        seen.add(label)
        labels.append(label)
    return labels


def _local_cuda(label: DeviceRef) -> bool:
    return local_cuda_index(label) is not None


def select_own_payload(
    payloads: Sequence[pb.Payload],
    own_device: DeviceRef,
    *,
    allow_peer: bool = False,
    host_device: DeviceRef | None = None,
    is_local_cuda: Callable[[DeviceRef], bool] = _local_cuda,
) -> Selection:
    """The payload this worker imports, in order of preference:

    1. the one labelled with the worker's own device (``is_own_device``);
    2. for a CUDA worker, host memory of this machine (labelled with ``host_device``, the boot id):
       every process of the host can read it, so no opt-in is needed;
    3. only when ``allow_peer``: a CUDA payload on another GPU visible in this process (reported as a
       peer import); if none is, PEER_DEVICE_UNAVAILABLE.

    Otherwise NO_PAYLOAD_FOR_DEVICE naming this worker's device and every label received.
    """
    labels = payload_labels(payloads)
    for payload, label in zip(payloads, labels, strict=True):
        if is_own_device(label, own_device):
            return Selection(payload, label, peer=False)
    if own_device.is_cuda and host_device is not None:
        for payload, label in zip(payloads, labels, strict=True):
            if is_own_device(label, host_device):
                return Selection(payload, label, peer=False)
    shown = ", ".join(str(label) for label in labels[:_MAX_LABELS_IN_MESSAGE])
    if len(labels) > _MAX_LABELS_IN_MESSAGE:
        shown += f" ... and {len(labels) - _MAX_LABELS_IN_MESSAGE} more"
    metadata = {"own_device": str(own_device), "labels": bounded_join(str(label) for label in labels)}
    if allow_peer:
        if own_device.is_cuda:
            for payload, label in zip(payloads, labels, strict=True):
                if label.is_cuda and is_local_cuda(label):
                    return Selection(payload, label, peer=True)
        raise WeightwireError(
            Reason.PEER_DEVICE_UNAVAILABLE,
            f"no payload for this worker's device {own_device}, and peer-device import is allowed but no "
            f"payload is on a GPU this worker can reach (labels received: {shown or 'none'})",
            **metadata,
        )
    raise WeightwireError(
        Reason.NO_PAYLOAD_FOR_DEVICE,
        f"no payload labelled with this worker's device {own_device} (labels received: {shown or 'none'}); "
        "send a payload from this worker's own device, or set allow_peer_device_import for another GPU of this host",
        **metadata,
    )
