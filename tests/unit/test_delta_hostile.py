"""Hostile deltas are refused with INVALID_DELTA before one element is written.

Indices past the target or negative, duplicated or unsorted, value counts that do not match, values
or indices of the wrong dtype, bitmaps of the wrong length or with bits past the end, parts outside
the payload, an unknown encoding; and the worker's two checks around them: a base it does not hold
(DELTA_BASE_MISMATCH) and a result that differs from the trainer's (DELTA_RESULT_MISMATCH).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from weightwire.core.delta import checksums as ck
from weightwire.core.delta import encoding as enc
from weightwire.core.delta import verify, wire
from weightwire.core.errors import WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb

N = 40


def base_and_target() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.arange(N, dtype=torch.float32).to(torch.bfloat16)
    return old, old.clone()


def indices_delta(idx: list[int], values: torch.Tensor | None = None, count: int | None = None) -> enc.Delta:
    vals = values if values is not None else torch.full((len(idx),), 7, dtype=torch.int16)
    return enc.Delta(
        enc.Encoding.INDICES,
        N,
        torch.bfloat16,
        len(idx) if count is None else count,
        values=vals,
        indices=torch.tensor(idx, dtype=torch.int32),
    )


def refused(
    target: torch.Tensor, delta: enc.Delta, reason: str = "INVALID_DELTA", **kw: object
) -> WeightwireError:
    before = target.clone()
    with pytest.raises(WeightwireError) as info:
        enc.apply_delta(target, delta, tensor="w", **kw)  # type: ignore[arg-type]
    assert info.value.reason == reason
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.metadata["tensor"] == "w"
    assert torch.equal(target.view(torch.int16), before.view(torch.int16)), "a refused delta wrote"
    return info.value


@pytest.mark.parametrize(
    ("idx", "why"),
    [
        ([3, N], "outside"),
        ([N + 1000], "outside"),
        ([-1, 4], "outside"),
        ([3, 3], "ascending"),
        ([5, 2], "ascending"),
        ([1, 9, 4, 20], "ascending"),
    ],
)
def test_bad_indices(idx: list[int], why: str) -> None:
    _, target = base_and_target()
    assert why in refused(target, indices_delta(idx)).message


@pytest.mark.parametrize("ops", [enc.NumpyOps(), enc.TorchOps()], ids=["numpy", "torch"])
def test_bad_indices_on_both_kernel_sets(ops: enc.TorchOps) -> None:
    _, target = base_and_target()
    refused(target, indices_delta([2, 1]), ops=ops)


@pytest.mark.parametrize(
    "delta",
    [
        # a value count that does not match
        indices_delta([1, 2, 3], values=torch.ones(2, dtype=torch.int16)),
        indices_delta([1, 2], values=torch.ones(3, dtype=torch.int16)),
        indices_delta([1, 2], count=3),
        # values of another width or kind
        indices_delta([1, 2], values=torch.ones(2, dtype=torch.int32)),
        indices_delta([1, 2], values=torch.ones(2, dtype=torch.float16)),
        indices_delta([1, 2], values=torch.ones(1, 2, dtype=torch.int16)),
        # indices of a dtype that is not an index
        dataclasses.replace(indices_delta([1, 2]), indices=torch.tensor([1.0, 2.0])),
        dataclasses.replace(indices_delta([1, 2]), indices=torch.tensor([1, 2], dtype=torch.uint8)),
        # a delta made for another tensor
        dataclasses.replace(indices_delta([1]), numel=N + 1),
        dataclasses.replace(indices_delta([1]), dtype=torch.float16),
        # dense with fewer values, or claiming fewer changes
        enc.Delta(enc.Encoding.DENSE, N, torch.bfloat16, N, values=torch.zeros(N - 1, dtype=torch.int16)),
        enc.Delta(enc.Encoding.DENSE, N, torch.bfloat16, N - 1, values=torch.zeros(N - 1, dtype=torch.int16)),
        # an indices delta with a bitmap, a bitmap delta without one
        dataclasses.replace(indices_delta([1]), bitmap=torch.zeros(5, dtype=torch.uint8)),
        enc.Delta(enc.Encoding.BITMAP, N, torch.bfloat16, 1, values=torch.ones(1, dtype=torch.int16)),
    ],
    ids=[
        "fewer-values",
        "more-values",
        "count-above-indices",
        "int32-values",
        "float16-values",
        "2d-values",
        "float-indices",
        "uint8-indices",
        "other-numel",
        "other-dtype",
        "dense-short",
        "dense-partial",
        "indices-with-bitmap",
        "bitmap-missing",
    ],
)
def test_bad_counts_and_dtypes(delta: enc.Delta) -> None:
    _, target = base_and_target()
    refused(target, delta)


def bitmap_delta(bitmap: list[int], count: int) -> enc.Delta:
    return enc.Delta(
        enc.Encoding.BITMAP,
        N,
        torch.bfloat16,
        count,
        values=torch.full((count,), 9, dtype=torch.int16),
        bitmap=torch.tensor(bitmap, dtype=torch.uint8),
    )


@pytest.mark.parametrize(
    ("delta", "why"),
    [
        (bitmap_delta([1, 0, 0, 0], 1), "bytes"),  # N = 40 needs 5 bytes
        (bitmap_delta([1, 0, 0, 0, 0, 0], 1), "bytes"),
        (bitmap_delta([3, 0, 0, 0, 0], 1), "sets 2 bits"),
        (bitmap_delta([1, 0, 0, 0, 0], 2), "sets 1 bits"),
    ],
)
def test_bad_bitmaps(delta: enc.Delta, why: str) -> None:
    _, target = base_and_target()
    assert why in refused(target, delta).message


def test_bitmap_bits_past_the_end() -> None:
    target = torch.zeros(11, dtype=torch.bfloat16)  # 2 bytes, 5 bits of the last unused
    delta = enc.Delta(
        enc.Encoding.BITMAP,
        11,
        torch.bfloat16,
        1,
        values=torch.ones(1, dtype=torch.int16),
        bitmap=torch.tensor([0, 0b1000], dtype=torch.uint8),
    )
    with pytest.raises(WeightwireError, match="past element 11") as info:
        enc.apply_delta(target, delta)
    assert info.value.reason == "INVALID_DELTA"
    assert target.eq(0).all()


MUTATIONS = ["past-end", "negative", "duplicate", "swap", "drop-value", "extra-value"]


@settings(max_examples=60, deadline=None)
@given(
    changed=st.lists(st.integers(0, N - 1), min_size=2, max_size=N, unique=True).map(sorted),
    mutation=st.sampled_from(MUTATIONS),
    where=st.integers(0, 10**6),
)
def test_any_corrupted_indices_delta_is_refused_without_a_write(
    changed: list[int], mutation: str, where: int
) -> None:
    i = where % len(changed)
    idx, nvalues = list(changed), len(changed)
    if mutation == "past-end":
        idx[i] = N + where % 5
    elif mutation == "negative":
        idx[i] = -1 - where % 5
    elif mutation == "duplicate":
        idx[i] = idx[i - 1] if i else idx[1]
    elif mutation == "swap":
        j = (i + 1) % len(idx)
        idx[i], idx[j] = idx[j], idx[i]
    elif mutation == "drop-value":
        nvalues -= 1
    else:
        nvalues += 1
    _, target = base_and_target()
    refused(target, indices_delta(idx, values=torch.full((nvalues,), 3, dtype=torch.int16)))


# ---------------------------------------------------------------------------------------------
# From the wire: the message's offsets and counts against the payload
# ---------------------------------------------------------------------------------------------


def packed(fraction_idx: list[int]) -> tuple[pb.TensorDelta, torch.Tensor]:
    old, _ = base_and_target()
    new = old.clone()
    new[fraction_idx] += 1
    delta = enc.encode(old, new)
    buf = torch.zeros(wire.packed_size_bytes(delta, 0), dtype=torch.uint8)
    return wire.pack_delta(delta, buf, 0), buf


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda m: setattr(m, "values_offset_bytes", 10**9), "outside the payload"),
        (lambda m: setattr(m, "values_offset_bytes", -2), "outside the payload"),
        (lambda m: setattr(m, "changed_count", N + 1), r"outside \[0, 40\]"),
        (lambda m: setattr(m, "changed_count", -1), r"outside \[0, 40\]"),
        (lambda m: setattr(m, "changed_count", 30), "outside the payload"),
        (lambda m: setattr(m, "encoding", pb.DELTA_ENCODING_UNSPECIFIED), "not one this worker knows"),
        (lambda m: setattr(m, "encoding", 77), "not one this worker knows"),
        (lambda m: setattr(m, "index_dtype", pb.DTYPE_UNSPECIFIED), "DTYPE_INT32 or DTYPE_INT64"),
        (lambda m: setattr(m, "index_dtype", pb.DTYPE_FLOAT32), "DTYPE_INT32 or DTYPE_INT64"),
        (lambda m: setattr(m, "values_offset_bytes", 0), "overlap"),
    ],
)
def test_bad_wire_messages(change: object, why: str) -> None:
    msg, buf = packed([5])
    assert msg.encoding == pb.DELTA_ENCODING_INDICES
    change(msg)  # type: ignore[operator]
    with pytest.raises(WeightwireError, match=why) as info:
        wire.read_delta(msg, torch.bfloat16, N, buf, 0, tensor="w")
    assert info.value.reason == "INVALID_DELTA" and info.value.code == "INVALID_ARGUMENT"


def test_bitmap_outside_the_payload_and_int32_for_a_huge_target() -> None:
    msg, buf = packed(list(range(0, N, 3)))
    assert msg.encoding == pb.DELTA_ENCODING_BITMAP
    with pytest.raises(WeightwireError, match="outside the payload of 3"):
        wire.read_delta(msg, torch.bfloat16, N, buf[:3], 0)
    big = pb.TensorDelta(encoding=pb.DELTA_ENCODING_INDICES, changed_count=0, index_dtype=pb.DTYPE_INT32)
    with pytest.raises(WeightwireError, match="int32 indices cannot address"):
        wire.read_delta(big, torch.bfloat16, 2**31, buf, 0)


def test_a_refused_wire_delta_leaves_the_target_whole() -> None:
    msg, buf = packed([5])
    assert msg.encoding == pb.DELTA_ENCODING_INDICES
    buf[0:4] = torch.tensor([200, 0, 0, 0], dtype=torch.uint8)  # first index 200 > N
    delta = wire.read_delta(msg, torch.bfloat16, N, buf, 0, tensor="w")
    _, target = base_and_target()
    refused(target, delta)


# ---------------------------------------------------------------------------------------------
# The worker's checks: the base, and the result
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "worker", "consistent"), [(4, 5, True), (5, 4, True), (4, 0, True), (4, 4, False)]
)
def test_a_base_the_worker_does_not_hold(base: int, worker: int, consistent: bool) -> None:
    with pytest.raises(WeightwireError) as info:
        verify.check_base(base, worker, consistent=consistent)
    assert info.value.reason == "DELTA_BASE_MISMATCH" and info.value.code == "FAILED_PRECONDITION"
    assert info.value.metadata == {"base_version": str(base), "worker_version": str(worker)}
    verify.check_base(7, 7, consistent=True)


def result_checksums(
    t: torch.Tensor, algorithm: int, piece: tuple[int, int, int] | None = None
) -> pb.DeltaChecksum:
    view = t if piece is None else t.narrow(*piece)
    msg = pb.DeltaChecksum(checksum=pb.Checksum(algorithm=algorithm, value=ck.checksum(view, algorithm)))  # type: ignore[arg-type]
    if piece is not None:
        msg.piece.CopyFrom(pb.TensorPiece(dim=piece[0], offset=piece[1], length=piece[2]))
    return msg


@pytest.mark.parametrize("algorithm", [pb.CHECKSUM_ALGORITHM_CRC32, pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64])
def test_a_result_that_drifted_is_caught(algorithm: int) -> None:
    trainer = torch.arange(24, dtype=torch.float32).view(4, 6).to(torch.bfloat16)
    sums = [result_checksums(trainer, algorithm), result_checksums(trainer, algorithm, (0, 2, 2))]
    assert verify.verify_result(sums, [(None, trainer.clone())], tensor="w") == 1
    # a worker that keeps rows 2..3 only (its tensor-parallel piece)
    assert verify.verify_result(sums, [((0, 2, 2), trainer[2:4].clone())], tensor="w") == 1
    drifted = trainer.clone()
    drifted[3, 5] = -drifted[3, 5]
    with pytest.raises(WeightwireError) as info:
        verify.verify_result(sums, [((0, 2, 2), drifted[2:4])], tensor="w")
    assert info.value.reason == "DELTA_RESULT_MISMATCH" and info.value.code == "DATA_LOSS"
    with pytest.raises(WeightwireError, match="no result checksum for the part") as missing:
        verify.verify_result(sums, [((0, 0, 2), trainer[:2])], tensor="w")
    assert missing.value.reason == "INVALID_DELTA"
    unspecified = [pb.DeltaChecksum(checksum=pb.Checksum(value=1))]
    with pytest.raises(WeightwireError, match="without an algorithm"):
        verify.verify_result(unspecified, [(None, trainer)])


@pytest.mark.parametrize("lookup_table", [False, True], ids=["bitwise_count", "table"])
def test_bitmap_count_with_and_without_numpy_bitwise_count(
    lookup_table: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy < 2 has no bitwise_count: the table gives the same count, and the same refusal."""
    if lookup_table:
        monkeypatch.setattr(enc, "_BITWISE_COUNT", None)
    assert enc.NumpyOps().popcount(torch.tensor([0xFF, 0x01, 0x80, 0], dtype=torch.uint8)) == 10
    _, target = base_and_target()
    assert "sets 2 bits" in refused(target, bitmap_delta([3, 0, 0, 0, 0], 1)).message
