"""How one bucket travels: ``Job`` (its layout, recipients, size and how to prepare it) and the
``Route`` its ``prepare`` returns once the bytes are staged and exported.

A route answers the three questions the session (``weightwire.client.update.session``) asks of
every bucket, whatever the transport or the number of trainer ranks behind it: what each worker
gets (its payloads, where the layout starts in the exported storage, the checksum), what starts
once the bucket message is queued on every recipient's stream (a transfer group's sends), and how
the bytes are released (reused once every recipient acked, discarded when one may still read them).
Routes are frozen: built once by the update's job builders (``weightwire.client.update.staging``),
the transports (``transfer_group_link``) or the ranks (``weightwire.client.ranks``), never changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Protocol

from weightwire.client.inputs.plan import TensorSpec
from weightwire.client.transports.staging_buffer import StagingBuffer
from weightwire.core.devices import DeviceRef
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["ExportedRoute", "Job", "PerWorkerRoute", "Route"]


class Route(Protocol):
    """One prepared bucket, as the session sends it."""

    @property
    def base_offset_bytes(self) -> int:
        """Where the layout starts inside the exported storage (a wrapped view into a larger buffer)."""
        ...

    @property
    def checksum(self) -> pb.Checksum | None: ...

    def payloads(self, recipients: Mapping[str, DeviceRef]) -> dict[str, list[pb.Payload]]:
        """What each worker gets, by address (``recipients``: each worker's device)."""
        ...

    def queued(self) -> None:
        """Called once the bucket message is queued on every recipient's stream."""
        ...

    def release(self, ok: bool) -> None:
        """Hand the bytes back: ``ok`` when every recipient acked (reuse them), else discard."""
        ...


def _keep(ok: bool) -> None:
    """Nothing to hand back (a caller's buffer exported where it lives)."""


@dataclasses.dataclass(frozen=True)
class ExportedRoute:
    """One staged buffer exported once for every worker (``fixed``), or once per worker device
    when its exporter labels each payload with the device that reads it (``per_device``); a
    gathered bucket's payloads of several sources are all ``fixed``."""

    fixed: tuple[pb.Payload, ...]
    per_device: Callable[[DeviceRef], pb.Payload] | None = None
    checksum: pb.Checksum | None = None
    releaser: Callable[[bool], None] = _keep
    base_offset_bytes: int = 0
    # The buffer holding the bucket, for a transport that moves its bytes itself (a transfer group).
    staged: StagingBuffer | None = None

    def payloads(self, recipients: Mapping[str, DeviceRef]) -> dict[str, list[pb.Payload]]:
        if self.per_device is None:
            return {a: list(self.fixed) for a in recipients}
        made: dict[DeviceRef, pb.Payload] = {}
        out = {}
        for a, device in recipients.items():
            if device not in made:
                made[device] = self.per_device(device)
            out[a] = [*self.fixed, made[device]]
        return out

    def queued(self) -> None:
        pass

    def release(self, ok: bool) -> None:
        self.releaser(ok)


@dataclasses.dataclass(frozen=True)
class PerWorkerRoute:
    """A payload of its own for every worker (CUDA tensors exported where they live: each worker's
    share of the storages; a transfer group: each worker's group rank and byte ranges), and what
    starts once the message is queued (a transfer group's sends of the bytes)."""

    by_worker: Mapping[str, pb.Payload]
    releaser: Callable[[bool], None] = _keep
    checksum: pb.Checksum | None = None
    base_offset_bytes: int = 0
    on_queued: Callable[[], None] | None = None

    def payloads(self, recipients: Mapping[str, DeviceRef]) -> dict[str, list[pb.Payload]]:
        return {a: [self.by_worker[a]] for a in recipients}

    def queued(self) -> None:
        if self.on_queued is not None:
            self.on_queued()

    def release(self, ok: bool) -> None:
        self.releaser(ok)


@dataclasses.dataclass(frozen=True)
class Job:
    """One bucket to send: its layout, the workers that own something in it, its size, and how to
    stage and export its bytes (``prepare(stopped, deadline)``, called by the session in order)."""

    specs: list[TensorSpec]
    recipients: tuple[str, ...]
    size_bytes: int
    prepare: Callable[[Callable[[], bool], float], Route]
