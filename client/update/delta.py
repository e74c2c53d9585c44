"""``WeightPusher.push(..., delta=True)``: send only what changed since the version every worker
committed, and fall back to a whole (FULL) update by itself whenever a delta cannot be trusted.

The pusher's ``BaseKeeper`` (``weightwire.core.delta.base_keeper``) holds one host copy of every
tensor the last push sent (a CUDA tensor's copy stays on its device while the copies there fit the
pusher's ``delta_device_budget_bytes``). A push goes as a delta only when

- the transport carries deltas (the transport table's ``carries_deltas``: inline bytes, host shared
  memory, a transfer group) and one trainer rank sends (no ``group``, no DTensors): otherwise FULL,
  ``delta_fallback`` TRANSPORT (colocated CUDA IPC copies at the device's limit anyway; every rank
  a source carries whole slices in this version);
- the keeper has a base (``NO_BASE`` otherwise: the first push, or the one after a failure);
- every recipient reports that base as its version and is CONSISTENT (``BASE_MISMATCH``
  otherwise: a restarted worker, another trainer's update). A worker whose status shows another
  manifest than the one read (it restarted) has its manifest read again first, so the FULL update
  reaches it (over a transfer group, in a group formed anew with it) instead of failing the push
  with MANIFEST_CHANGED.

The keeper's ``update_all`` casts, diffs, brings the base forward and computes the result
checksums (CRC-32C when every recipient's manifest lists it, else CRC-32) in one pass per host
tensor. A delta update's tensors are packed by ``pack_delta`` at 64-byte aligned offsets into flat buckets
(sizes from ``packed_size_bytes``), each with the result checksums of every part its recipients
keep (their manifests' pieces); a tensor without a base (new, or a new shape) goes whole in the same
update. Over a transfer group the byte ranges sent to a worker are the encodings (and whole
tensors) it owns, as for any bucket (``transfer_group_link``): only the encoded bytes cross the wire.
The keeper commits only after every worker committed and drops its base on any failure. A
worker refusing with ``DELTA_BASE_MISMATCH`` makes the push retry once as FULL (``BASE_MISMATCH``);
``DELTA_RESULT_MISMATCH`` is raised (the next push is FULL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from weightwire.client.inputs.dtensor_gather import CastTo, target_dtype
from weightwire.client.inputs.plan import TensorSpec
from weightwire.client.inputs.types import FlatBucket, PushResult
from weightwire.client.transports import exporter as exp
from weightwire.client.update import jobs as job_builders
from weightwire.client.update.options import PushOptions
from weightwire.client.update.routing import CheckedLayouts, manifest_changes
from weightwire.core.delta import BaseKeeper, pack_delta, packed_size_bytes, preferred_algorithm
from weightwire.core.delta.base_keeper import KeptUpdate, TensorUpdate
from weightwire.core.errors import PushError, Reason
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports import table as transports
from weightwire.v1 import weight_transfer_pb2 as pb

# The pusher (``weightwire.client.push.pusher.WeightPusher``) is typed loosely here: the update
# layer is imported by the push layer, never the other way round.
WeightPusher = Any

_ALIGN = 64
# Transports a delta update may use: the worker reads the encoded bytes into its own memory.
DELTA_TRANSPORTS = tuple(t.name for t in transports.TRANSPORTS if t.carries_deltas)

Items = list[tuple[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class DeltaSpec(TensorSpec):
    """A tensor sent as its changes: ``delta`` describes the encoding at ``offset_bytes``, whose
    bytes (``encoded_bytes``) are all the bucket holds of it."""

    delta: pb.TensorDelta = dataclasses.field(default_factory=pb.TensorDelta)
    encoded_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.encoded_bytes

    def to_proto(self, base_offset_bytes: int = 0) -> pb.TensorSpec:
        msg = super().to_proto(base_offset_bytes)
        delta = pb.TensorDelta()
        delta.CopyFrom(self.delta)
        delta.values_offset_bytes += base_offset_bytes
        msg.delta.CopyFrom(delta)
        return msg


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def fallback_name(value: pb.DeltaFallback.ValueType) -> str:
    return pb.DeltaFallback.Name(value).removeprefix("DELTA_FALLBACK_")


def transport_name(pusher: WeightPusher, manifests: Mapping[str, ShardManifest], source: torch.device) -> str:
    if pusher.transport != "auto":
        return pusher.transport
    return exp.choose_transport([m.device for m in manifests.values()], source)


def _cast(items: Items, cast_to: CastTo) -> Items:
    if cast_to is None:
        return items
    return [(n, t.detach().to(target_dtype(t.dtype, cast_to))) for n, t in items]


def _mark(
    results: dict[str, PushResult],
    encoding: str,
    fallback: pb.DeltaFallback.ValueType,
    sent: Mapping[str, int],
    refused: int = 0,
) -> dict[str, PushResult]:
    return {
        a: dataclasses.replace(
            r,
            encoding=encoding,
            delta_fallback=fallback_name(fallback),
            delta_refused=refused,
            encoded_bytes=sent.get(a, 0),
        )
        for a, r in results.items()
    }


def _sent_whole(items: Items, manifests: Mapping[str, ShardManifest]) -> dict[str, int]:
    return {a: sum(t.nbytes for n, t in items if n in m.tensors) for a, m in manifests.items()}


def push_delta(
    pusher: WeightPusher, items: Items, options: PushOptions, *, ranked: bool, source: torch.device
) -> dict[str, PushResult]:
    """One push asked for as a delta (see the module docstring); one result per worker."""
    keeper = pusher.delta_keeper
    manifests = pusher.manifests()
    name = transport_name(pusher, manifests, source)
    if ranked or name not in DELTA_TRANSPORTS:
        keeper.drop()
        return _full(pusher, items, options, pb.DELTA_FALLBACK_TRANSPORT, keep=False)
    # A delta casts each tensor chunk by chunk as it compares it (BaseKeeper.update_all); a whole
    # update is cast first, as the keeper records what it sends.
    cast_to = options.cast_to
    options = dataclasses.replace(options, cast_to=None)
    base = keeper.base_version
    if base is None:
        return _full(pusher, _cast(items, cast_to), options, pb.DELTA_FALLBACK_NO_BASE)
    statuses = pusher.status()
    if any(s.weights_version != base or s.state != pb.WORKER_STATE_CONSISTENT for s in statuses.values()):
        keeper.drop()
        if manifest_changes(statuses, manifests, pusher._fingerprints):
            # A restarted worker: the whole update is planned on what it serves now.
            pusher.manifests(refresh=True)
        return _full(pusher, _cast(items, cast_to), options, pb.DELTA_FALLBACK_BASE_MISMATCH)
    try:
        return _send_delta(pusher, keeper, items, options, manifests, base, name, cast_to=cast_to)
    except PushError as e:
        keeper.drop()
        refused = sum(err.kind is Reason.DELTA_BASE_MISMATCH for err in e.failures.values())
        if refused:
            return _full(
                pusher, _cast(items, cast_to), options, pb.DELTA_FALLBACK_BASE_MISMATCH, refused=refused
            )
        raise
    except BaseException:
        keeper.drop()
        raise


def _full(
    pusher: WeightPusher,
    items: Items,
    options: PushOptions,
    fallback: pb.DeltaFallback.ValueType,
    *,
    keep: bool = True,
    refused: int = 0,
) -> dict[str, PushResult]:
    """The update whole, its header saying why; with ``keep`` it becomes the keeper's new base."""
    keeper = pusher.delta_keeper
    options = dataclasses.replace(options, delta_fallback=fallback)
    if keep:
        keeper.begin(options.version)
        try:
            for n, t in items:
                keeper.record(n, t)
        except BaseException:
            keeper.drop()
            raise
    try:
        results = pusher._push_items(items, options)
    except BaseException:
        if keep:
            keeper.drop()
        raise
    if keep:
        keeper.commit(options.version)
    return _mark(results, "FULL", fallback, _sent_whole(items, pusher.manifests()), refused)


