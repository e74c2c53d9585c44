"""``push(fsdp_state_dict, group=..., delta=True)`` on pushers made with ``transfer_group=``: every
trainer rank a source, each sending only the changes of the regions it sends since the version
every worker committed, and every rank falling back to a whole (FULL) update together.

Each rank's pusher keeps the base of only its own regions: its ``delta_keeper`` (a ``BaseKeeper``)
holds one copy of each region of the update's transfer plan that this rank is the source of
(``TransferPlan.for_source``), keyed by tensor and region. That is at most the bytes of this rank's
own shards (a region several ranks hold is sent, and kept, by one of them), on the host unless
``delta_keeper.device_budget_bytes`` lets a CUDA shard's copies stay on its device.

Per push, every rank of the trainer's group, in order:

1. **agree on delta or FULL** (one exchange): each rank says its keeper's base version; rank 0
   also whether every worker reports that version and is CONSISTENT (GetStatus) and whether one
   restarted (another instance or manifest: every rank then tears its group down, so the manifests
   are read again and the FULL reaches it in a group formed anew). A delta only when every rank
   holds the same base and every worker is at it; else every rank goes FULL with the same
   ``delta_fallback`` (NO_BASE: a rank without that base; BASE_MISMATCH: a worker not at it);
2. the update of ``weightwire.client.ranks.slice_push`` with this rank's part prepared once the
   plan is agreed (``SliceDeltas.prepare``): FULL records the regions it sends as the next base;
   a delta diffs each of them against its base (``BaseKeeper.update_all``: a region contiguous in
   its shard in one pass; a region without a base goes as a DENSE delta),
   packs each worker's stream (the encodings of the regions it sends that worker, in plan order,
   ``core.transports.transfer_group_slice_deltas``) with each region's result checksum (CRC-32C
   when every rank has the crc32c package and every worker lists it, agreed in step 1, else CRC-32),
   and the ranks exchange their regions' ``TensorDelta``s, which rank 0's buckets carry as
   ``SliceTransfer.delta``;
3. every rank commits its keeper only when the update committed on every worker (every rank
   returns the same results); any failure drops every rank's base, so the next push is FULL. A
   worker that refuses the delta (``DELTA_BASE_MISMATCH``: its version or state changed since the
   status, its engine holds no base for a tensor of it, or its adapter applies no deltas) fails the
   update on every rank alike, and every rank sends it again whole at once (BASE_MISMATCH, ``delta_refused``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from weightwire.client.inputs.types import PushResult
from weightwire.client.ranks import rank_records
from weightwire.client.ranks.rank_agreement import RankGroup, peer_failed
from weightwire.client.ranks.rank_records import DeltaDecisionRecord, RankFailure, RecordError
from weightwire.client.update.delta import fallback_name
from weightwire.client.update.options import PushOptions
from weightwire.client.update.routing import manifest_changes
from weightwire.core.delta import (
    VERIFIED_ALGORITHMS,
    BaseKeeper,
    crc_algorithm,
    pack_delta,
    packed_size_bytes,
)
from weightwire.core.delta.base_keeper import TensorUpdate
from weightwire.core.delta.encoding import Delta, Encoding
from weightwire.core.delta.record import as_bits
from weightwire.core.errors import PushError, Reason, WeightwireError
from weightwire.core.transports.transfer_group_slice_deltas import encoded_nbytes, stream_layout
from weightwire.core.transports.transfer_group_slices import held_region
from weightwire.core.transports.transfer_plan import Box, Transfer, TransferPlan, box_elements
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["SliceDeltas", "push_slices_delta", "region_key"]

# The pusher (``weightwire.client.push.pusher.WeightPusher``) is typed loosely here: the push layer
# imports this one, never the other way round.
WeightPusher = Any

# The decision's exchange waits this much longer than the pusher's own calls may take.
_GRACE_S = 30.0


def region_key(t: Transfer) -> str:
    """The keeper's name for region ``t`` of its tensor."""
    return t.tensor + "@" + ",".join(f"{a}:{b}" for a, b in t.box)


def _dense(region: torch.Tensor) -> Delta:
    """A region without a base as a delta: every element, its bytes in row-major order."""
    n = region.numel()
    return Delta(Encoding.DENSE, n, region.dtype, n, values=as_bits(region.contiguous()).reshape(-1))


