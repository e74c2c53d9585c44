"""Deltas with every trainer rank a source, without a group: what two trainer ranks pack
(``client.ranks.slice_deltas.SliceDeltas``) read back by a worker (``server.transports.
transfer_group_slice_deltas``: the regions' sizes from their ``TensorDelta``s alone, every delta
checked before anything is written, each region verified after applying), the stream layout both
sides share (``core.transports.transfer_group_slice_deltas``), and each hostile region refused
with its reason and nothing written."""

from __future__ import annotations

import pytest
import torch
from weightwire.client.ranks.slice_deltas import SliceDeltas, region_key
from weightwire.core.delta import BaseKeeper
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest, TensorPiece
from weightwire.core.transports.transfer_group_slice_deltas import chunks, encoded_nbytes, stream_layout
from weightwire.core.transports.transfer_group_slices import held_region
from weightwire.core.transports.transfer_plan import Shard, TensorSpec, TransferPlan, plan_transfers
from weightwire.server.transports.transfer_group_slice_deltas import (
    RegionDeltas,
    apply_regions,
    check_slice_deltas,
    read_regions,
)
from weightwire.server.transports.transfer_group_slices import check_slices
from weightwire.v1 import weight_transfer_pb2 as pb

F32 = pb.DTYPE_FLOAT32
CPU = torch.device("cpu")
# TP rank 1 of 2: rows 8..16 of a column-parallel weight, columns 3..6 of a row-parallel one, a
# fused tensor kept as two pieces, a replicated norm.
MANIFEST = ShardManifest.build(
    DeviceRef.host("test-host"),
    ParallelRank(tp_rank=1, tp_size=2),
    [
        OwnedTensor("col", F32, (16, 64), (TensorPiece(0, 8, 8),)),
        OwnedTensor("row", F32, (8, 6), (TensorPiece(1, 3, 3),)),
        OwnedTensor("fused", F32, (12, 2), (TensorPiece(0, 2, 2), TensorPiece(0, 8, 2))),
        OwnedTensor("norm", F32, (6,)),
    ],
    worker_id="tp1",
    instance_id="worker-instance",
)
SPEC = pb.TransferGroupSpec(
    group_id="g1",
    world_size=3,
    members=[
        pb.TransferGroupMember(group_rank=0, role=pb.TRANSFER_ROLE_TRAINER, instance_id="t0", trainer_rank=0),
        pb.TransferGroupMember(group_rank=1, role=pb.TRANSFER_ROLE_TRAINER, instance_id="t1", trainer_rank=1),
        pb.TransferGroupMember(group_rank=2, role=pb.TRANSFER_ROLE_WORKER, instance_id="worker-instance"),
    ],
)
HOLDINGS = [TensorSpec.dtensor(n, MANIFEST.tensors[n].shape, F32, (2,), [Shard(0)]) for n in MANIFEST.tensors]
PLAN = plan_transfers(HOLDINGS, {"w": MANIFEST})


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(o.shape, generator=gen) for n, o in MANIFEST.tensors.items()}


def sparse(ckpt: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in ckpt.items()}
    flat = out["col"].view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:5]] += 1.0  # sparse: indices
    out["norm"][1] += 1.0
    return out


