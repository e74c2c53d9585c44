"""The trainer's one pass per host tensor (``BaseKeeper.update_all`` through ``host_pass``) gives
what the separate steps give: the same encoding, indices, bitmap and values as ``encode`` of the
cast tensor, the base brought to the cast tensor, and its result checksum; a worker applying the
delta holds the trainer's tensor and verifies it. Tensors the pass does not take (pieces, another
checksum, no base) go through the separate steps, in order."""

from __future__ import annotations

import pytest
import torch
from weightwire.core.delta import BaseKeeper, apply_delta, checksum, encode, verify_result
from weightwire.core.delta.base_keeper import TensorUpdate
from weightwire.core.delta.encoding import HOST_CHUNK_ELEMENTS, Encoding
from weightwire.v1 import weight_transfer_pb2 as pb

CRCS = [pb.CHECKSUM_ALGORITHM_CRC32C, pb.CHECKSUM_ALGORITHM_CRC32]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def keeper_with(name: str, base: torch.Tensor, version: int = 1) -> BaseKeeper:
    keeper = BaseKeeper()
    keeper.begin(version)
    keeper.record(name, base)
    keeper.commit(version)
    keeper.begin(version + 1)
    return keeper


@pytest.mark.parametrize("algorithm", CRCS)
@pytest.mark.parametrize(
    ("numel", "fraction", "encoding"),
    [
        (1000, 0.01, Encoding.INDICES),
        (HOST_CHUNK_ELEMENTS * 2 + 17, 0.002, Encoding.INDICES),
        (HOST_CHUNK_ELEMENTS * 2 + 17, 0.0, Encoding.INDICES),
        (HOST_CHUNK_ELEMENTS + 5, 0.06, Encoding.BITMAP),
        (HOST_CHUNK_ELEMENTS + 5, 0.97, Encoding.DENSE),
        (7, 1.0, Encoding.DENSE),
    ],
)
@pytest.mark.parametrize("sent", [torch.bfloat16, torch.float16])
def test_one_pass_equals_the_separate_steps(
    numel: int, fraction: float, encoding: Encoding, sent: torch.dtype, algorithm: int
) -> None:
    gen = torch.Generator().manual_seed(numel)
    master = torch.randn(numel, generator=gen)
    old = master.to(sent)
    moved = torch.rand(numel, generator=gen) < fraction
    master[moved] += 1.0
    want = master.to(sent)
    keeper = keeper_with("w", old)
    (u,) = keeper.update_all([TensorUpdate("w", master, sent)], algorithm)  # type: ignore[arg-type]
    ref = encode(old, want)
    assert u.delta is not None and u.delta.encoding is ref.encoding is encoding
    assert u.delta.changed_count == ref.changed_count
    assert torch.equal(bits(u.delta.values.view(sent)), bits(ref.values.view(sent)))
    for field in ("indices", "bitmap"):
        got, expected = getattr(u.delta, field), getattr(ref, field)
        assert (got is None) == (expected is None), field
        if got is not None:
            assert got.dtype == expected.dtype and torch.equal(got, expected), field
    assert (u.tensor.dtype, u.tensor.shape) == (sent, want.shape)
    assert torch.equal(bits(keeper._kept["w"].copy), bits(want))
    (check,) = u.checksums
    assert check.checksum.algorithm == algorithm and not check.HasField("piece")
    assert check.checksum.value == checksum(want, algorithm)  # type: ignore[arg-type]
    # the worker's side: applied to the base it held, verified, bit-exact
    worker = old.clone()
    apply_delta(worker, u.delta)
    assert verify_result(u.checksums, [(None, worker)], tensor="w") == 1
    assert torch.equal(bits(worker), bits(want))


def test_a_tensor_already_in_the_sent_dtype_is_compared_in_place() -> None:
    old = torch.randn(HOST_CHUNK_ELEMENTS + 3).to(torch.bfloat16)
    new = old.clone()
    new[::1000] = (new[::1000].float() + 0.5).to(torch.bfloat16)
    keeper = keeper_with("w", old)
    (u,) = keeper.update_all([TensorUpdate("w", new, torch.bfloat16)], pb.CHECKSUM_ALGORITHM_CRC32C)
    assert u.delta is not None and u.delta.encoding is Encoding.INDICES
    assert u.delta.changed_count == int((bits(new) != bits(old)).sum())
    assert torch.equal(bits(keeper._kept["w"].copy), bits(new))


def test_what_the_pass_does_not_take_goes_through_the_separate_steps_in_order() -> None:
    gen = torch.Generator().manual_seed(0)
    masters = {n: torch.randn(64, 32, generator=gen) for n in ("a", "piece", "b", "new")}
    keeper = BaseKeeper()
    keeper.begin(1)
    for n in ("a", "piece"):
        keeper.record(n, masters[n].to(torch.bfloat16))
    keeper.record("b", masters["b"].t().to(torch.bfloat16))
    keeper.commit(1)
    for t in masters.values():
        t[0, :4] += 1.0
    keeper.begin(2)
    items = [
        TensorUpdate("a", masters["a"], torch.bfloat16),
        TensorUpdate("piece", masters["piece"], torch.bfloat16, [(0, 0, 32), (0, 32, 32)]),
        TensorUpdate("b", masters["b"].t(), torch.bfloat16),  # not contiguous
        TensorUpdate("new", masters["new"], torch.bfloat16),  # no base: sent whole
    ]
    out = keeper.update_all(items, pb.CHECKSUM_ALGORITHM_CRC32C)
    assert [u.name for u in out] == ["a", "piece", "b", "new"]
    assert all(u.delta is not None for u in out[:3])
    assert out[3].delta is None and out[3].checksums == []
    assert [c.piece.offset for c in out[1].checksums] == [0, 32]
    for u, item in zip(out, items, strict=True):
        want = item.tensor.to(torch.bfloat16)
        assert torch.equal(bits(keeper._kept[u.name].copy), bits(want)), u.name
        for c in u.checksums:
            part = want.narrow(c.piece.dim, c.piece.offset, c.piece.length) if c.HasField("piece") else want
            assert c.checksum.value == checksum(part, pb.CHECKSUM_ALGORITHM_CRC32C)
    keeper.commit(2)
    assert keeper.base_version == 2


def test_the_weighted_sum_keeps_the_separate_steps() -> None:
    master = torch.randn(4096)
    keeper = keeper_with("w", master.to(torch.bfloat16))
    master[:10] += 1.0
    (u,) = keeper.update_all(
        [TensorUpdate("w", master, torch.bfloat16)], pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64
    )
    (check,) = u.checksums
    assert check.checksum.value == checksum(master.to(torch.bfloat16), pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64)


def test_a_name_twice_is_diffed_in_order() -> None:
    old = torch.randn(1000)
    keeper = keeper_with("w", old.to(torch.bfloat16))
    first, second = old.clone(), old.clone()
    first[:10] += 1.0
    second[:20] += 1.0
    out = keeper.update_all(
        [TensorUpdate("w", first, torch.bfloat16), TensorUpdate("w", second, torch.bfloat16)],
        pb.CHECKSUM_ALGORITHM_CRC32C,
    )
    assert [u.delta.changed_count for u in out if u.delta is not None] == [10, 10]
    assert torch.equal(bits(keeper._kept["w"].copy), bits(second.to(torch.bfloat16)))
