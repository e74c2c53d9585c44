"""The buckets of an update whose every trainer rank is a source, as rank 0's session sends them:
each worker's part of the transfer plan split into buckets of at most the pusher's bucket size
(``split_buckets``, kept per plan by ``split_for``), each bucket's slices payload
(``slices_payload``: the regions and who sends each, no tensor specs) and the session's jobs that
carry them, one route per worker and bucket, the last of which starts this rank's own sends
(``slice_jobs``). ``weightwire.client.ranks.slice_push`` runs the update around them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

from weightwire.client.ranks.transfer_group_sources import FormedSources, SourcesLink
from weightwire.client.transports.route import Job, PerWorkerRoute, Route
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.transfer_group_slices import DEFAULT_MAX_MESSAGE_BYTES, Buckets
from weightwire.core.transports.transfer_plan import TransferPlan
from weightwire.v1 import weight_transfer_pb2 as pb

if TYPE_CHECKING:
    from weightwire.client.ranks.slice_deltas import SliceDeltas

__all__ = ["slice_jobs", "slices_payload", "split_buckets", "split_for"]


def split_buckets(plan: TransferPlan, workers: Sequence[str], bucket_bytes: int) -> Buckets:
    """Each worker's part of ``plan`` as buckets of at most ``bucket_bytes`` (a tensor whose
    regions to the worker hold more goes alone in one): the tensors of each bucket, in plan order.
    Every region of a tensor goes in the same bucket, so each bucket tiles what the worker keeps of
    its tensors on its own (``check_slices``). A worker sent nothing gets one empty bucket."""
    out = []
    for w in workers:
        sizes: dict[str, int] = {}
        for t in plan.for_worker(w):
            sizes[t.tensor] = sizes.get(t.tensor, 0) + t.nbytes
        parts: list[list[str]] = [[]]
        size = 0
        for name, n in sizes.items():
            if parts[-1] and size + n > bucket_bytes:
                parts.append([])
                size = 0
            parts[-1].append(name)
            size += n
        out.append((w, tuple(frozenset(p) for p in parts)))
    return tuple(out)


def split_for(link: SourcesLink, plan: TransferPlan, workers: Sequence[str], bucket_bytes: int) -> Buckets:
    """``split_buckets`` of ``plan``, kept on ``link`` for the next update of the same plan."""
    key = ("split", plan.fingerprint, bucket_bytes, tuple(workers))
    split = link.plans.get(key)
    if split is None:
        split = split_buckets(plan, workers, bucket_bytes)
        link.remember_plan(key, split)
    return cast(Buckets, split)


def slices_payload(
    address: str,
    formed: FormedSources,
    plan: TransferPlan,
    manifest: ShardManifest,
    deltas: SliceDeltas | None = None,
    tensors: frozenset[str] | None = None,
) -> pb.Payload:
    """The payload of ``address``'s part of ``plan`` (of its bucket of ``tensors``, when given):
    the same message every update with the same plan and group (so the worker finds it checked
    already), and in a delta update each region's ``TensorDelta`` (``deltas.regions``)."""
    payload = pb.Payload()
    payload.device.CopyFrom(manifest.device.to_proto())
    h = payload.transfer_group
    h.group_id = formed.group_id
    h.mode = pb.TRANSFER_MODE_SLICES
    h.plan_fingerprint = plan.fingerprint
    h.max_message_bytes = DEFAULT_MAX_MESSAGE_BYTES
    size = 0
    for t in plan.for_worker(address):
        if tensors is not None and t.tensor not in tensors:
            continue
        s = h.slices.add(tensor=t.tensor, source_rank=t.source)
        if deltas is not None:
            s.delta.CopyFrom(deltas.regions[t])
        s.start.extend(a for a, _ in t.box)
        s.stop.extend(b for _, b in t.box)
        size += t.nbytes
    payload.size_bytes = size
    return payload


def slice_jobs(
    link: SourcesLink,
    formed: FormedSources,
    plan: TransferPlan,
    manifests: Mapping[str, ShardManifest],
    buckets: Buckets,
    bucket_bytes: int,
    deltas: SliceDeltas | None,
    start_sends: Callable[[], None],
) -> list[Job]:
    """Rank 0's session jobs: every worker's part of ``plan`` in the buckets ``buckets`` gives it
    (the workers' first buckets first, then their second ...; a worker it leaves out, or every
    worker of a delta update (``deltas``), gets its whole part as one bucket). The last job queued
    calls ``start_sends``."""
    sizes = deltas.sent_to if deltas is not None else plan.bytes_to()
    given = dict(buckets)
    split: dict[str, tuple[frozenset[str] | None, ...]] = {a: given.get(a, (None,)) for a in manifests}
    per_tensor: dict[tuple[str, str], int] = collections.Counter()
    if given:
        for t in plan.transfers:
            for d in t.destinations:
                per_tensor[d, t.tensor] += t.nbytes
    order = [
        (a, j, parts[j])
        for j in range(max(len(p) for p in split.values()))
        for a, parts in split.items()
        if j < len(parts)
    ]
    return [
        Job(
            [],
            (a,),
            sizes.get(a, 0) if names is None else sum(per_tensor[a, n] for n in names),
            _route(
                link,
                a,
                j,
                names,
                formed,
                plan,
                manifests[a],
                bucket_bytes,
                deltas,
                start_sends if i == len(order) - 1 else None,
            ),
        )
        for i, (a, j, names) in enumerate(order)
    ]


def _route(
    link: SourcesLink,
    address: str,
    index: int,
    names: frozenset[str] | None,
    formed: FormedSources,
    plan: TransferPlan,
    manifest: ShardManifest,
    bucket_bytes: int,
    deltas: SliceDeltas | None,
    on_queued: Callable[[], None] | None,
) -> Callable[[Callable[[], bool], float], Route]:
    """``address``'s bucket ``index`` (of the tensors ``names``; None: its whole part): its
    slices payload, kept on ``link`` for the next update unless it is a delta's; ``on_queued``
    runs once it is queued (the last one starts this rank's sends)."""

    def prepare(stopped: Callable[[], bool], deadline: float) -> Route:
        key = (formed.group_id, plan.fingerprint, address, index, bucket_bytes)
        payload = link.buckets.get(key) if deltas is None else None
        if deltas is not None:
            # New counts and checksums every update: built each time, never remembered.
            payload = slices_payload(address, formed, plan, manifest, deltas)
        elif payload is None:
            payload = slices_payload(address, formed, plan, manifest, tensors=names)
            link.remember_bucket(key, payload)
        return PerWorkerRoute({address: payload}, on_queued=on_queued)

    return prepare