def kept(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the worker keeps of ``ckpt``: each tensor's pieces concatenated along their dimension."""
    out = {}
    for n, o in MANIFEST.tensors.items():
        t = ckpt[n]
        if not o.pieces:
            out[n] = t.clone()
            continue
        out[n] = torch.cat([t.narrow(p.dim, p.offset, p.length) for p in o.pieces], dim=o.pieces[0].dim)
    return out


def parts(rank: int, ckpt: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    boxes = {s.name: s.holdings[rank] for s in HOLDINGS}
    local = {n: held_region(ckpt[n], b, tuple((0, d) for d in ckpt[n].shape)) for n, b in boxes.items()}
    return local, boxes


def based_ranks(old: dict[str, torch.Tensor]) -> list[BaseKeeper]:
    """Each rank's keeper holding the regions it sends of ``old`` as version 1."""
    keepers = []
    for r in range(2):
        keeper = BaseKeeper()
        keeper.begin(1)
        local, boxes = parts(r, old)
        for t in PLAN.for_source(r):
            keeper.record(region_key(t), held_region(local[t.tensor], t.box, boxes[t.tensor]))
        keeper.commit(1)
        keepers.append(keeper)
    return keepers


def encoded(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> tuple[pb.Payload, dict[int, torch.Tensor]]:
    """The worker's payload and each rank's stream to it: a delta of version 2 against 1."""
    handles, streams = [], {}
    for r, keeper in enumerate(based_ranks(old)):
        sd = SliceDeltas(keeper, 2, 1)
        local, boxes = parts(r, new)
        handles.append(sd._encode(r, PLAN, local, boxes, CPU))
        streams[r] = sd.streams["w"]
    learned = SliceDeltas(BaseKeeper(), 2, 1)
    learned._learn(PLAN, handles)
    h = pb.TransferGroupHandle(
        group_id="g1",
        mode=pb.TRANSFER_MODE_SLICES,
        plan_fingerprint=PLAN.fingerprint,
        max_message_bytes=1 << 20,
    )
    for t in PLAN.for_worker("w"):
        h.slices.add(
            tensor=t.tensor, source_rank=t.source, start=[a for a, _ in t.box], stop=[b for _, b in t.box]
        )
        h.slices[-1].delta.CopyFrom(learned.regions[t])
    assert learned.sent_to == {"w": sum(s.numel() for s in streams.values())}
    return pb.Payload(size_bytes=PLAN.bytes_to()["w"], transfer_group=h), streams


def apply(payload: pb.Payload, streams: dict[int, torch.Tensor], into: dict[str, torch.Tensor]) -> None:
    deltas = _checked(payload)
    assert {s: n for s, n in deltas.sizes.items()} == {s: b.numel() for s, b in streams.items()}
    apply_regions(read_regions(deltas, streams, MANIFEST), into, MANIFEST)


def test_two_ranks_deltas_read_back_bit_exact_and_smaller_than_the_regions() -> None:
    old = checkpoint(1)
    new = sparse(old, 2)
    payload, streams = encoded(old, new)
    into = kept(old)
    apply(payload, streams, into)
    want = kept(new)
    assert all(torch.equal(into[n], want[n]) for n in want)
    # 5 + 1 changed elements: indices and values, far below the kept bytes.
    assert sum(s.numel() for s in streams.values()) < MANIFEST.kept_bytes // 4
    changed = sum(s.delta.changed_count for s in payload.transfer_group.slices)
    assert changed == sum(int((kept(old)[n] != want[n]).sum()) for n in want)


def test_a_region_without_a_base_goes_dense_and_lands() -> None:
    old, new = checkpoint(3), checkpoint(4)
    payload, streams = encoded(old, new)
    # All elements changed: the trainer chose DENSE (the region's bytes) for every region.
    assert {s.delta.encoding for s in payload.transfer_group.slices} == {pb.DELTA_ENCODING_DENSE}
    into = kept(old)
    apply(payload, streams, into)
    assert all(torch.equal(into[n], kept(new)[n]) for n in into)


def refused(payload: pb.Payload, streams: dict[int, torch.Tensor], reason: str) -> str:
    into = kept(checkpoint(1))
    before = {n: t.clone() for n, t in into.items()}
    with pytest.raises(WeightwireError) as e:
        apply(payload, streams, into)
    assert e.value.reason == reason, e.value
    if reason == "INVALID_DELTA":
        assert all(torch.equal(into[n], before[n]) for n in into)  # nothing written
    return e.value.message


def test_hostile_regions_are_refused_before_anything_is_written() -> None:
    old = checkpoint(1)
    new = sparse(old, 2)
    payload, streams = encoded(old, new)
    slices = payload.transfer_group.slices
    col = next(i for i, s in enumerate(slices) if s.tensor == "col" and s.delta.changed_count)
    assert slices[col].delta.encoding == pb.DELTA_ENCODING_INDICES

    def variant(change) -> pb.Payload:
        p = pb.Payload()
        p.CopyFrom(payload)
        change(p.transfer_group.slices)
        return p

    msg = refused(variant(lambda s: s[0].ClearField("delta")), streams, "INVALID_DELTA")
    assert "every region carries one" in msg
    msg = refused(variant(lambda s: s[col].delta.ClearField("result_checksums")), streams, "INVALID_DELTA")
    assert "result checksum of the region" in msg
    msg = refused(
        variant(lambda s: setattr(s[col].delta, "values_offset_bytes", 0)), streams, "INVALID_DELTA"
    )
    assert "values at byte 0" in msg
    refused(variant(lambda s: setattr(s[col].delta, "changed_count", 10**9)), streams, "INVALID_DELTA")
    refused(variant(lambda s: setattr(s[col].delta, "index_dtype", F32)), streams, "INVALID_DELTA")
    # Indices out of order, or past the region, in the bytes that arrived: refused when read.
    source = slices[col].source_rank
    at = next(r.offset for r in _checked(payload).regions if r.msg == slices[col].delta)
    for bad in ([3, 1], [0, 10**6]):
        hostile = {s: b.clone() for s, b in streams.items()}
        hostile[source][at : at + 8].view(torch.int32)[:] = torch.tensor(bad, dtype=torch.int32)
        refused(payload, hostile, "INVALID_DELTA")
    # A result the trainer's checksum does not match: caught after applying.
    wrong = variant(lambda s: s[col].delta.result_checksums[0].checksum.__setattr__("value", 1))
    assert "did not hold the base" in refused(wrong, streams, "DELTA_RESULT_MISMATCH")


def _checked(payload: pb.Payload) -> RegionDeltas:
    return check_slice_deltas(payload, check_slices(payload, SPEC, MANIFEST), MANIFEST)


@pytest.mark.parametrize(
    ("encoding", "count", "index_dtype", "itemsize", "values_at", "size"),
    [
        (pb.DELTA_ENCODING_INDICES, 3, pb.DTYPE_INT32, 2, 12, 12 + 3 * 2),
        (pb.DELTA_ENCODING_INDICES, 3, pb.DTYPE_INT64, 4, 24, 24 + 3 * 4),
        (pb.DELTA_ENCODING_INDICES, 0, pb.DTYPE_INT32, 2, 0, 0),
        (pb.DELTA_ENCODING_BITMAP, 40, pb.DTYPE_UNSPECIFIED, 2, 14, 14 + 40 * 2),  # 100 bits: 13 bytes
        (pb.DELTA_ENCODING_DENSE, 100, pb.DTYPE_UNSPECIFIED, 2, 0, 200),
    ],
)
def test_an_encodings_size_derives_from_its_counts(
    encoding: int, count: int, index_dtype: int, itemsize: int, values_at: int, size: int
) -> None:
    msg = pb.TensorDelta(
        encoding=encoding, changed_count=count, index_dtype=index_dtype, values_offset_bytes=values_at
    )
    assert encoded_nbytes(msg, 100, itemsize) == size


def test_streams_align_each_region_and_travel_in_bounded_messages() -> None:
    assert stream_layout([10, 0, 70, 1]) == ([0, 64, 64, 192], 193)
    assert stream_layout([]) == ([], 0)
    assert chunks(0, 8) == [] and chunks(20, 8) == [(0, 8), (8, 8), (16, 4)]


def test_a_plan_the_ranks_encoded_differently_is_refused() -> None:
    other = TransferPlan(PLAN.transfers[1:], PLAN.fingerprint)
    sd = SliceDeltas(based_ranks(checkpoint(1))[0], 2, 1)
    local, boxes = parts(0, checkpoint(1))
    mine = sd._encode(0, other, local, boxes, CPU)
    with pytest.raises(WeightwireError) as e:
        SliceDeltas(BaseKeeper(), 2, 1)._learn(PLAN, [mine, mine])
    assert e.value.reason == "TRAINER_RANKS_DISAGREE"