def _stream_sizes(
    regions: Mapping[Transfer, pb.TensorDelta], transfers: Sequence[Transfer]
) -> dict[str, int]:
    """Bytes each worker receives: per source, its regions' encodings laid out as a stream."""
    per: dict[tuple[int, str], list[int]] = {}
    for t in transfers:
        n = box_elements(t.box)
        size = encoded_nbytes(regions[t], n, t.nbytes // max(n, 1), tensor=t.tensor)
        for w in t.destinations:
            per.setdefault((t.source, w), []).append(size)
    out: dict[str, int] = {}
    for (_, w), sizes in per.items():
        out[w] = out.get(w, 0) + stream_layout(sizes)[1]
    return out


class SliceDeltas:
    """This rank's part of one multi-rank push asked for as a delta (module docstring, step 2):
    ``base`` None for a FULL push (the regions it sends are recorded as the next base), else the
    base version the delta is computed against. After ``prepare``: ``streams`` (this rank's, by
    worker), ``regions`` (every rank's deltas, by transfer) and ``sent_to`` (each worker's bytes)."""

    def __init__(
        self,
        keeper: BaseKeeper,
        version: int,
        base: int | None,
        algorithm: pb.ChecksumAlgorithm.ValueType = pb.CHECKSUM_ALGORITHM_CRC32,
    ) -> None:
        self.keeper = keeper
        self.version = version
        self.base = base
        self.algorithm = algorithm
        self.streams: dict[str, torch.Tensor] = {}
        self.regions: dict[Transfer, pb.TensorDelta] = {}
        self.sent_to: dict[str, int] = {}

    @property
    def is_delta(self) -> bool:
        return self.base is not None

    def prepare(
        self,
        ranks: RankGroup,
        plan: TransferPlan,
        local: Mapping[str, torch.Tensor],
        boxes: Mapping[str, Box],
        device: torch.device,
    ) -> None:
        """Record (FULL) or diff and pack (delta) the regions this rank sends; for a delta, learn
        every rank's (collective: every rank calls it once the plan is agreed)."""
        me = ranks.rank
        error: Exception | None = None
        data = b"\x01"
        try:
            if self.base is None:
                self._record(me, plan, local, boxes)
            else:
                data += self._encode(me, plan, local, boxes, device).SerializeToString()
        except Exception as e:
            # Said to every rank, so that none goes on to wait for this one's sends.
            error = e
            data = b"\x00" + json.dumps(RankFailure.of(e).to_json()).encode()
        everyone = ranks.exchange(data, "the regions' deltas")
        for r, d in enumerate(everyone):
            if d[:1] != b"\x01":
                if error is not None:
                    raise error
                raise peer_failed(r, _failure_of(r, d[1:]).to_json(), before_sending=True)
        if self.base is not None:
            self._learn(plan, [pb.TransferGroupHandle.FromString(d[1:]) for d in everyone])

    def _record(
        self, me: int, plan: TransferPlan, local: Mapping[str, torch.Tensor], boxes: Mapping[str, Box]
    ) -> None:
        """A FULL push: the regions this rank sends become its base once every worker commits."""
        self.keeper.drop()  # whatever each rank held, the regions of this update are the base
        self.keeper.begin(self.version)
        for t in plan.for_source(me):
            self.keeper.record(region_key(t), held_region(local[t.tensor], t.box, boxes[t.tensor]))

    def _encode(
        self,
        me: int,
        plan: TransferPlan,
        local: Mapping[str, torch.Tensor],
        boxes: Mapping[str, Box],
        device: torch.device,
    ) -> pb.TransferGroupHandle:
        """Diff, record and checksum every region this rank sends; pack each worker's stream."""
        keeper = self.keeper
        keeper.begin(self.version)
        mine = plan.for_source(me)
        regions = [held_region(local[t.tensor], t.box, boxes[t.tensor]) for t in mine]
        # a region contiguous in its shard (whole rows) takes the one pass per tensor, the others
        # diff, record and checksum in turn (BaseKeeper.update_all)
        kept = keeper.update_all(
            [TensorUpdate(region_key(t), r, r.dtype) for t, r in zip(mine, regions, strict=True)],
            self.algorithm,
        )
        entries: list[tuple[Transfer, Delta, list[pb.DeltaChecksum]]] = []
        for t, region, u in zip(mine, regions, kept, strict=True):
            if u.delta is None:  # no base for it: its values whole, still checked after landing
                entries.append((t, _dense(region), keeper.result_checksums(u.name, self.algorithm)))
            else:
                entries.append((t, u.delta, u.checksums))
        messages: dict[Transfer, pb.TensorDelta] = {}
        workers = sorted({w for t in mine for w in t.destinations})
        for w in workers:
            listed = [e for e in entries if w in e[0].destinations]
            sizes = [packed_size_bytes(d, 0) for _, d, _ in listed]
            offsets, total = stream_layout(sizes)
            buf = torch.zeros(total, dtype=torch.uint8, device=device)  # padding sent as zeros
            for (t, d, checks), at, size in zip(listed, offsets, sizes, strict=True):
                messages[t] = pack_delta(d, buf[at : at + size], 0, checks)
            self.streams[w] = buf
        out = pb.TransferGroupHandle()
        for t in mine:
            s = out.slices.add(tensor=t.tensor, source_rank=me, delta=messages[t])
            s.start.extend(a for a, _ in t.box)
            s.stop.extend(b for _, b in t.box)
        return out

    def _learn(self, plan: TransferPlan, handles: Sequence[pb.TransferGroupHandle]) -> None:
        for r, h in enumerate(handles):
            theirs = plan.for_source(r)
            same = len(h.slices) == len(theirs) and all(
                s.tensor == t.tensor and tuple(zip(s.start, s.stop, strict=True)) == t.box
                for s, t in zip(h.slices, theirs, strict=True)
            )
            if not same:
                raise WeightwireError(
                    Reason.TRAINER_RANKS_DISAGREE,
                    f"trainer rank {r} encoded other regions than the agreed plan gives it; nothing was sent",
                    rank=str(r),
                )
            self.regions.update((t, s.delta) for s, t in zip(h.slices, theirs, strict=True))
        self.sent_to = _stream_sizes(self.regions, plan.transfers)


def _failure_of(rank: int, data: bytes) -> RankFailure:
    """Rank ``rank``'s failure as it sent it in the regions' exchange, decoded strictly."""
    try:
        return RankFailure.from_json(json.loads(data.decode()))
    except (ValueError, TypeError, KeyError) as e:
        raise RecordError(rank, "the regions' deltas", str(e)[:300]) from None


_CRC32C_HERE = pb.CHECKSUM_ALGORITHM_CRC32C in VERIFIED_ALGORITHMS  # this process has the crc32c package


def _decide(
    pusher: WeightPusher, keeper: BaseKeeper, ranks: RankGroup
) -> tuple[pb.DeltaFallback.ValueType, pb.ChecksumAlgorithm.ValueType]:
    """Step 1 of the module docstring: NONE (a delta against the keeper's base) or why FULL, and
    the result checksums' algorithm; the same on every rank."""
    base = keeper.base_version
    at_base = restarted = False
    crc32c = _CRC32C_HERE
    if ranks.rank == 0 and base is not None:
        try:
            statuses = pusher.status()
            at_base = all(
                s.weights_version == base and s.state == pb.WORKER_STATE_CONSISTENT for s in statuses.values()
            )
            manifests = pusher.manifests()
            restarted = bool(manifest_changes(statuses, manifests, pusher._fingerprints))
            verified = [m.delta_checksum_algorithms for m in manifests.values()]
            crc32c = crc_algorithm(verified) == pb.CHECKSUM_ALGORITHM_CRC32C
        except WeightwireError:
            at_base = False  # a worker that does not answer: the whole update says why it fails
    mine = DeltaDecisionRecord(base or 0, at_base, restarted, crc32c)
    records = rank_records.exchange(ranks, mine, "whether the update is a delta")
    if records[0].restarted and pusher._sources is not None:
        pusher._sources.teardown("a worker restarted: its manifest is read again")
    algorithm = (
        pb.CHECKSUM_ALGORITHM_CRC32C if all(r.crc32c for r in records) else pb.CHECKSUM_ALGORITHM_CRC32
    )
    bases = {r.base for r in records}
    if 0 in bases or len(bases) != 1:
        return pb.DELTA_FALLBACK_NO_BASE, algorithm
    if not records[0].at_base:
        return pb.DELTA_FALLBACK_BASE_MISMATCH, algorithm
    return pb.DELTA_FALLBACK_NONE, algorithm


def push_slices_delta(
    pusher: WeightPusher, items: list[tuple[str, torch.Tensor]], options: PushOptions, group: Any
) -> dict[str, PushResult]:
    """One multi-rank push asked for as a delta (module docstring); one result per worker, the
    same on every rank."""
    keeper: BaseKeeper = pusher.delta_keeper
    ranks = RankGroup(group, pusher.timeout_s + _GRACE_S)
    fallback, algorithm = _decide(pusher, keeper, ranks)
    if fallback != pb.DELTA_FALLBACK_NONE:
        return send(pusher, items, options, group, SliceDeltas(keeper, options.version, None), fallback)
    try:
        delta = SliceDeltas(keeper, options.version, keeper.base_version, algorithm)
        return send(pusher, items, options, group, delta, fallback)
    except PushError as e:
        refused = sum(err.kind is Reason.DELTA_BASE_MISMATCH for err in e.failures.values())
        if not refused:
            raise
        full = SliceDeltas(keeper, options.version, None)
        return send(pusher, items, options, group, full, pb.DELTA_FALLBACK_BASE_MISMATCH, refused=refused)


def send(
    pusher: WeightPusher,
    items: list[tuple[str, torch.Tensor]],
    options: PushOptions,
    group: Any,
    deltas: SliceDeltas,
    fallback: pb.DeltaFallback.ValueType,
    *,
    refused: int = 0,
) -> dict[str, PushResult]:
    """One update of ``deltas``' kind (a delta when it has a base, else FULL saying ``fallback``);
    the keeper commits only when every worker did, and is dropped on any failure."""
    if deltas.base is not None:
        options = dataclasses.replace(options, delta_base=deltas.base, delta_fallback=pb.DELTA_FALLBACK_NONE)
    else:
        options = dataclasses.replace(options, delta_base=None, delta_fallback=fallback)
    try:
        results: dict[str, PushResult] = pusher._push_slices(items, options, group, deltas)
    except BaseException:
        deltas.keeper.drop()
        raise
    deltas.keeper.commit(options.version)
    return {
        a: dataclasses.replace(
            r,
            encoding="DELTA" if deltas.is_delta else "FULL",
            delta_fallback=fallback_name(options.delta_fallback),
            delta_refused=refused,
            encoded_bytes=deltas.sent_to.get(a, 0) if deltas.is_delta else r.bytes_received,
        )
        for a, r in results.items()
    }
