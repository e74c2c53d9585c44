"""The trainer's half of the transfer-group transport: its options (``TransferGroupOptions``) and
its exporter (``GroupExporter``, its row in ``weightwire.core.transports.table``), which stages in
plain memory on the device the backend sends from and routes each update over the pusher's
``GroupLink`` (``transfer_group_link``: forming, routing, sending, tearing down).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from weightwire.client.inputs.plan import PlanError
from weightwire.client.transports import exporter as exp
from weightwire.client.transports.route import Job
from weightwire.client.transports.transfer_group_options import TransferGroupOptions
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports import table as transports
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    from weightwire.client.transports.transfer_group_link import GroupLink

__all__ = ["GroupExporter", "TransferGroupOptions"]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# The exporter: staging buffers on the backend's device
# --------------------------------------------------------------------------------------------


class _GroupBuffer(exp.StagingBuffer):
    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.capacity_bytes = flat.numel()

    def tensor(self) -> torch.Tensor:
        return self.flat

    def ready(self) -> None:
        if self.flat.device.type == "cuda":
            torch.cuda.current_stream(self.flat.device).synchronize()


class GroupExporter(exp.Exporter):
    """The trainer's half of the transfer-group transport: staging in plain memory on the device the
    backend sends from (host memory for gloo, the trainer's GPU for NCCL; a caller's flat buffer on
    that device is sent in place), and the update hooks through the pusher's ``GroupLink``: each
    update checks (or forms) the group before anything is sent, and ``route_update`` gives every
    job per-worker payloads (each worker's group rank and byte ranges) and its sends."""

    TRANSPORT = transports.TRANSFER_GROUP
    label = None
    routes_each_update = True

    def __init__(self, link: GroupLink | None = None) -> None:
        self.link = link

    @property
    def device(self) -> torch.device:
        """Where staging lives: the device the group's backend sends from, asked at each use (an
        NCCL trainer may select its GPU after building the pusher)."""
        return self.link.device if self.link is not None else torch.device("cpu")

    @classmethod
    def for_source(cls, source: torch.device) -> exp.Exporter:
        return cls()

    def allocate(self, capacity_bytes: int) -> exp.StagingBuffer:
        return _GroupBuffer(torch.empty(max(int(capacity_bytes), 1), dtype=torch.uint8, device=self.device))

    def wrap(self, flat: torch.Tensor) -> exp.StagingBuffer | None:
        if flat.device.type != self.device.type or not flat.is_contiguous():
            return None
        return _GroupBuffer(flat.reshape(-1).view(torch.uint8))

    def export(self, buffer: exp.StagingBuffer, size_bytes: int, label: DeviceRef) -> pb.Payload:
        # One payload per device cannot name each worker's group rank; route_update makes them.
        raise WeightwireError(
            Reason.TRANSPORT_UNAVAILABLE,
            "transfer-group payloads name each worker's group rank; they are made per worker by route_update",
        )

    def _formed_link(self) -> GroupLink:
        if self.link is None:
            raise PlanError(
                Reason.TRANSPORT_UNAVAILABLE,
                "transport 'transfer_group' needs WeightPusher(..., transfer_group=TransferGroupOptions(host=...))",
            )
        return self.link

    def route_update(
        self,
        jobs: Sequence[Job],
        manifests: Mapping[str, ShardManifest],
        statuses: Mapping[str, pb.GetStatusResponse] | None,
        sources: Mapping[str, torch.Tensor] | None,
        *,
        verify_checksums: bool,
    ) -> list[Job]:
        link = self._formed_link()
        link.ensure(manifests, statuses, max((j.size_bytes for j in jobs), default=0))
        return link.route(jobs, manifests, sources, verify_checksums=verify_checksums)

    def update_failed(self, failures: Mapping[str, WeightwireError]) -> bool:
        # The workers leave the group when an update fails; so does this side. A worker not in the
        # plan restarted since its manifest was read: read them again next time.
        if self.link is not None:
            self.link.teardown("an update failed", leave=False)
        return any(err.kind is Reason.GROUP_UNKNOWN_MEMBER for err in failures.values())
