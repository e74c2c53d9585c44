"""Where a payload can carry a TensorDelta outside tensor specs, and the refusal of one there.

A bucket filled straight into the model (every trainer rank a source, ``TRANSFER_MODE_SLICES``)
may carry a ``SliceTransfer.delta`` per region only in a delta update (``UpdateHeader.delta_base``;
``weightwire.server.transports.transfer_group_slice_deltas`` receives and applies those): in any
other update such a region is INVALID_DELTA, before anything is planned or received. The fields
that can hold one are found from the contract's descriptors, so that no handle is named here (the
importer says how a bucket loads).
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from weightwire.core.delta.errors import invalid_delta
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["carries_region_deltas", "refuse_region_deltas"]


def _delta_paths(
    descriptor: Descriptor, seen: frozenset[str] = frozenset()
) -> list[tuple[FieldDescriptor, ...]]:
    """Every chain of fields from a message of ``descriptor`` down to a TensorDelta field."""
    paths: list[tuple[FieldDescriptor, ...]] = []
    for field in descriptor.fields:
        sub = field.message_type
        if sub is None or sub.full_name in seen:
            continue
        if sub.full_name == pb.TensorDelta.DESCRIPTOR.full_name:
            paths.append((field,))
            continue
        paths.extend((field, *rest) for rest in _delta_paths(sub, seen | {descriptor.full_name}))
    return paths


_PAYLOAD_DELTA_PATHS = tuple(_delta_paths(pb.Payload.DESCRIPTOR))


def _carries(message: Message, path: tuple[FieldDescriptor, ...]) -> bool:
    field, rest = path[0], path[1:]
    value = getattr(message, field.name)
    if isinstance(value, Message):  # a singular field (a repeated one is a container of them)
        if not message.HasField(field.name):
            return False
        items = [value]
    else:
        items = list(value)
    return any(not rest or _carries(item, rest) for item in items)


def carries_region_deltas(payload: pb.Payload) -> bool:
    """Whether ``payload`` carries a TensorDelta anywhere (a slices handle's region)."""
    return any(_carries(payload, path) for path in _PAYLOAD_DELTA_PATHS)


def refuse_region_deltas(index: int, payload: pb.Payload) -> None:
    """INVALID_DELTA if ``payload`` carries a TensorDelta anywhere, in an update without a base."""
    if carries_region_deltas(payload):
        raise invalid_delta(
            f"bucket {index}: a region of a bucket whose every trainer rank is a source carries a TensorDelta "
            "in an update without delta_base; a delta needs the base it applies to (UpdateHeader.delta_base)",
            bucket=str(index),
        )
