"""Pure routing checks of the client: which workers get a bucket, and what must hold before anything
is sent (scope, flat buffers, transport limits, payload labels against the workers' devices).

No gRPC, no I/O; ``weightwire.client.push.pusher`` calls these while it builds an update's jobs. The
manifest-level checks (names, dtypes, shapes, FULL coverage) and bucket layout live in
``weightwire.client.inputs.plan``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from weightwire.client.inputs import plan as planning
from weightwire.client.inputs.dtensor_gather import is_dtensor
from weightwire.client.inputs.plan import PlanError, TensorSpec
from weightwire.client.inputs.types import FlatBucket
from weightwire.client.transports import exporter as exp
from weightwire.core.devices import DeviceRef, is_own_device
from weightwire.core.errors import Reason
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb


def label_str(p: pb.Payload) -> str:
    return str(DeviceRef(p.device.kind, p.device.uuid)) if p.device.kind else "(no label)"


def flat_bytes(t: torch.Tensor, where: str) -> torch.Tensor:
    if is_dtensor(t):
        raise PlanError(
            Reason.SHARDED_BUFFER,
            f"{where}: the flat buffer is a DTensor (each rank holds a shard); push_flat, push_gathered and "
            "export_payload take local flat buffers. Pass DTensors (an FSDP2 state_dict() or named_parameters()) "
            "to push() on every rank: it gathers them one bucket at a time",
        )
    if not t.is_contiguous():
        raise PlanError(Reason.BUFFER_NOT_CONTIGUOUS, f"{where}: the flat buffer must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def recipients_of(
    specs: Sequence[TensorSpec], owners: Mapping[str, Sequence[str]], manifests: Mapping[str, ShardManifest]
) -> tuple[str, ...]:
    wanted = {w for s in specs for w in owners.get(s.name, ())}
    return tuple(a for a in manifests if a in wanted)


def check_transport_limit(exporter: exp.Exporter, sizes: Iterable[int]) -> None:
    limit = exporter.max_bucket_bytes
    if limit is None:
        return
    biggest = max(sizes, default=0)
    if biggest > limit:
        raise PlanError(
            Reason.INVALID_SIZE,
            f"a bucket of {biggest} bytes does not fit transport {exporter.name} (at most {limit} bytes per "
            "message); use host shared memory or CUDA IPC for tensors this large",
        )


def route_own_device(
    manifests: dict[str, ShardManifest], exporter: exp.Exporter, only_own_device: bool
) -> dict[str, ShardManifest]:
    if not only_own_device or exporter.label is None:
        return manifests
    mine = {a: m for a, m in manifests.items() if is_own_device(exporter.label, m.device)}
    if not mine:
        raise PlanError(
            Reason.NO_PAYLOAD_FOR_DEVICE,
            f"no worker is on this process's device {exporter.label}; workers are on "
            + ", ".join(sorted({str(m.device) for m in manifests.values()})),
        )
    return mine


def check_labels(
    manifests: Mapping[str, ShardManifest],
    labels: Sequence[DeviceRef] | None,
    where: str,
    allow_peer: bool = False,
) -> None:
    if labels is None:  # inline: each worker's payload is labelled with its own device
        return
    bad = planning.device_mismatches(manifests, labels, manifests)
    if allow_peer:
        bad = {
            w: m
            for w, m in bad.items()
            if not (manifests[w].device.is_cuda and any(lb.is_cuda for lb in labels))
        }
    if bad:
        raise PlanError(
            Reason.NO_PAYLOAD_FOR_DEVICE,
            f"{where}: {len(bad)} worker(s) would get no payload for their own device (nothing was sent):\n  "
            + "\n  ".join(bad.values())
            + "\nGive each worker a payload from its own device (push_gathered), push from a process on "
            "that device, use transport='inline', or pass only_own_device=True to skip them.",
        )


def manifest_changes(
    statuses: Mapping[str, pb.GetStatusResponse],
    manifests: Mapping[str, ShardManifest],
    fingerprints: Mapping[str, str],
) -> dict[str, PlanError]:
    """The workers whose GetStatus shows another fingerprint or instance than the manifest the
    update was planned against (restarted, or changed layout), each with a ``MANIFEST_CHANGED``."""
    changed: dict[str, PlanError] = {}
    for a, planned in manifests.items():
        st = statuses[a]
        if st.manifest_fingerprint != fingerprints[a] or (
            planned.instance_id and st.instance_id != planned.instance_id
        ):
            changed[a] = PlanError(
                Reason.MANIFEST_CHANGED,
                f"worker {planned.worker_id or a} changed since its manifest was read (instance "
                f"{planned.instance_id or '?'} -> {st.instance_id or '?'}, fingerprint "
                f"{fingerprints[a][:12]} -> {st.manifest_fingerprint[:12]}): it restarted or "
                "changed layout. Nothing was sent; the next push re-reads the manifests (make it a FULL update).",
                worker=a,
            )
    return changed


class CheckedLayouts:
    """``push_flat`` layouts that already passed the client's planning checks, by object identity.

    A trainer pushing the same ``FlatBucket`` specs every update hands over the same immutable
    ``TensorSpec`` objects against the same (frozen) manifest objects each time; the name, dtype,
    shape, FULL-coverage and bounds checks of those exact objects, with the same scope, flags and
    buffer sizes, give the same answer again. Entries hold the objects, so while an entry lives no
    other object can have their ids. Only successes are kept; new manifests (a re-read after a
    restart) are new objects and so a miss.
    """

    _MAX_ENTRIES = 64

    def __init__(self) -> None:
        self._entries: dict[tuple[object, ...], tuple[list[object], list[tuple[str, ...]]]] = {}

    @staticmethod
    def key(
        buckets: Sequence[FlatBucket],
        sizes: Sequence[int],
        manifests: Mapping[str, ShardManifest],
        scope: int,
        allow_unowned: bool,
    ) -> tuple[object, ...]:
        return (
            scope,
            allow_unowned,
            tuple(sizes),
            tuple((a, id(m)) for a, m in manifests.items()),
            tuple(tuple(map(id, b.specs)) for b in buckets),
        )

    def get(self, key: tuple[object, ...]) -> list[tuple[str, ...]] | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def put(
        self,
        key: tuple[object, ...],
        buckets: Sequence[FlatBucket],
        manifests: Mapping[str, ShardManifest],
        recipients: list[tuple[str, ...]],
    ) -> None:
        if len(self._entries) >= self._MAX_ENTRIES:
            self._entries.clear()
        held: list[object] = [list(manifests.values()), *(list(b.specs) for b in buckets)]
        self._entries[key] = (held, recipients)
