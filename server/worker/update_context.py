"""What one update on a worker sees of the worker that runs it (``UpdateContext``), and the error and
timestamp both the update and its service record."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from google.protobuf import timestamp_pb2
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.server.rules.layout import LayoutCache
from weightwire.server.transports.importer import PayloadImporter
from weightwire.server.worker.adapter import EngineAdapter


def cancelled_error() -> WeightwireError:
    """What a worker records for an update whose call ended under it: the client cancelled it, its
    deadline passed, or gRPC refused one of its messages (over 64 MiB ends the call the same way).
    gRPC itself reports CANCELLED or DEADLINE_EXCEEDED to the (gone) client; GetStatus and the log
    keep this."""
    return WeightwireError(
        Reason.CANCELLED,
        "the call ended before commit (the client cancelled it or its deadline passed), or gRPC refused one of "
        "its messages (one over 64 MiB: the client got RESOURCE_EXHAUSTED); nothing was committed",
    )


def now_timestamp() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.GetCurrentTime()
    return ts


@dataclasses.dataclass(frozen=True)
class UpdateContext:
    """What an update uses of the worker that runs it; fixed while the worker runs."""

    adapter: EngineAdapter
    manifest: ShardManifest
    own_device: DeviceRef
    host_device: DeviceRef
    target_device: torch.device
    importers: Mapping[str, PayloadImporter]
    is_local_cuda: Callable[[DeviceRef], bool] | None
    layouts: LayoutCache