def _parts(name: str, manifests: Mapping[str, ShardManifest]) -> list[tuple[int, int, int] | None]:
    parts: list[tuple[int, int, int] | None] = []
    for m in manifests.values():
        owned = m.tensors.get(name)
        if owned is None:
            continue
        if not owned.pieces:
            parts.append(None)
        parts.extend((p.dim, p.offset, p.length) for p in owned.pieces)
    return parts


def by_owners(
    entries: Sequence[KeptUpdate], manifests: Mapping[str, ShardManifest]
) -> list[list[KeptUpdate]]:
    """The entries grouped by the workers that own them, each group in input order, as a FULL
    push's buckets are (``plan.plan_buckets``): a pipeline stage's bucket goes only to its workers,
    and over a transfer group the workers that own the same tensors share one broadcast."""
    groups: dict[tuple[str, ...], list[KeptUpdate]] = {}
    for e in entries:
        owners = tuple(a for a, m in manifests.items() if e.name in m.tensors)
        groups.setdefault(owners, []).append(e)
    return list(groups.values())


def pack_buckets(entries: Sequence[KeptUpdate], limit: int) -> list[FlatBucket]:
    """The entries packed in order into flat buckets of at most ``limit`` bytes (one larger entry
    goes alone)."""
    layout: list[list[tuple[KeptUpdate, int, int]]] = [[]]
    end = 0
    for e in entries:
        size = e.tensor.nbytes if e.delta is None else packed_size_bytes(e.delta, 0)
        at = _align(end)
        if layout[-1] and at + size > limit:
            layout.append([])
            at = 0
        layout[-1].append((e, at, size))
        end = at + size
    buckets = []
    for group in layout:
        if not group:
            continue
        total = max(at + size for _, at, size in group)
        buffer = torch.empty(total, dtype=torch.uint8)
        specs: list[TensorSpec] = []
        for e, at, size in group:
            shape = tuple(int(d) for d in e.tensor.shape)
            if e.delta is None:
                raw = e.tensor.detach().reshape(-1).contiguous().view(torch.uint8)
                buffer[at : at + size].copy_(raw)
                specs.append(TensorSpec(e.name, e.tensor.dtype, shape, at))
            else:
                msg = pack_delta(e.delta, buffer, at, e.checksums)
                specs.append(DeltaSpec(e.name, e.tensor.dtype, shape, at, delta=msg, encoded_bytes=size))
        buckets.append(FlatBucket(buffer, specs))
    return buckets


