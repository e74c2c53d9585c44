"""A bucket its importer loads itself (``FillsModel``): the update's rules for it, and its receive
straight into the tensors the engine keeps. Today that is a transfer group's bucket whose every
trainer rank is a source (``TRANSFER_MODE_SLICES``).

Such a bucket carries no tensor specs; its one payload (labelled with this worker's device) says
what it fills, which the importer checks against the manifest (``plan_fill``). The tensors it fills
count as loaded for the update's rules (no name twice in an update, a FULL update delivers every
owned tensor).

Where the bytes land depends on the adapter and the group; an update may come as several such
buckets per worker, and none of them reaches the model before the update commits. One that also
``StagesSlices`` (SGLang and vLLM, whose writes go through the engine's own gates) first says
whether it may take these tensors at all (``refuse_slices``, before anything waits); the bucket is
then received into staging of the kept shapes, where the importer's bytes arrive (``stage``: host
memory over gloo, whatever device the model is on, kept for the next update; the GPU over NCCL),
and handed to ``write_kept`` only when the update commits. One that only ``KeepsTensors`` (the
demo's ``TorchAdapter``) has them received into its tensors: over gloo a worker's receives are
staged in its receiving process's shared memory (``isolated_gloo``) and land when the update
commits too; over NCCL they land as they arrive, so a failure after the first bucket's receive
began leaves such a worker INCONSISTENT. So over gloo, and into SGLang and vLLM over either
backend, an update that does not commit (a member died, the trainer did not commit) leaves the
model as it was: CONSISTENT at the old version. What is held until the commit is the worker's
bytes of the update (its kept bytes for a FULL one), in host memory over gloo; what one bucket's
receive holds besides is bounded by the bucket (docs/design-notes.md, "Several buckets, one
commit").

In a delta update the regions carry deltas, applied into the kept tensors at the commit
(``transfer_group_slice_deltas``). An adapter that ``StagesSlices`` has no base in its staging: one
that also applies deltas through its own path (``AppliesDeltas`` and ``RefusesDeltas``: SGLang and
vLLM) says before anything waits whether it holds a base for every tensor of the bucket, is handed
the checked deltas, and applies them at the commit (``staged_deltas``); any other refuses such a
bucket with DELTA_BASE_MISMATCH before anything waits. Either refusal leaves the worker CONSISTENT
at its version, and the trainer sends the update whole.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, cast, runtime_checkable

import torch
from weightwire.core.capabilities import has_capability
from weightwire.core.delta import DELTA_BASE_MISMATCH
from weightwire.core.delta.errors import delta_error
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.server.rules.selection import select_own_payload
from weightwire.server.transports.importer import FillsModel, FillTarget, RegionChange
from weightwire.server.worker.adapter import AppliesDeltas, EngineAdapter, KeepsTensors
from weightwire.server.worker.delta_regions import carries_region_deltas
from weightwire.server.worker.staged_deltas import RefusesDeltas, StagedDeltas, apply_staged
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["StagesSlices", "fill_bucket", "land_update"]


@runtime_checkable
class StagesSlices(Protocol):
    """A ``KeepsTensors`` adapter that writes a slices bucket into its model itself, once the
    bucket arrived whole (module docstring)."""

    def refuse_slices(self, names: frozenset[str]) -> None:
        """Raise WeightwireError if these tensors cannot be written from slices now; nothing waits yet."""
        ...

    def write_kept(self, staged: Mapping[str, torch.Tensor]) -> None:
        """Copy ``staged`` (kept shapes, by name) into the model; returns once the copy finished."""
        ...


def fill_bucket(
    msg: pb.Bucket,
    importer: FillsModel,
    *,
    adapter: EngineAdapter,
    manifest: ShardManifest,
    own_device: DeviceRef,
    accept_names: Callable[[frozenset[str]], None],
    will_write: Callable[[], None],
    call_ended: threading.Event | None = None,
    ordinal: int = 0,
) -> tuple[pb.BucketAck, frozenset[str], list[Callable[[], None]]]:
    """Check the bucket, have ``importer`` receive it, return the ack (every byte arrived whole),
    the names it filled (``accept_names`` took them) and what writes the bytes held back into the
    model, for the update to run when it commits (module docstring). Once ``call_ended`` is set
    (the update's call was cancelled or passed its deadline) every wait of the receive stops:
    CANCELLED. ``ordinal``: the bucket's place among the update's filled buckets."""
    if msg.tensors or len(msg.payloads) != 1:
        raise WeightwireError(
            Reason.MALFORMED_STREAM,
            f"bucket {msg.index}: a bucket filled straight into the model carries no tensor specs and exactly "
            f"one payload (it has {len(msg.tensors)} specs, {len(msg.payloads)} payloads)",
            bucket=str(msg.index),
        )
    sel = select_own_payload(msg.payloads, own_device)
    if not has_capability(adapter, KeepsTensors):
        raise WeightwireError(
            Reason.TRANSPORT_UNAVAILABLE,
            "this worker does not receive slices (its manifest has receives_slices false): its engine adapter "
            "does not expose the tensors it keeps; push from one trainer rank instead",
            transport=importer.field_name,
        )
    plan = importer.plan_fill(sel.payload, manifest)
    # No name twice in the update, a bounded count (``Accepted.take_names``), before anything waits.
    accept_names(plan.names)
    kept = cast(KeepsTensors, adapter).kept_tensors()
    stager = cast(StagesSlices, adapter) if has_capability(adapter, StagesSlices) else None
    into: Mapping[str, torch.Tensor] = kept
    # A stager's delta bucket: the checked region deltas, handed to its own delta path at the commit.
    changes: list[RegionChange] | None = None
    if stager is not None and carries_region_deltas(sel.payload):
        if not (has_capability(adapter, AppliesDeltas) and has_capability(adapter, RefusesDeltas)):
            # Its staging holds the bucket's bytes, not the model's: there is no base to apply to.
            raise delta_error(
                DELTA_BASE_MISMATCH,
                f"bucket {msg.index}: this engine adapter writes slices through its own staging and applies no "
                "delta to regions; send the update whole",
                bucket=str(msg.index),
                applies_deltas="false",
            )
        cast(RefusesDeltas, adapter).refuse_deltas(plan.names)
        changes = []
    if stager is not None:
        stager.refuse_slices(plan.names)
    if stager is not None and changes is None:
        # Held until the commit where the bytes arrive: host memory over gloo, even for a model
        # on a GPU (no GPU memory beyond the model's own), the GPU over NCCL.
        into = {n: importer.stage(n, kept[n]) for n in plan.names}
    t0 = time.perf_counter_ns()
    landings: list[Callable[[], None]] = []
    try:
        # A plan refused by the group (GROUP_PLAN_MISMATCH) wrote nothing: the worker keeps its state.
        received = importer.fill(
            sel.payload,
            plan,
            # Staging is not the model: a stager's bucket lands in it once arrived whole, which
            # frees the receiving process's segments for the next bucket.
            FillTarget(
                into,
                manifest,
                will_write if stager is None else _nothing,
                call_ended,
                landings if stager is None else None,
                ordinal,
                changes,
            ),
        )
        if any(into[n].is_cuda for n in plan.names):
            # NCCL receives complete on the stream; the ack promises every byte arrived.
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
        tensors_loaded=len(plan.names),
        bytes_loaded=received,
        bytes_received=received,
        transport=importer.transport,
        load_duration_ns=time.perf_counter_ns() - t0,
    )
    ack.source_device.CopyFrom(sel.device.to_proto())
    cuda = any(kept[n].is_cuda for n in plan.names)
    if changes is not None:
        landings.append(StagedDeltas(cast(AppliesDeltas, adapter), changes, manifest, will_write))
    elif stager is not None:
        landings.append(StagedWrite(cast(StagesSlices, stager), into, will_write, cuda))
    elif cuda:
        landings.append(torch.cuda.synchronize)  # the commit's result promises the bytes are in the model
    return ack, plan.names, landings


@dataclasses.dataclass(frozen=True)
class StagedWrite:
    """A stager's bucket, held in ``staged`` until the commit (``land_update`` writes every such
    bucket of the update in one ``write_kept``)."""

    stager: StagesSlices
    staged: Mapping[str, torch.Tensor]
    will_write: Callable[[], None]
    cuda: bool

    def __call__(self) -> None:
        _write([self])


def _write(writes: Sequence[StagedWrite]) -> None:
    merged: dict[str, torch.Tensor] = {}
    for w in writes:
        merged.update(w.staged)
    writes[0].will_write()
    writes[0].stager.write_kept(merged)
    if any(w.cuda for w in writes):
        torch.cuda.synchronize()  # the commit's result promises the bytes are in the model


def _nothing() -> None:
    """Staged bytes are not in the model yet: the write is announced just before ``write_kept``."""


def land_update(landings: Sequence[tuple[int, Sequence[Callable[[], None]]]]) -> None:
    """Write what ``fill_bucket`` held back of every bucket of the update into the model (the
    update commits), bucket by bucket; a stager's buckets in one ``write_kept`` (the engine writes
    an update's tensors together, as a vLLM layer whose tensors came in two buckets needs), its
    delta buckets in one ``apply_deltas`` (``staged_deltas.apply_staged``).
    LOAD_FAILED if the engine raised (the model may then be half-written: the caller counts it as
    written)."""
    staged = [step for _, steps in landings for step in steps if isinstance(step, StagedWrite)]
    deltas = [step for _, steps in landings for step in steps if isinstance(step, StagedDeltas)]
    what = "bucket" + ("s " if len(landings) > 1 else " ") + ", ".join(str(i) for i, _ in landings[:8])
    try:
        for _, steps in landings:
            for step in steps:
                if not isinstance(step, StagedWrite | StagedDeltas):
                    step()
        if staged:
            _write(staged)
        if deltas:
            apply_staged(deltas)
    except WeightwireError:
        raise
    except Exception as e:
        raise WeightwireError(
            Reason.LOAD_FAILED, f"writing the slices of {what} into the model failed: {e!r}"
        ) from e
