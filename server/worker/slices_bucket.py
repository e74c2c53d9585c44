"""A bucket of an update whose every trainer rank is a source (``TRANSFER_MODE_SLICES``): the
update's rules for it, and its receive straight into the tensors the engine keeps.

Such a bucket carries no tensor specs; its one payload (labelled with this worker's device) lists the
regions this worker receives and who sends each (``weightwire.server.transports.transfer_group_slices``
checks them against the manifest's pieces). The tensors it fills count as loaded for the update's
rules (no name twice in an update, a FULL update delivers every owned tensor), and the bytes land in
the model as they arrive, so a failure after the receive began leaves the worker INCONSISTENT.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Set
from typing import cast

import torch
from weightwire.core.capabilities import has_capability
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports import table as transports
from weightwire.server.rules.layout import duplicate_tensor
from weightwire.server.rules.selection import select_own_payload
from weightwire.server.transports.importer import PayloadImporter
from weightwire.server.transports.transfer_group import GroupImporter
from weightwire.server.worker.adapter import EngineAdapter, KeepsTensors
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["is_slices_bucket", "load_slices"]


def is_slices_bucket(msg: pb.Bucket) -> bool:
    return any(
        p.WhichOneof("handle") == "transfer_group" and p.transfer_group.mode == pb.TRANSFER_MODE_SLICES
        for p in msg.payloads
    )


def load_slices(
    msg: pb.Bucket,
    *,
    adapter: EngineAdapter,
    manifest: ShardManifest,
    own_device: DeviceRef,
    importers: Mapping[str, PayloadImporter],
    names_seen: Set[str],
    max_tensors: int,
    will_write: Callable[[], None],
    call_ended: threading.Event | None = None,
) -> tuple[pb.BucketAck, frozenset[str]]:
    """Check the bucket, receive its regions into the adapter's kept tensors, return the ack (after
    the bytes are in the model) and the names it filled. Once ``call_ended`` is set (the update's
    call was cancelled or passed its deadline) every wait of the receive stops: CANCELLED."""
    if msg.tensors or len(msg.payloads) != 1:
        raise WeightwireError(
            Reason.MALFORMED_STREAM,
            f"bucket {msg.index}: a slices bucket carries no tensor specs and exactly one payload "
            f"(it has {len(msg.tensors)} specs, {len(msg.payloads)} payloads)",
            bucket=str(msg.index),
        )
    sel = select_own_payload(msg.payloads, own_device)
    importer = importers.get(transports.TRANSFER_GROUP.handle_field)
    if not isinstance(importer, GroupImporter) or not has_capability(adapter, KeepsTensors):
        raise WeightwireError(
            Reason.TRANSPORT_UNAVAILABLE,
            "this worker does not receive slices (its manifest has receives_slices false): its engine adapter "
            "does not expose the tensors it keeps; push from one trainer rank instead",
            transport="transfer_group",
        )
    checked = importer.slices(sel.payload, manifest)
    repeated = sorted(checked.names & names_seen)
    if repeated:
        raise duplicate_tensor(repeated[0])
    if len(names_seen) + len(checked.names) > max_tensors:
        raise WeightwireError(Reason.MALFORMED_STREAM, f"more than {max_tensors} tensors in one update")
    kept = cast(KeepsTensors, adapter).kept_tensors()
    t0 = time.perf_counter_ns()
    try:
        # A plan refused by the group (GROUP_PLAN_MISMATCH) wrote nothing: the worker keeps its state.
        received = importer.receive_slices(sel.payload, checked, kept, manifest, will_write, call_ended)
        if any(kept[n].is_cuda for n in checked.names):
            # NCCL receives complete on the stream; the ack promises the bytes are in the model.
            torch.cuda.synchronize()
    except WeightwireError:
        raise
    except Exception as e:
        raise WeightwireError(
            Reason.LOAD_FAILED,
            f"receiving the slices of bucket {msg.index} failed: {e!r}",
            bucket=str(msg.index),
        ) from e
    ack = pb.BucketAck(
        index=msg.index,
        tensors_loaded=len(checked.names),
        bytes_loaded=received,
        bytes_received=received,
        transport=importer.transport,
        load_duration_ns=time.perf_counter_ns() - t0,
    )
    ack.source_device.CopyFrom(sel.device.to_proto())
    return ack, checked.names
