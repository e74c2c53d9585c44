"""Spec and size checks from tables: each failure has its own reason, huge shapes fail cleanly."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import OwnedTensor
from weightwire.server.rules.validation import (
    MAX_BYTES,
    check_against_manifest,
    check_in_bounds,
    check_payload_size,
    check_spec,
)
from weightwire.v1 import weight_transfer_pb2 as pb

F32, BF16 = pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16


def spec(
    name: str = "w", dtype: int = F32, shape: tuple[int, ...] = (2, 3), offset: int = 0
) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, dtype=dtype, shape=list(shape), offset_bytes=offset)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("s", "nbytes", "torch_dtype"),
    [
        (spec(), 24, torch.float32),
        (spec(dtype=BF16, shape=(4,), offset=2), 8, torch.bfloat16),
        (spec(shape=()), 4, torch.float32),  # a scalar
        (spec(shape=(0, 5)), 0, torch.float32),  # empty is valid
        (spec(shape=(0, 2**62)), 0, torch.float32),  # a zero dim makes any other bounded dim harmless
        (spec(shape=(2**62, 0)), 0, torch.float32),  # ... in either order
        (spec(shape=(1,) * 32), 4, torch.float32),  # MAX_DIMS dimensions
        (spec(dtype=pb.DTYPE_BOOL, shape=(3,), offset=1), 3, torch.bool),
        (spec(offset=2), 24, torch.float32),  # misaligned offsets are legal (imported with a copy)
    ],
)
def test_valid_specs(s: pb.TensorSpec, nbytes: int, torch_dtype: torch.dtype) -> None:
    checked = check_spec(s)
    assert (checked.nbytes, checked.torch_dtype, checked.shape) == (nbytes, torch_dtype, tuple(s.shape))
    assert checked.end_bytes == s.offset_bytes + nbytes


@pytest.mark.parametrize(
    ("s", "reason"),
    [
        (spec(name=""), "MALFORMED_STREAM"),
        (spec(dtype=pb.DTYPE_UNSPECIFIED), "DTYPE_UNSPECIFIED"),
        (spec(dtype=999), "DTYPE_UNSPECIFIED"),  # unknown enum value from a newer sender
        (spec(shape=(2, -1)), "INVALID_SHAPE"),
        (spec(shape=(-(2**63),)), "INVALID_SHAPE"),
        (spec(shape=(2**31, 2**31, 2**31)), "INVALID_SHAPE"),  # product overflows int64
        (spec(shape=(2**61,)), "INVALID_SHAPE"),  # 2**63 bytes of float32
        (spec(shape=(2**62 - 1, 2**62 - 1, 2**62 - 1, 2**62 - 1)), "INVALID_SHAPE"),
        (spec(shape=(0, 2**63 - 1)), "INVALID_SHAPE"),  # a dimension out of range, even next to a zero
        (spec(shape=(2**63 - 1, 0)), "INVALID_SHAPE"),  # ... in either order
        (spec(shape=(1,) * 33), "INVALID_SHAPE"),  # more than MAX_DIMS dimensions
        (spec(offset=-1), "INVALID_OFFSET"),
        (spec(offset=2**63 - 1), "INVALID_OFFSET"),
    ],
)
def test_invalid_specs(s: pb.TensorSpec, reason: str) -> None:
    with pytest.raises(WeightwireError) as e:
        check_spec(s)
    assert e.value.reason == reason
    assert e.value.code == "INVALID_ARGUMENT"


def test_largest_shape_is_accepted_and_offset_plus_size_stays_in_int64() -> None:
    checked = check_spec(spec(dtype=pb.DTYPE_UINT8, shape=(2**62,), offset=MAX_BYTES))
    assert checked.end_bytes == 2**63
    with pytest.raises(WeightwireError) as e:
        check_in_bounds(checked, MAX_BYTES)
    assert e.value.reason == "TENSOR_OUT_OF_BOUNDS"


@pytest.mark.parametrize(
    ("offset", "shape", "size_bytes", "ok"),
    [
        (0, (2, 3), 24, True),  # ends exactly at the end
        (8, (4,), 24, True),
        (4, (2, 3), 24, False),  # one element past the end
        (0, (2, 3), 23, False),
        (24, (0,), 24, True),  # empty tensor at the very end
        (0, (1,), 0, False),
    ],
)
def test_bounds(offset: int, shape: tuple[int, ...], size_bytes: int, ok: bool) -> None:
    checked = check_spec(spec(shape=shape, offset=offset))
    if ok:
        check_in_bounds(checked, size_bytes)
    else:
        with pytest.raises(WeightwireError) as e:
            check_in_bounds(checked, size_bytes)
        assert e.value.reason == "TENSOR_OUT_OF_BOUNDS"
        assert "'w'" in e.value.message


@pytest.mark.parametrize(
    ("size", "ok"), [(0, True), (10, True), (MAX_BYTES, True), (-1, False), (MAX_BYTES + 1, False)]
)
def test_payload_size(size: int, ok: bool) -> None:
    payload = pb.Payload(size_bytes=size)
    if ok:
        check_payload_size(payload, 0)
    else:
        with pytest.raises(WeightwireError) as e:
            check_payload_size(payload, 0)
        assert e.value.reason == "INVALID_SIZE"


@pytest.mark.parametrize(
    ("s", "owned", "reason"),
    [
        (spec(), OwnedTensor("w", F32, (2, 3)), None),
        (spec(dtype=BF16), OwnedTensor("w", F32, (2, 3)), "DTYPE_MISMATCH"),
        (spec(shape=(3, 2)), OwnedTensor("w", F32, (2, 3)), "SHAPE_MISMATCH"),  # same numel, other shape
        (
            spec(shape=(1, 3)),
            OwnedTensor("w", F32, (2, 3)),
            "SHAPE_MISMATCH",
        ),  # a TP slice instead of the full tensor
        (spec(shape=(2, 3, 1)), OwnedTensor("w", F32, (2, 3)), "SHAPE_MISMATCH"),
    ],
)
def test_against_manifest(s: pb.TensorSpec, owned: OwnedTensor, reason: str | None) -> None:
    checked = check_spec(s)
    if reason is None:
        check_against_manifest(checked, owned)
        return
    with pytest.raises(WeightwireError) as e:
        check_against_manifest(checked, owned)
    assert e.value.reason == reason
    assert e.value.code == "FAILED_PRECONDITION"
    assert e.value.metadata["tensor"] == "w"


@settings(deadline=None, database=None)
@given(st.lists(st.sampled_from([0, 1, 3, 2**20, 2**40, 2**62, 2**62 + 1, 2**63 - 1]), max_size=5))
def test_shape_verdict_does_not_depend_on_dimension_order(shape: list[int]) -> None:
    def verdict(dims: tuple[int, ...]) -> str:
        try:
            return f"ok {check_spec(spec(shape=dims)).nbytes}"
        except WeightwireError as e:
            return e.reason

    verdicts = {verdict(p) for p in itertools.permutations(shape)}
    assert len(verdicts) == 1, (shape, verdicts)