def checksum_algorithm(
    items: Items, manifests: Mapping[str, ShardManifest]
) -> pb.ChecksumAlgorithm.ValueType:
    """The result checksum of a delta update: the weighted sum where every tensor and every
    recipient is on CUDA (computed and verified where the weights are, without copying a tensor to
    the host as a CRC needs), else CRC-32C or CRC-32 (``preferred_algorithm``)."""
    on_cuda = bool(items) and all(t.device.type == "cuda" for _, t in items)
    return preferred_algorithm(
        torch.device("cuda" if on_cuda else "cpu"),
        ["cuda" if m.device.kind == pb.DEVICE_KIND_CUDA else "cpu" for m in manifests.values()],
        [m.delta_checksum_algorithms for m in manifests.values()],
    )


def _send_delta(
    pusher: WeightPusher,
    keeper: BaseKeeper,
    items: Items,
    options: PushOptions,
    manifests: Mapping[str, ShardManifest],
    base: int,
    name: str,
    *,
    cast_to: CastTo = None,
) -> dict[str, PushResult]:
    keeper.begin(options.version)
    algorithm = checksum_algorithm(items, manifests)
    entries = keeper.update_all(
        [TensorUpdate(n, t, target_dtype(t.dtype, cast_to), _parts(n, manifests)) for n, t in items],
        algorithm,
    )
    limit = pusher.bucket_size_bytes
    if name == transports.INLINE.name:
        limit = min(limit, exp.INLINE_MAX_BYTES)
    buckets = [b for group in by_owners(entries, manifests) for b in pack_buckets(group, limit)]
    options = dataclasses.replace(options, delta_base=base, delta_fallback=pb.DELTA_FALLBACK_NONE)
    setup, exporter = pusher._setup_exporting(torch.device("cpu"), options)
    results = pusher._plan_and_run(
        setup,
        options,
        lambda: job_builders.flat_jobs(
            buckets, setup.manifests, exporter, pusher._staging, options, CheckedLayouts()
        ),
        one_bucket=len(buckets) == 1,
    )
    keeper.commit(options.version)
    sent = {
        a: sum(b.buffer.numel() for b in buckets if any(s.name in m.tensors for s in b.specs))
        for a, m in manifests.items()
    }
    return _mark(results, "DELTA", pb.DELTA_FALLBACK_NONE, sent)
