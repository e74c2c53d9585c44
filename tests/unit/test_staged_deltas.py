"""Region deltas handed to an adapter's own delta path (``server.worker.staged_deltas``): deltas of
disjoint regions of a tensor (each over its box's elements, in every encoding) become one delta of
the full tensor that writes exactly the new values; ``apply_staged`` applies an update's buckets in
one ``apply_deltas`` call and verifies each region in every part the adapter keeps, failing a
drifted part with DELTA_RESULT_MISMATCH."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from weightwire.adapters.torch.delta_pieces import apply_to_piece
from weightwire.core.delta import Delta, apply_delta, checksum, encode
from weightwire.core.delta.encoding import Encoding
from weightwire.core.delta.errors import DELTA_RESULT_MISMATCH
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest, TensorPiece
from weightwire.server.transports.importer import RegionChange
from weightwire.server.worker.staged_deltas import StagedDeltas, apply_staged, full_tensor_delta
from weightwire.v1 import weight_transfer_pb2 as pb

Box = tuple[tuple[int, int], ...]


def _changed(old: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    new = old.clone().view(-1)
    mask = torch.rand(new.numel(), generator=gen) < fraction
    new[mask] = torch.randn(int(mask.sum()), generator=gen)
    return new.view(old.shape)


def _region(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (a, b) in enumerate(box):
        t = t.narrow(d, a, b - a)
    return t


@pytest.mark.parametrize(
    ("shape", "boxes"),
    [
        ((8, 6), [((0, 4), (0, 6)), ((4, 8), (0, 6))]),  # FSDP rows
        ((8, 6), [((0, 8), (0, 3)), ((0, 8), (3, 6))]),  # columns: positions interleave
        ((4, 3, 5), [((0, 2), (0, 3), (0, 5)), ((2, 4), (0, 1), (0, 5)), ((2, 4), (1, 3), (0, 5))]),
        ((7,), [((0, 3),), ((3, 7),)]),
    ],
)
@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.5, 1.0])  # none, INDICES, BITMAP, DENSE
def test_region_deltas_make_one_delta_of_the_full_tensor(
    shape: tuple[int, ...], boxes: list[Box], fraction: float
) -> None:
    old = torch.randn(shape)
    new = _changed(old, fraction, seed=len(boxes))
    regions = [(box, encode(_region(old, box), _region(new, box))) for box in boxes]
    if fraction == 1.0:
        assert {d.encoding for _, d in regions} == {Encoding.DENSE}
    merged = full_tensor_delta(shape, old.dtype, regions)
    assert merged.encoding is Encoding.INDICES and merged.numel == old.numel()
    # DENSE regions name every element, changed or not.
    want = old.numel() if fraction == 1.0 else int((old != new).sum())
    assert merged.changed_count == want
    got = old.clone()
    apply_delta(got, merged, checked=False)
    assert torch.equal(got, new)


class _Pieces:
    """An adapter keeping one piece (rows 2..6) of a tensor twice (as SGLang keeps a tied
    embedding), applying a full-tensor delta into both."""

    def __init__(self, held: torch.Tensor) -> None:
        self.parts = [held.clone(), held.clone()]
        self.calls: list[list[str]] = []

    def apply_deltas(self, deltas: Sequence[tuple[str, Delta]]) -> None:
        self.calls.append([n for n, _ in deltas])
        for _, delta in deltas:
            for part in self.parts:
                apply_to_piece(part, delta, (8, 4), 0, 2, 4)

    def delta_parts(self, name: str) -> list[tuple[tuple[int, int, int], torch.Tensor]]:
        return [((0, 2, 4), p) for p in self.parts]


def _crc(t: torch.Tensor) -> list[pb.DeltaChecksum]:
    value = checksum(t, pb.CHECKSUM_ALGORITHM_CRC32)
    return [pb.DeltaChecksum(checksum=pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32, value=value))]


@pytest.mark.parametrize("drift", [False, True])
def test_an_update_s_buckets_apply_in_one_call_and_every_part_is_verified(drift: bool) -> None:
    manifest = ShardManifest.build(
        DeviceRef.host("test-host"),
        ParallelRank(tp_rank=1, tp_size=2),
        [OwnedTensor("w", pb.DTYPE_FLOAT32, (8, 4), (TensorPiece(0, 2, 4),))],
    )
    old = torch.randn(8, 4)
    new = _changed(old, 0.2, seed=3)
    adapter = _Pieces(old[2:6])
    if drift:
        adapter.parts[1].view(-1)[0] += 1.0
    written: list[bool] = []
    steps = [
        StagedDeltas(
            adapter,  # type: ignore[arg-type]
            [RegionChange("w", box, _crc(_region(new, box)), encode(_region(old, box), _region(new, box)))],
            manifest,
            lambda: written.append(True),
        )
        for box in (((2, 4), (0, 4)), ((4, 6), (0, 4)))  # two sources' regions, in two buckets
    ]
    if drift:
        with pytest.raises(WeightwireError) as err:
            apply_staged(steps)
        assert err.value.reason == DELTA_RESULT_MISMATCH
    else:
        apply_staged(steps)
        assert all(torch.equal(p, new[2:6]) for p in adapter.parts)
    assert adapter.calls == [["w"]] and written == [True]
