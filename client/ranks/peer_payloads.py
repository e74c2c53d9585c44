"""The gathered routing's payloads between trainer ranks: each exporting rank exports the bucket it
packed on its own device and hands the payload to the sending rank inside the bucket's step
exchange (``rank_agreement.RankGroup.step``); the sender streams one route carrying them all.

A rank's step bytes: one byte saying whether a CRC-32 of the bucket follows, the 4-byte CRC (zero
when not asked for), then the serialised ``Payload``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence

from weightwire.client.ranks.rank_agreement import STEP_SLOT_BYTES
from weightwire.client.transports import exporter as exp
from weightwire.client.transports.route import ExportedRoute
from weightwire.client.update.staging import crc32_checksum
from weightwire.core.devices import DeviceRef
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["encode_payload", "gathered_route"]

# Room left in a step slot for the exchange's own framing.
_SLOT_FRAMING = 16


def encode_payload(
    exporter: exp.Exporter, buf: exp.StagingBuffer, size: int, verify_checksums: bool
) -> bytes:
    """This rank's step bytes for the sender: ``buf``'s first ``size`` bytes exported (and their CRC
    when asked for)."""
    buf.ready()
    label = exporter.label
    if label is None:
        raise RuntimeError("an exporting rank needs a transport that labels its payloads")
    crc = buf.crc32(size) if verify_checksums else None
    head = bytes([1 if crc is not None else 0]) + (crc or 0).to_bytes(4, "big")
    data = head + exporter.export(buf, size, label).SerializeToString()
    if len(data) > STEP_SLOT_BYTES - _SLOT_FRAMING:  # refused here, so the step exchange itself still happens
        raise RuntimeError(
            f"a payload of {len(data)} bytes does not fit the ranks' {STEP_SLOT_BYTES}-byte step"
        )
    return data


def gathered_route(
    g: int,
    own: ExportedRoute | None,
    peers: Collection[int],
    steps: Sequence[tuple[bool, bytes]],
    labels: Sequence[DeviceRef | None],
    released: Callable[[bool], None],
) -> ExportedRoute:
    """The sender's route for bucket ``g``: its own payload (if it exports this bucket) and each of
    ``peers``' from their step bytes, each labelled with the device that rank agreed on. Without a
    payload of its own, ``released`` runs once the bucket's workers are done with it."""
    fixed = list(own.fixed) if own is not None else []
    checksum = own.checksum if own is not None else None
    for r in sorted(peers):
        raw = steps[r][1]
        if len(raw) < 6:
            raise RuntimeError(f"trainer rank {r} sent no payload for bucket {g}")
        payload = pb.Payload.FromString(raw[5:])
        want = labels[r]
        if want is not None and DeviceRef(payload.device.kind, payload.device.uuid) != want:
            raise RuntimeError(
                f"trainer rank {r} sent a payload labelled for another device than it agreed on"
            )
        fixed.append(payload)
        if checksum is None and raw[0] == 1:
            checksum = crc32_checksum(int.from_bytes(raw[1:5], "big"))
    if own is not None:
        return dataclasses.replace(own, fixed=tuple(fixed), checksum=checksum)
    return ExportedRoute(tuple(fixed), checksum=checksum, releaser=released)
