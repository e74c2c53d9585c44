"""The worker's rules for a slices bucket (every trainer rank a source), before any byte moves
(``server.transports.transfer_group_slices.check_slices``): the regions of each named tensor must
tile exactly what the worker keeps of it, come from trainer members, and add up to the payload's
size; anything else is refused with a reason, and a plan's own regions pass."""

from __future__ import annotations

import pytest
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest, TensorPiece
from weightwire.core.transports.transfer_plan import Shard, TensorSpec, plan_transfers
from weightwire.server.transports.transfer_group_slices import check_slices, kept_shape
from weightwire.v1 import weight_transfer_pb2 as pb

F32 = pb.DTYPE_FLOAT32
FP = "0123456789abcdef0123456789abcdef"

# TP rank 1 of 2: rows 4..8 of a column-parallel weight, columns 3..6 of a row-parallel one, a
# fused tensor kept as two pieces, a replicated norm.
MANIFEST = ShardManifest.build(
    DeviceRef.host("test-host"),
    ParallelRank(tp_rank=1, tp_size=2),
    [
        OwnedTensor("col", F32, (8, 6), (TensorPiece(0, 4, 4),)),
        OwnedTensor("row", F32, (4, 6), (TensorPiece(1, 3, 3),)),
        OwnedTensor("fused", F32, (12, 2), (TensorPiece(0, 2, 2), TensorPiece(0, 8, 2))),
        OwnedTensor("norm", F32, (6,)),
    ],
    worker_id="tp1",
    instance_id="worker-instance",
)


def spec(trainers: int = 2) -> pb.TransferGroupSpec:
    members = [
        pb.TransferGroupMember(
            group_rank=r, role=pb.TRANSFER_ROLE_TRAINER, instance_id=f"t{r}", trainer_rank=r
        )
        for r in range(trainers)
    ]
    members.append(
        pb.TransferGroupMember(
            group_rank=trainers, role=pb.TRANSFER_ROLE_WORKER, instance_id="worker-instance"
        )
    )
    return pb.TransferGroupSpec(group_id="g1", world_size=len(members), members=members)


def payload(regions: list[tuple[str, int, list[int], list[int]]], size: int | None = None) -> pb.Payload:
    h = pb.TransferGroupHandle(
        group_id="g1",
        mode=pb.TRANSFER_MODE_SLICES,
        sequence=1,
        plan_fingerprint=FP,
        max_message_bytes=1 << 20,
    )
    total = 0
    for tensor, src, start, stop in regions:
        h.slices.add(tensor=tensor, source_rank=src, start=start, stop=stop)
        n = 4
        for a, b in zip(start, stop, strict=True):
            n *= b - a
        total += n
    return pb.Payload(size_bytes=total if size is None else size, transfer_group=h)


def refused(p: pb.Payload, s: pb.TransferGroupSpec | None = None) -> WeightwireError:
    with pytest.raises(WeightwireError) as e:
        check_slices(p, s or spec(), MANIFEST)
    return e.value


def test_a_plans_own_regions_pass_and_fill_each_kept_tensor_once() -> None:
    # Two FSDP ranks holding rows halves (Shard(0)) of every tensor: the plan cuts the kept pieces.
    holdings = [
        TensorSpec.dtensor(n, MANIFEST.tensors[n].shape, F32, (2,), [Shard(0)]) for n in MANIFEST.tensors
    ]
    plan = plan_transfers(holdings, {"w": MANIFEST})
    p = payload(
        [(t.tensor, t.source, [a for a, _ in t.box], [b for _, b in t.box]) for t in plan.for_worker("w")]
    )
    checked = check_slices(p, spec(), MANIFEST)
    assert checked.names == set(MANIFEST.tensors) and checked.nbytes == MANIFEST.kept_bytes
    assert {t.source for t in checked.plan.transfers} == {0, 1}
    assert kept_shape(MANIFEST.tensors["fused"]) == (4, 2) and kept_shape(MANIFEST.tensors["row"]) == (4, 3)


def test_overlapping_regions_are_refused() -> None:
    err = refused(payload([("col", 0, [4, 0], [7, 6]), ("col", 1, [6, 0], [8, 6])]))
    assert err.reason == "TENSOR_OUT_OF_BOUNDS" and "overlap" in err.message


def test_a_gap_in_what_the_worker_keeps_is_refused() -> None:
    err = refused(payload([("col", 0, [4, 0], [6, 6]), ("col", 1, [6, 0], [7, 6])]))
    assert err.reason == "INCOMPLETE_UPDATE" and "'col'" in err.message


def test_a_region_outside_the_kept_pieces_is_refused() -> None:
    err = refused(payload([("col", 0, [0, 0], [4, 6])]))  # TP rank 0's rows
    assert err.reason == "TENSOR_OUT_OF_BOUNDS"
    err = refused(payload([("fused", 0, [2, 0], [10, 2])]))  # spans the gap between its pieces
    assert err.reason == "TENSOR_OUT_OF_BOUNDS"
    err = refused(payload([("norm", 0, [0, 0], [6, 1])]))  # wrong number of dimensions
    assert err.reason == "TENSOR_OUT_OF_BOUNDS"


def test_tensors_the_worker_does_not_keep_and_non_trainer_sources_are_refused() -> None:
    assert refused(payload([("lm_head", 0, [0], [6])])).reason == "TENSOR_OUT_OF_BOUNDS"
    assert refused(payload([("norm", 2, [0], [6])])).reason == "INVALID_GROUP_SPEC"  # the worker itself
    assert refused(payload([("norm", -1, [0], [6])])).reason == "INVALID_GROUP_SPEC"


def test_size_fingerprint_message_size_and_group_are_checked() -> None:
    assert refused(payload([("norm", 0, [0], [6])], size=999)).reason == "INVALID_SIZE"
    p = payload([("norm", 0, [0], [6])])
    p.transfer_group.plan_fingerprint = "not-hex"
    assert refused(p).reason == "INVALID_GROUP_SPEC"
    p = payload([("norm", 0, [0], [6])])
    p.transfer_group.max_message_bytes = 0
    assert refused(p).reason == "INVALID_GROUP_SPEC"
    p = payload([("norm", 0, [0], [6])])
    p.transfer_group.group_id = "another"
    assert refused(p).reason == "GROUP_NOT_JOINED"


def test_too_many_regions_are_refused_before_any_is_looked_at() -> None:
    p = payload([])
    for _ in range(65537):
        p.transfer_group.slices.add(tensor="norm", source_rank=0)
    assert refused(p).reason == "INVALID_GROUP_SPEC"
