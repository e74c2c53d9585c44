"""Delta encodings: apply(old, encode(old, new)) equals new bit for bit, for every dtype and density.

Property tests (hypothesis) over the contract's dtypes, densities from no change to every element,
shapes with zero elements, strided views on both sides, both kernel sets (numpy on the host, the
torch kernels a CUDA tensor uses), and the round trip through a payload's bytes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from weightwire.core.delta import encoding as enc
from weightwire.core.delta import wire

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
OPS = {"numpy": enc.NumpyOps(), "torch": enc.TorchOps()}


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor whose elements are arbitrary bit patterns (NaN payloads, -0.0, infinities included)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    bits = enc.bits_dtype(dtype)
    info = torch.iinfo(bits)
    raw = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(bits)
    return raw.view(dtype)


def changed_copy(old: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    new = old.clone()
    if old.numel() == 0:
        return new
    mask = torch.rand(old.shape, generator=gen) < fraction
    fresh = random_bits(tuple(old.shape), old.dtype, gen)
    as_bits_new = enc.as_bits(new)
    as_bits_new[mask] = enc.as_bits(fresh)[mask]
    return new


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(enc.as_bits(a.contiguous()), enc.as_bits(b.contiguous()))


shapes = st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple)


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    fraction=st.sampled_from([0.0, 0.01, 0.03, 0.1, 0.3, 0.6, 0.95, 1.0]) | st.floats(0, 1),
    ops=st.sampled_from(sorted(OPS)),
    seed=st.integers(0, 2**31 - 1),
)
def test_apply_of_encode_is_new(
    dtype: torch.dtype, shape: tuple[int, ...], fraction: float, ops: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    old = random_bits(shape, dtype, gen)
    new = changed_copy(old, fraction, gen)
    delta = enc.encode(old, new, ops=OPS[ops])
    changed = int((enc.as_bits(old) != enc.as_bits(new)).sum())
    assert delta.changed_count == (old.numel() if delta.encoding is enc.Encoding.DENSE else changed)
    assert delta.encoding is enc.choose_encoding(old.numel(), changed, old.element_size())
    target = old.clone()
    enc.apply_delta(target, delta, ops=OPS[ops])
    assert bits_equal(target, new)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 7),
    cols=st.integers(1, 7),
    fraction=st.floats(0, 1),
    ops=st.sampled_from(sorted(OPS)),
    seed=st.integers(0, 2**31 - 1),
)
def test_strided_views_on_both_sides(
    dtype: torch.dtype, rows: int, cols: int, fraction: float, ops: str, seed: int
) -> None:
    """Non-contiguous old/new (a transpose, a step slice) and a non-contiguous target: row-major
    order of the logical tensor throughout, and only the view's elements written."""
    gen = torch.Generator().manual_seed(seed)
    old_full = random_bits((cols, rows * 2), dtype, gen)
    old = old_full[:, ::2].t()  # (rows, cols), strided
    new_full = old_full.clone()
    new = new_full[:, ::2].t()
    new.copy_(changed_copy(old.contiguous(), fraction, gen))
    assert not old.is_contiguous() or old.numel() <= 1
    delta = enc.encode(old, new, ops=OPS[ops])
    target_full = old_full.clone()
    target = target_full[:, ::2].t()
    enc.apply_delta(target, delta, ops=OPS[ops])
    assert bits_equal(target, new)
    # the elements between the view's columns were not touched
    assert bits_equal(target_full[:, 1::2], old_full[:, 1::2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_signed_zero_and_nan_payloads_are_changes(dtype: torch.dtype) -> None:
    """-0.0 == +0.0 and NaN != NaN as floats; as bits, exactly the elements whose bits differ change."""
    bits = enc.bits_dtype(dtype)
    width = torch.iinfo(bits).bits
    sign = -(1 << (width - 1))  # the sign bit alone: -0.0
    exp_all = {16: 0x7C00 if dtype == torch.float16 else 0x7F80, 32: 0x7F800000, 64: 0x7FF0000000000000}[
        width
    ]
    old_bits = torch.tensor([0, sign, exp_all | 1, exp_all | 1, 5], dtype=torch.int64).to(bits)
    new_bits = torch.tensor([sign, sign, exp_all | 2, exp_all | 1, 5], dtype=torch.int64).to(bits)
    old, new = old_bits.view(dtype), new_bits.view(dtype)
    delta = enc.encode(old, new)
    positions = enc.changed_positions(delta)
    assert positions is not None and positions.tolist() == [0, 2]
    target = old.clone()
    enc.apply_delta(target, delta)
    assert torch.equal(target.view(bits), new_bits)


@pytest.mark.parametrize(
    ("fraction_permille", "expected"),
    [
        (0, enc.Encoding.INDICES),
        (10, enc.Encoding.INDICES),
        (30, enc.Encoding.INDICES),
        (100, enc.Encoding.BITMAP),
        (900, enc.Encoding.BITMAP),
        (1000, enc.Encoding.DENSE),
    ],
)
def test_density_picks_the_smallest_for_bf16(fraction_permille: int, expected: enc.Encoding) -> None:
    n = 1_000_000
    changed = n * fraction_permille // 1000
    assert enc.choose_encoding(n, changed, 2) is expected
    sizes = {e: enc.encoded_size_bytes(e, n, changed, 2) for e in enc.Encoding}
    assert sizes[expected] == min(sizes.values())


def test_a_target_of_2_31_elements_needs_int64_indices() -> None:
    assert enc.index_dtype_for(2**31 - 1) == torch.int32
    assert enc.index_dtype_for(2**31) == torch.int64


@settings(max_examples=50, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    fraction=st.floats(0, 1),
    lead=st.integers(0, 13),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_through_payload_bytes(
    dtype: torch.dtype, shape: tuple[int, ...], fraction: float, lead: int, seed: int
) -> None:
    """pack_delta into a buffer at any (also misaligned) offset, read_delta back, apply: new exactly."""
    gen = torch.Generator().manual_seed(seed)
    old = random_bits(shape, dtype, gen)
    new = changed_copy(old, fraction, gen)
    delta = enc.encode(old, new)
    size = wire.packed_size_bytes(delta, lead)
    buffer = torch.full((lead + size + 3,), 0xAB, dtype=torch.uint8)
    msg = wire.pack_delta(delta, buffer, lead)
    assert buffer[:lead].eq(0xAB).all() and buffer[lead + size :].eq(0xAB).all()
    back = wire.read_delta(msg, dtype, old.numel(), buffer, lead, tensor="t")
    target = old.clone()
    enc.apply_delta(target, back, tensor="t")
    assert bits_equal(target, new)


@settings(max_examples=100, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 700),
    fraction=st.floats(0, 1),
    clustered=st.booleans(),
    threads=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_host_chunks(
    dtype: torch.dtype, n: int, fraction: float, clustered: bool, threads: int, seed: int
) -> None:
    """The host's chunked encode and apply, with chunks of 16 elements, on one thread or on three
    ranges in parallel: results equal the torch kernels' (one mask of the whole tensor), also when
    the changes sit in a dense prefix (a range gives its indices up, and they still win overall)."""
    gen = torch.Generator().manual_seed(seed)
    old = random_bits((n,), dtype, gen)
    if clustered:
        new = old.clone()
        head = round(n * fraction * 0.1)
        enc.as_bits(new)[:head] = enc.as_bits(changed_copy(old[:head].clone(), 1.0, gen))
    else:
        new = changed_copy(old, fraction, gen)
    saved = enc.HOST_CHUNK_ELEMENTS, enc.host_threads
    enc.HOST_CHUNK_ELEMENTS, enc.host_threads = 16, lambda: threads
    try:
        host = enc.encode(old, new, ops=OPS["numpy"])
        target = old.clone()
        enc.apply_delta(target, host, ops=OPS["numpy"])
    finally:
        enc.HOST_CHUNK_ELEMENTS, enc.host_threads = saved
    ref = enc.encode(old, new, ops=OPS["torch"])
    assert (host.encoding, host.changed_count) == (ref.encoding, ref.changed_count)
    for part in ("values", "indices", "bitmap"):
        a, b = getattr(host, part), getattr(ref, part)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), part
    assert bits_equal(target, new)


@pytest.mark.parametrize("fraction", [0.01, 0.2, 1.0])
def test_parameters_that_require_grad(fraction: float) -> None:
    """A trainer's parameters (and a model's, on the worker) require grad: raw-bit views do not, so
    encode, apply and the checksums work on them as they are, outside torch.no_grad()."""
    from weightwire.core.delta import checksums

    gen = torch.Generator().manual_seed(0)
    old = torch.nn.Parameter(torch.randn(40, 8, generator=gen).to(torch.bfloat16))
    new = torch.nn.Parameter(changed_copy(old.detach(), fraction, gen))
    delta = enc.encode(old, new)
    enc.apply_delta(old, delta)
    assert bits_equal(old.detach(), new.detach()) and old.requires_grad
    assert checksums.crc32(old) == checksums.crc32(new.detach())
    assert checksums.weighted_sum64(old) == checksums.weighted_sum64(new.detach())


def test_indices_found_again_when_a_range_gave_them_up() -> None:
    """12 changes in the first of three ranges: that range drops its indices (12 x 4 bytes > its
    30 bitmap bytes), but over the whole tensor INDICES is smallest, so they come from the bitmap."""
    old = torch.zeros(700, dtype=torch.bfloat16)
    new = old.clone()
    new[:12] = 1
    saved = enc.HOST_CHUNK_ELEMENTS, enc.host_threads
    enc.HOST_CHUNK_ELEMENTS, enc.host_threads = 16, lambda: 3
    try:
        delta = enc.encode(old, new, ops=OPS["numpy"])
    finally:
        enc.HOST_CHUNK_ELEMENTS, enc.host_threads = saved
    assert delta.encoding is enc.Encoding.INDICES
    assert delta.indices is not None and delta.indices.tolist() == list(range(12))
    assert delta.indices.dtype == torch.int32
