"""What one bucket is sent as: ``Job`` (its layout, recipients, size and how to prepare it) and
``PreparedBucket`` (its bytes staged and exported: the payloads each worker gets). Made by the
update's job builders (``weightwire.client.update.staging``) and the transports' routes, read by
the session (``weightwire.client.update.session``) that streams them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from weightwire.client.inputs.plan import TensorSpec
from weightwire.client.transports.staging_buffer import StagingBuffer
from weightwire.core.devices import DeviceRef
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["Job", "PreparedBucket"]


@dataclasses.dataclass
class PreparedBucket:
    """A bucket whose bytes are staged and exported: the payloads each worker gets."""

    fixed: list[pb.Payload]
    per_worker: Callable[[DeviceRef], pb.Payload] | None
    checksum: pb.Checksum | None
    release: Callable[[bool], None]
    # Where the layout starts inside the exported storage (a wrapped view into a larger buffer).
    base_offset_bytes: int = 0
    # The buffer holding the bucket (for transports that move its bytes themselves).
    staged: StagingBuffer | None = None
    # A transport whose payload differs per worker (transfer groups: each worker's group rank and
    # byte ranges), by worker address; it wins over ``fixed`` and ``per_worker``.
    per_recipient: Callable[[str], pb.Payload] | None = None
    # Called once the bucket message is queued on every recipient's stream (the transfer starts).
    on_sent: Callable[[], None] | None = None

    def payloads_for(
        self, device: DeviceRef, cache: dict[DeviceRef, pb.Payload], worker: str = ""
    ) -> list[pb.Payload]:
        if self.per_recipient is not None:
            return [self.per_recipient(worker)]
        if self.per_worker is None:
            return self.fixed
        if device not in cache:
            cache[device] = self.per_worker(device)
        return [*self.fixed, cache[device]]


@dataclasses.dataclass
class Job:
    """One bucket to send: its layout, the workers that own something in it, its size, and how to
    stage and export its bytes (``prepare(stopped, deadline)``, called by the session in order)."""

    specs: list[TensorSpec]
    recipients: tuple[str, ...]
    size_bytes: int
    prepare: Callable[[Callable[[], bool], float], PreparedBucket]
