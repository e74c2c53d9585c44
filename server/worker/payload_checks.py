"""The rules of one bucket's payloads against this worker's importers, before any is opened: every
payload's label and handle fields (``check_payloads``), the payload of this worker's own device
and its importer (``select_payload``), and the refusals of a bucket no importer here can load
(``refuse_unfilled``) or of deltas on a transport that carries tensors whole
(``check_delta_payloads``). ``Update`` (server/worker/update.py) applies them in its bucket order.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightwire.core.delta.errors import invalid_delta
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports import table as transports
from weightwire.server.rules.selection import Selection, payload_labels, select_own_payload
from weightwire.server.transports.importer import PayloadImporter, transport_name
from weightwire.server.worker.update_context import UpdateContext
from weightwire.v1 import weight_transfer_pb2 as pb


def check_payloads(ctx: UpdateContext, payloads: Sequence[pb.Payload]) -> None:
    """Each payload's label, whether its handle can live on the labelled device, and its handle
    fields (by the importer of its transport; a transport this worker has no importer for is
    refused only when it is the one selected)."""
    for payload, label in zip(payloads, payload_labels(payloads), strict=True):
        field = payload.WhichOneof("handle") or ""
        row = transports.by_field(field)
        if row is not None and row.label_kind is not None and label.kind != row.label_kind:
            raise WeightwireError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"a {transport_name(field)} handle cannot live on device {label}; label it with the device that holds it",
                transport=field,
            )
        importer = ctx.importers.get(field)
        if importer is not None:
            importer.check(payload)


def select_payload(
    ctx: UpdateContext, payloads: Sequence[pb.Payload], *, allow_peer: bool
) -> tuple[Selection, PayloadImporter]:
    """The payload of this worker's own device, and the importer for its handle."""
    sel = select_own_payload(
        payloads,
        ctx.own_device,
        allow_peer=allow_peer,
        host_device=ctx.host_device,
        **({"is_local_cuda": ctx.is_local_cuda} if ctx.is_local_cuda else {}),
    )
    field = sel.payload.WhichOneof("handle") or ""
    row = transports.by_field(field)
    importer = ctx.importers.get(field)
    if importer is None:
        unfit = row is not None and ctx.own_device.kind not in row.worker_kinds
        raise WeightwireError(
            Reason.TRANSPORT_UNAVAILABLE,
            f"this worker cannot import {transport_name(field)} payloads (no importer for {field!r}"
            f"{f'; a worker on {ctx.own_device} cannot' if unfit else ''})",
            transport=field,
        )
    return sel, importer


def refuse_unfilled(ctx: UpdateContext, payloads: Sequence[pb.Payload], *, allow_peer: bool) -> None:
    """Only an importer that fills the model takes a bucket without tensor specs; none here did.
    Owning nothing of it would ack it empty, and a PARTIAL update would commit bytes that never came."""
    # no importer for the transport: TRANSPORT_UNAVAILABLE from here
    _, importer = select_payload(ctx, payloads, allow_peer=allow_peer)
    raise WeightwireError(
        Reason.TRANSPORT_UNAVAILABLE,
        f"this worker cannot load this {transport_name(importer.field_name)} bucket: it carries no tensor "
        "specs, and no importer of this worker fills the model from it (its manifest says receives_slices false)",
        transport=importer.field_name,
    )


def check_delta_payloads(ctx: UpdateContext, index: int, payloads: Sequence[pb.Payload]) -> None:
    """A bucket with deltas is read into this worker's own memory before anything is written: bytes
    in the message, host shared memory, or a transfer group's staging buffer (one source; a slices
    handle is refused by ``delta_regions``). A transport that carries tensors whole (CUDA IPC: the
    worker copies from the trainer's memory) is refused before any payload is opened or received;
    which ones carry deltas is the transport table's ``carries_deltas``."""
    for payload in payloads:
        field = payload.WhichOneof("handle") or ""
        row = transports.by_field(field)
        if row is not None and row.carries_deltas:
            continue
        raise invalid_delta(
            f"bucket {index}: its tensor specs carry deltas but a payload is {transport_name(field)}; this "
            f"worker reads deltas only from {_delta_transports()}: send these tensors whole",
            bucket=str(index),
            transport=field,
        )


def _delta_transports() -> str:
    names = [t.human_name for t in transports.TRANSPORTS if t.carries_deltas]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)
