"""From each entry point's input to the jobs of one update: the planning checks the input needs,
then one ``Job`` per bucket that some worker must receive.

``tensor_jobs`` (``push``: named tensors, packed into staging buffers), ``flat_jobs`` (``push_flat``:
already-flat buffers, exported in place when the transport can) and ``gathered_jobs``
(``push_gathered``: buckets with several labelled payloads). Each raises ``PlanError`` before anything
is sent; ``weightwire.client.push.pusher`` hands the jobs to an ``UpdateSession``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Hashable, Mapping, Sequence

import torch
from weightwire.client.push import plan as planning
from weightwire.client.push.options import PushOptions
from weightwire.client.push.plan import PlanError, TensorSpec
from weightwire.client.push.routing import (
    CheckedLayouts,
    check_labels,
    check_transport_limit,
    flat_bytes,
    label_str,
    recipients_of,
)
from weightwire.client.push.staging import Job, Staging, StagingPool, flat_exporter_job, gathered_job, packer
from weightwire.client.push.types import FlatBucket, GatheredBucket
from weightwire.client.ranks.dtensor_gather import target_dtype
from weightwire.client.transports import exporter as exp
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb


@dataclasses.dataclass
class Jobs:
    """The jobs of one update and every staging pool they draw from (woken when the update fails)."""

    jobs: list[Job]
    pools: list[StagingPool]


@dataclasses.dataclass(frozen=True)
class _TensorPlan:
    """What ``tensor_jobs`` concluded for one push's names, dtypes and shapes: the names no worker
    owns (allowed by ``allow_unowned``) and the bucket plans. ``manifests`` holds the manifest
    objects the key names by id, so no other object can take their ids while the entry lives."""

    manifests: tuple[ShardManifest, ...]
    unknown: frozenset[str]
    plans: tuple[planning.BucketPlan, ...]


class TensorPlans:
    """``push`` plans that already passed the planning checks, by what they depend on.

    A trainer pushes the same names, dtypes and shapes every update against the same (frozen)
    manifest objects: the name, dtype, shape and coverage checks and the bucket plan give the same
    answer again, and reusing the plan's ``TensorSpec`` objects lets each bucket's spec message be
    reused too (``session.SpecTemplates``). Building the key (one tuple per tensor) costs a fifth
    of the checks it skips on 399 tensors. Only successes are kept; new manifests (a re-read after
    a restart) are new objects and so a miss.
    """

    _MAX_ENTRIES = 16

    def __init__(self) -> None:
        self._entries: dict[Hashable, _TensorPlan] = {}

    @staticmethod
    def key(
        items: Sequence[tuple[str, torch.Tensor]],
        manifests: Mapping[str, ShardManifest],
        options: PushOptions,
        bucket_bytes: int,
        align_bytes: int,
    ) -> Hashable:
        cast = options.cast_to
        cast_key = tuple(sorted(cast.items(), key=str)) if isinstance(cast, Mapping) else cast
        return (
            tuple([(name, t.dtype, t.shape) for name, t in items]),
            tuple([(a, id(m)) for a, m in manifests.items()]),
            options.scope,
            options.allow_unowned,
            cast_key,
            bucket_bytes,
            align_bytes,
        )

    def get(self, key: Hashable) -> _TensorPlan | None:
        return self._entries.get(key)

    def put(self, key: Hashable, plan: _TensorPlan) -> None:
        if len(self._entries) >= self._MAX_ENTRIES:
            self._entries.clear()
        self._entries[key] = plan


# One plan cache per pusher, kept with its staging (which lives exactly as long as the pusher).
_PLANS: weakref.WeakKeyDictionary[Staging, TensorPlans] = weakref.WeakKeyDictionary()


def tensor_jobs(
    items: Sequence[tuple[str, torch.Tensor]],
    manifests: Mapping[str, ShardManifest],
    exporter: exp.Exporter,
    staging: Staging,
    options: PushOptions,
    align_bytes: int,
) -> Jobs:
    """Named tensors packed into buckets of at most the pusher's bucket size (inline: under the
    message limit), each sent to the workers that own something in it."""
    bucket_bytes = staging.bucket_size_bytes
    if exporter.bucket_bytes_limit is not None:
        bucket_bytes = min(bucket_bytes, exporter.bucket_bytes_limit)
    cache = _PLANS.setdefault(staging, TensorPlans())
    key = cache.key(items, manifests, options, bucket_bytes, align_bytes)
    known = cache.get(key)
    if known is None:
        # With ``cast_to`` a spec carries the dtype sent; packing converts while it copies.
        specs = [TensorSpec(name, target_dtype(t.dtype, options.cast_to), tuple(t.shape)) for name, t in items]
        unknown = frozenset(planning.check_update(specs, manifests, scope=options.scope, allow_unowned=options.allow_unowned))
    else:
        unknown = known.unknown
    check_labels(manifests, [exporter.label] if exporter.label else None, "every bucket")
    if known is None:
        owners = planning.owners_by_name(manifests)
        plans = tuple(planning.plan_buckets(
            [s for s in specs if s.name not in unknown], owners, bucket_bytes=bucket_bytes, align_bytes=align_bytes
        ))
        cache.put(key, _TensorPlan(tuple(manifests.values()), unknown, plans))
    else:
        plans = known.plans
    # plan_buckets indexes the filtered list; map back to the tensors.
    kept = [t for (name, t) in items if name not in unknown]
    check_transport_limit(exporter, [p.size_bytes for p in plans])
    pool = staging.pool(exporter, bucket_bytes)
    jobs = [
        Job(list(p.specs), p.recipients, p.size_bytes, packer(pool, exporter, p, [kept[i] for i in p.items], options.verify_checksums))
        for p in plans
    ]
    return Jobs(jobs, [pool])


def flat_jobs(
    buckets: Sequence[FlatBucket],
    manifests: Mapping[str, ShardManifest],
    exporter: exp.Exporter,
    staging: Staging,
    options: PushOptions,
    checked: CheckedLayouts,
) -> Jobs:
    """One job per flat buffer that some worker owns something in; the planning checks are skipped
    for the exact layouts ``checked`` already passed."""
    # Byte sizes as ``flat_bytes`` sees them; the name checks run first so their errors win over its.
    sizes = [b.buffer.numel() * b.buffer.element_size() for b in buckets]
    checked_key = checked.key(buckets, sizes, manifests, options.scope, options.allow_unowned)
    routed = checked.get(checked_key)
    if routed is None:
        all_specs = [s for b in buckets for s in b.specs]
        planning.check_update(all_specs, manifests, scope=options.scope, allow_unowned=options.allow_unowned)
    check_labels(manifests, [exporter.label] if exporter.label else None, "every bucket")
    flats = [flat_bytes(b.buffer, f"flat bucket {i}") for i, b in enumerate(buckets)]
    if routed is None:
        owners = planning.owners_by_name(manifests)
        for i, (b, size) in enumerate(zip(buckets, sizes, strict=True)):
            planning.check_flat_specs(b.specs, size, f"flat bucket {i}")
        routed = [recipients_of(b.specs, owners, manifests) for b in buckets]
        checked.put(checked_key, buckets, manifests, routed)
    check_transport_limit(exporter, sizes)
    pool = staging.pool(exporter)
    jobs = [
        Job(list(b.specs), recipients, flat.numel(), flat_exporter_job(pool, exporter, flat, list(b.specs), options.verify_checksums))
        for b, flat, recipients in zip(buckets, flats, routed, strict=True)
        if recipients
    ]
    return Jobs(jobs, [pool])


def gathered_jobs(
    buckets: Sequence[GatheredBucket],
    manifests: Mapping[str, ShardManifest],
    staging: Staging,
    options: PushOptions,
) -> Jobs:
    """One job per gathered bucket that some worker owns something in, carrying every payload of
    the bucket (the caller's, and the local buffers exported here with this process's labels)."""
    planning.check_update([s for b in buckets for s in b.specs], manifests, scope=options.scope, allow_unowned=options.allow_unowned)
    owners = planning.owners_by_name(manifests)
    out = Jobs([], [])
    for i, b in enumerate(buckets):
        where = f"gathered bucket {i}"
        size = b.size_bytes if b.size_bytes is not None else max((s.offset_bytes + s.nbytes for s in b.specs), default=0)
        planning.check_flat_specs(b.specs, size, where)
        recipients = recipients_of(b.specs, owners, manifests)
        fixed: list[pb.Payload] = []
        local: list[tuple[exp.Exporter, torch.Tensor]] = []
        labels: list[DeviceRef] = []
        for p in b.payloads:
            if isinstance(p, pb.Payload):
                if p.size_bytes < size:
                    raise PlanError(Reason.INVALID_SIZE, f"{where}: a payload labelled {label_str(p)} holds {p.size_bytes} bytes, the layout needs {size}")
                fixed.append(p)
                labels.append(DeviceRef(p.device.kind, p.device.uuid))
            else:
                flat = flat_bytes(p, where)
                if flat.numel() < size:
                    raise PlanError(Reason.INVALID_SIZE, f"{where}: a local buffer holds {flat.numel()} bytes, the layout needs {size}")
                exporter = staging.local_exporter(flat.device)
                if exporter.label is None:
                    raise PlanError(Reason.PAYLOAD_LABEL_MISSING, f"{where}: transport {exporter.name} cannot label a local payload")
                local.append((exporter, flat))
                labels.append(exporter.label)
        dupes = {str(lb) for lb in labels if labels.count(lb) > 1}
        if dupes:
            raise PlanError(Reason.DUPLICATE_PAYLOAD_LABEL, f"{where}: more than one payload labelled {', '.join(sorted(dupes))}")
        if options.precheck_labels and recipients:
            check_labels({w: manifests[w] for w in recipients}, labels, where, options.allow_peer_device_import)
        if not recipients:
            continue
        job_pools = [staging.pool(e) for e, _ in local]
        out.pools.extend(job_pools)
        out.jobs.append(
            Job(list(b.specs), recipients, size, gathered_job(fixed, list(zip(job_pools, local, strict=True)), size, options.verify_checksums))
        )
    return out
