"""From each entry point's input to the jobs of one update: the planning checks the input needs,
then one ``Job`` per bucket that some worker must receive.

``tensor_jobs`` (``push``: named tensors; a trainer's own CUDA tensors exported where they live when
every worker reads such payloads, else packed into staging buffers), ``flat_jobs`` (``push_flat``:
already-flat buffers, exported in place when the transport can) and ``gathered_jobs``
(``push_gathered``: buckets with several labelled payloads). Each raises ``PlanError`` before anything
is sent; ``weightwire.client.push.pusher`` hands the jobs to an ``UpdateSession``.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Hashable, Mapping, Sequence
from typing import Literal

import torch
from weightwire.client.inputs import plan as planning
from weightwire.client.inputs.dtensor_gather import target_dtype
from weightwire.client.inputs.plan import PlanError, TensorSpec
from weightwire.client.inputs.types import FlatBucket, GatheredBucket
from weightwire.client.transports import exporter as exp
from weightwire.client.transports.route import Job
from weightwire.client.update.options import PushOptions
from weightwire.client.update.routing import (
    CheckedLayouts,
    check_labels,
    check_transport_limit,
    flat_bytes,
    label_str,
    recipients_of,
)
from weightwire.client.update.staging import (
    Staging,
    StagingPool,
    flat_exporter_job,
    gathered_job,
    in_place_job,
    packer,
)
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports import table as transport_table
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
        rows: tuple[tuple[str, torch.dtype, torch.Size], ...] | None = None,
    ) -> Hashable:
        """``rows``: each tensor's (name, dtype, shape), when a ``TensorScan`` read them."""
        cast = options.cast_to
        cast_key = tuple(sorted(cast.items(), key=str)) if isinstance(cast, Mapping) else cast
        return (
            rows if rows is not None else tuple([(name, t.dtype, t.shape) for name, t in items]),
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


# The bucket size that puts every tensor of one recipient group into one bucket: tensors exported
# where they live take no staging memory, so one payload per group is what costs least.
_ONE_BUCKET = 1 << 62


def exports_in_place(
    items: Sequence[tuple[str, torch.Tensor]],
    manifests: Mapping[str, ShardManifest],
    exporter: exp.Exporter,
    options: PushOptions,
) -> exp.TensorScan | None:
    """Whether ``push`` sends ``items`` where they live (no packing copy): CUDA tensors on the
    exporter's GPU, dense, sent unconverted and unchecksummed, to workers that all read payloads of
    several storages (``ShardManifest.imports_cuda_ipc_storages``); then the one pass over them that
    the rest of the push reads (``Exporter.scan_tensors``), else None (they are packed)."""
    if options.verify_checksums or not manifests:
        return None
    if not all(m.imports_cuda_ipc_storages for m in manifests.values()):
        return None
    if options.cast_to is not None and any(
        target_dtype(t.dtype, options.cast_to) != t.dtype for _, t in items
    ):
        return None
    return exporter.scan_tensors(items)


def _packing_bucket_bytes(
    items: Sequence[tuple[str, torch.Tensor]], exporter: exp.Exporter, staging: Staging, align_bytes: int
) -> int:
    bucket_bytes = staging.bucket_size_bytes
    if not staging.bucket_size_given and exporter.TRANSPORT is transport_table.CUDA_IPC:
        # Large GPU buckets, but never staging larger than the update itself.
        total = sum(t.nbytes for _, t in items) + align_bytes * len(items)
        bucket_bytes = max(
            1, min(planning.DEFAULT_CUDA_BUCKET_BYTES, planning.align_up(total, 2 * 1024 * 1024))
        )
    if exporter.bucket_bytes_limit is not None:
        bucket_bytes = min(bucket_bytes, exporter.bucket_bytes_limit)
    return bucket_bytes


def tensor_jobs(
    items: Sequence[tuple[str, torch.Tensor]],
    manifests: Mapping[str, ShardManifest],
    exporter: exp.Exporter,
    staging: Staging,
    options: PushOptions,
    align_bytes: int,
    in_place: exp.TensorScan | Literal[False] | None = None,
) -> Jobs:
    """Named tensors, each bucket sent to the workers that own something in it: exported where they
    live (``exports_in_place``, or its scan in ``in_place``; one bucket per group of recipients),
    else (``in_place`` False) packed into buckets of at most the pusher's bucket size (inline: under
    the message limit; GPU staging with no size given: ``plan.DEFAULT_CUDA_BUCKET_BYTES``)."""
    if in_place is None:
        in_place = exports_in_place(items, manifests, exporter, options) or False
    if in_place:
        jobs = _in_place_jobs(items, manifests, exporter, staging, options, align_bytes, in_place)
        if jobs is not None:
            return jobs
    return _packed_jobs(
        items,
        manifests,
        exporter,
        staging,
        options,
        align_bytes,
        _packing_bucket_bytes(items, exporter, staging, align_bytes),
    )


def _in_place_jobs(
    items: Sequence[tuple[str, torch.Tensor]],
    manifests: Mapping[str, ShardManifest],
    exporter: exp.Exporter,
    staging: Staging,
    options: PushOptions,
    align_bytes: int,
    scan: exp.TensorScan,
) -> Jobs | None:
    """One job per recipient group with its tensors exported where they live, or None when some
    storage cannot be shared (then everything is packed). Each tensor's storage and offset come
    from ``scan``, the push's one pass over its tensors."""
    plans, kept = _checked_plans(
        items, manifests, exporter, staging, options, _ONE_BUCKET, align_bytes, scan=scan
    )
    # In a FULL update where each worker gets one bucket (one per pipeline stage, say), that bucket
    # lists every storage its workers should keep: they close the rest.
    counts = collections.Counter(w for p in plans for w in p.recipients)
    complete = options.scope == pb.UPDATE_SCOPE_FULL and all(n == 1 for n in counts.values())
    # ``kept`` is the scan's own list when every tensor is owned: then its places index alike.
    scanned = kept is scan.tensors
    jobs: list[Job] = []
    for p in plans:
        places: tuple[Sequence[torch.UntypedStorage], Sequence[int | torch.SymInt]] | None = None
        if scanned and len(p.items) == len(kept):
            # One bucket of every tensor, in input order (plan_buckets keeps it within a group).
            tensors: list[torch.Tensor] = kept
            places = (scan.storages, scan.offsets)
        else:
            tensors = [kept[i] for i in p.items]
            if scanned:
                places = ([scan.storages[i] for i in p.items], [scan.offsets[i] for i in p.items])
        exported = exporter.export_tensors(tensors, p.recipients, places)
        if exported is None:
            return None
        memo = exported.specs_memo.get(id(p))
        if memo is None or memo[0] is not p:
            # The same TensorSpec objects every update, so each bucket's spec message is reused.
            specs = [dataclasses.replace(s, offset_bytes=exported.offsets[j]) for j, s in enumerate(p.specs)]
            memo = (p, specs, sum(s.nbytes for s in p.specs))
            exported.specs_memo[id(p)] = memo
        jobs.append(Job(memo[1], p.recipients, memo[2], in_place_job(exporter, exported, complete, tensors)))
    return Jobs(jobs, [])


def _checked_plans(
    items: Sequence[tuple[str, torch.Tensor]],
    manifests: Mapping[str, ShardManifest],
    exporter: exp.Exporter,
    staging: Staging,
    options: PushOptions,
    bucket_bytes: int,
    align_bytes: int,
    scan: exp.TensorScan | None = None,
) -> tuple[tuple[planning.BucketPlan, ...], list[torch.Tensor]]:
    """The planning checks and bucket plans of ``items`` (kept per pusher), and the tensors the
    plans' ``items`` index (those some worker owns: ``scan.tensors`` itself when that is all)."""
    cache = _PLANS.setdefault(staging, TensorPlans())
    key = cache.key(
        items, manifests, options, bucket_bytes, align_bytes, scan.rows if scan is not None else None
    )
    known = cache.get(key)
    if known is None:
        # With ``cast_to`` a spec carries the dtype sent; packing converts while it copies.
        specs = [
            TensorSpec(name, target_dtype(t.dtype, options.cast_to), tuple(t.shape)) for name, t in items
        ]
        unknown = frozenset(
            planning.check_update(specs, manifests, scope=options.scope, allow_unowned=options.allow_unowned)
        )
    else:
        unknown = known.unknown
    check_labels(manifests, [exporter.label] if exporter.label else None, "every bucket")
    if known is None:
        owners = planning.owners_by_name(manifests)
        plans = tuple(
            planning.plan_buckets(
                [s for s in specs if s.name not in unknown],
                owners,
                bucket_bytes=bucket_bytes,
                align_bytes=align_bytes,
            )
        )
        cache.put(key, _TensorPlan(tuple(manifests.values()), unknown, plans))
    else:
        plans = known.plans
    # plan_buckets indexes the filtered list; map back to the tensors.
    if unknown:
        kept = [t for (name, t) in items if name not in unknown]
    else:
        kept = scan.tensors if scan is not None else [t for _, t in items]
    return plans, kept


def _packed_jobs(
    items: Sequence[tuple[str, torch.Tensor]],
    manifests: Mapping[str, ShardManifest],
    exporter: exp.Exporter,
    staging: Staging,
    options: PushOptions,
    align_bytes: int,
    bucket_bytes: int,
) -> Jobs:
    plans, kept = _checked_plans(items, manifests, exporter, staging, options, bucket_bytes, align_bytes)
    check_transport_limit(exporter, [p.size_bytes for p in plans])
    pool = staging.pool(exporter, bucket_bytes)
    jobs = [
        Job(
            list(p.specs),
            p.recipients,
            p.size_bytes,
            packer(pool, exporter, p, [kept[i] for i in p.items], options.verify_checksums),
        )
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
        Job(
            list(b.specs),
            recipients,
            flat.numel(),
            flat_exporter_job(pool, exporter, flat, list(b.specs), options.verify_checksums),
        )
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
    planning.check_update(
        [s for b in buckets for s in b.specs],
        manifests,
        scope=options.scope,
        allow_unowned=options.allow_unowned,
    )
    owners = planning.owners_by_name(manifests)
    out = Jobs([], [])
    for i, b in enumerate(buckets):
        where = f"gathered bucket {i}"
        size = (
            b.size_bytes
            if b.size_bytes is not None
            else max((s.offset_bytes + s.nbytes for s in b.specs), default=0)
        )
        planning.check_flat_specs(b.specs, size, where)
        recipients = recipients_of(b.specs, owners, manifests)
        fixed: list[pb.Payload] = []
        local: list[tuple[exp.Exporter, torch.Tensor]] = []
        labels: list[DeviceRef] = []
        for p in b.payloads:
            if isinstance(p, pb.Payload):
                if p.size_bytes < size:
                    raise PlanError(
                        Reason.INVALID_SIZE,
                        f"{where}: a payload labelled {label_str(p)} holds {p.size_bytes} bytes, the layout needs {size}",
                    )
                fixed.append(p)
                labels.append(DeviceRef(p.device.kind, p.device.uuid))
            else:
                flat = flat_bytes(p, where)
                if flat.numel() < size:
                    raise PlanError(
                        Reason.INVALID_SIZE,
                        f"{where}: a local buffer holds {flat.numel()} bytes, the layout needs {size}",
                    )
                exporter = staging.local_exporter(flat.device)
                if exporter.label is None:
                    raise PlanError(
                        Reason.PAYLOAD_LABEL_MISSING,
                        f"{where}: transport {exporter.name} cannot label a local payload",
                    )
                local.append((exporter, flat))
                labels.append(exporter.label)
        dupes = {str(lb) for lb in labels if labels.count(lb) > 1}
        if dupes:
            raise PlanError(
                Reason.DUPLICATE_PAYLOAD_LABEL,
                f"{where}: more than one payload labelled {', '.join(sorted(dupes))}",
            )
        if options.precheck_labels and recipients:
            check_labels(
                {w: manifests[w] for w in recipients}, labels, where, options.allow_peer_device_import
            )
        if not recipients:
            continue
        job_pools = [staging.pool(e) for e, _ in local]
        out.pools.extend(job_pools)
        out.jobs.append(
            Job(
                list(b.specs),
                recipients,
                size,
                gathered_job(fixed, list(zip(job_pools, local, strict=True)), size, options.verify_checksums),
            )
        )
    return out
