"""The result checksums a trainer rank puts on its regions' deltas (every rank a source): the
algorithm the ranks agreed on, computed over what each worker holds once the delta is applied."""

from __future__ import annotations

import pytest
import torch
from weightwire.client.ranks.rank_records import DeltaDecisionRecord
from weightwire.client.ranks.slice_deltas import SliceDeltas
from weightwire.core.delta import BaseKeeper, checksum
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest, TensorPiece
from weightwire.core.transports.transfer_group_slices import held_region
from weightwire.core.transports.transfer_plan import Box, Shard, TensorSpec, TransferPlan, plan_transfers
from weightwire.v1 import weight_transfer_pb2 as pb


def _one_rank_plan() -> tuple[TransferPlan, dict[str, torch.Tensor], dict[str, Box], dict[str, torch.Tensor]]:
    manifest = ShardManifest.build(
        DeviceRef.host("unit"),
        ParallelRank(tp_rank=1, tp_size=2),
        [
            OwnedTensor("row", pb.DTYPE_BFLOAT16, (8, 6), (TensorPiece(1, 3, 3),)),
            OwnedTensor("norm", pb.DTYPE_BFLOAT16, (6,)),
        ],
        worker_id="tp1",
        instance_id="worker-instance",
    )
    holdings = [
        TensorSpec.dtensor(n, o.shape, pb.DTYPE_BFLOAT16, (1,), [Shard(0)])
        for n, o in manifest.tensors.items()
    ]
    plan = plan_transfers(holdings, {"w": manifest})
    full = {n: torch.randn(o.shape).to(torch.bfloat16) for n, o in manifest.tensors.items()}
    boxes = {s.name: s.holdings[0] for s in holdings}
    return (
        plan,
        full,
        boxes,
        {n: held_region(full[n], b, tuple((0, d) for d in full[n].shape)) for n, b in boxes.items()},
    )


@pytest.mark.parametrize("algorithm", [pb.CHECKSUM_ALGORITHM_CRC32C, pb.CHECKSUM_ALGORITHM_CRC32])
def test_each_region_carries_the_agreed_algorithm_over_its_result(algorithm: int) -> None:
    plan, full, boxes, local = _one_rank_plan()
    keeper = BaseKeeper()
    first = SliceDeltas(keeper, 1, None)
    first._record(0, plan, local, boxes)
    keeper.commit(1)
    stepped = {n: t.clone() for n, t in full.items()}
    stepped["row"][2, 1] += 1
    local2 = {n: held_region(stepped[n], boxes[n], tuple((0, d) for d in stepped[n].shape)) for n in boxes}
    delta = SliceDeltas(keeper, 2, 1, algorithm)
    handle = delta._encode(0, plan, local2, boxes, torch.device("cpu"))
    assert len(handle.slices) == len(plan.transfers) > 0
    for s in handle.slices:
        sums = list(s.delta.result_checksums)
        assert sums and all(c.checksum.algorithm == algorithm for c in sums)
        # over the region as the worker holds it after applying: the stepped tensor's box
        box = tuple(zip(s.start, s.stop, strict=True))
        want = held_region(stepped[s.tensor], box, tuple((0, d) for d in stepped[s.tensor].shape))
        assert [c.checksum.value for c in sums] == [checksum(want.contiguous(), algorithm)]


def test_the_decision_record_carries_whether_a_rank_can_use_crc32c() -> None:
    r = DeltaDecisionRecord(3, True, False, True)
    assert DeltaDecisionRecord.from_json(r.to_json()) == r
    with pytest.raises(ValueError, match="crc32c"):
        DeltaDecisionRecord.from_json({"base": 3, "at_base": True, "restarted": False})
