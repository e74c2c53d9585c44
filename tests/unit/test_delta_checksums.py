"""Result checksums: CRC-32 equals zlib's over the row-major bytes, the weighted sum equals its
definition (Python integers, modulo 2^64), its update from changed elements equals a full pass,
and one changed element always changes it."""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from weightwire.core.delta import checksums as ck
from weightwire.core.delta import encoding as enc
from weightwire.v1 import weight_transfer_pb2 as pb

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.int8,
    torch.bool,
]


def reference_weighted_sum(t: torch.Tensor) -> int:
    width = 8 * t.element_size()
    bits = enc.as_bits(t.contiguous()).reshape(-1).tolist()
    total = sum((2 * i + 1) * (b % (1 << width)) for i, b in enumerate(bits)) % (1 << 64)
    return total - (1 << 64) if total >= 1 << 63 else total


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    info = torch.iinfo(enc.bits_dtype(dtype))
    return (
        torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64)
        .to(enc.bits_dtype(dtype))
        .view(dtype)
    )


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(0, 12),
    cols=st.integers(1, 12),
    seed=st.integers(0, 2**31),
)
def test_weighted_sum_is_its_definition_across_chunks(
    dtype: torch.dtype, rows: int, cols: int, seed: int
) -> None:
    t = random_tensor((rows, cols), dtype, seed)
    saved = ck._CHUNK_HOST
    try:
        ck._CHUNK_HOST = 7  # several chunks, and a last one that is short
        assert ck.weighted_sum64(t) == reference_weighted_sum(t)
        assert ck.weighted_sum64(t.t()) == reference_weighted_sum(t.t())  # strided: row-major of the view
    finally:
        ck._CHUNK_HOST = saved
    assert ck.weighted_sum64(t) == reference_weighted_sum(t)


def test_weighted_sum_of_64_bit_elements_with_every_bit_set() -> None:
    t = torch.full((5,), -1, dtype=torch.int64)
    assert ck.weighted_sum64(t) == reference_weighted_sum(t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_crc32_is_zlib_over_row_major_bytes(dtype: torch.dtype) -> None:
    t = random_tensor((6, 5), dtype, 3)
    assert ck.crc32(t) == zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes())
    assert ck.crc32(t.t()) == zlib.crc32(t.t().contiguous().view(torch.uint8).numpy().tobytes())
    assert ck.checksum(t, pb.CHECKSUM_ALGORITHM_CRC32) == ck.crc32(t)
    with pytest.raises(ValueError):
        ck.checksum(t, pb.CHECKSUM_ALGORITHM_UNSPECIFIED)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 200),
    fraction=st.floats(0, 1),
    seed=st.integers(0, 2**31),
)
def test_update_from_changes_equals_a_full_pass(
    dtype: torch.dtype, n: int, fraction: float, seed: int
) -> None:
    old = random_tensor((n,), dtype, seed)
    new = old.clone()
    gen = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(n, generator=gen) < fraction
    enc.as_bits(new)[mask] = enc.as_bits(random_tensor((n,), dtype, seed + 2))[mask]
    delta = enc.encode(old, new)
    positions = enc.changed_positions(delta)
    if positions is None:
        positions = torch.arange(n)
    updated = ck.weighted_sum64_update(
        ck.weighted_sum64(old), positions, enc.as_bits(old)[positions], enc.as_bits(new)[positions]
    )
    assert updated == ck.weighted_sum64(new)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 300),
    where=st.integers(0, 10**6),
    seed=st.integers(0, 2**31),
)
def test_one_changed_element_always_changes_the_sum(
    dtype: torch.dtype, n: int, where: int, seed: int
) -> None:
    t = random_tensor((n,), dtype, seed)
    u = t.clone()
    bits = enc.as_bits(u)
    i = where % n
    bits[i] = bits[i] ^ 1 if dtype != torch.bool else 1 - bits[i]
    assert ck.weighted_sum64(u) != ck.weighted_sum64(t)
    assert ck.crc32(u) != ck.crc32(t)
    assert ck.crc32c(u) != ck.crc32c(t)


def test_preferred_algorithm() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert ck.preferred_algorithm(cuda, ["cuda:0", "cuda:1"]) == pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64
    assert ck.preferred_algorithm(cuda, ["cuda:0", "cpu"]) == pb.CHECKSUM_ALGORITHM_CRC32
    assert ck.preferred_algorithm(cpu, ["cuda:0"]) == pb.CHECKSUM_ALGORITHM_CRC32
    assert ck.preferred_algorithm(cpu, []) == pb.CHECKSUM_ALGORITHM_CRC32


def test_crc32c_is_castagnolis_crc_of_the_row_major_bytes() -> None:
    # the check value of CRC-32C (RFC 3720's polynomial) over the ASCII digits 1-9
    digits = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert ck.crc32c(digits) == 0xE3069283
    t = random_tensor((6, 5), torch.bfloat16, 4)
    assert ck.crc32c(t.t()) == ck.crc32c(t.t().contiguous())
    assert ck.checksum(t, pb.CHECKSUM_ALGORITHM_CRC32C) == ck.crc32c(t)


@pytest.mark.parametrize("algorithm", [pb.CHECKSUM_ALGORITHM_CRC32, pb.CHECKSUM_ALGORITHM_CRC32C])
def test_a_running_crc_over_pieces_equals_the_whole(algorithm: int) -> None:
    t = random_tensor((1000,), torch.bfloat16, 5)
    bits = enc.as_bits(t).numpy()
    running = ck.running_crc(algorithm)  # type: ignore[arg-type]
    assert running is not None
    value = 0
    for start in range(0, 1000, 300):
        value = running(bits[start : start + 300], value)
    assert value == ck.checksum(t, algorithm)  # type: ignore[arg-type]
    assert ck.running_crc(pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64) is None


def test_crc32c_only_when_every_recipient_lists_it() -> None:
    new = ck.VERIFIED_ALGORITHMS
    old: tuple[int, ...] = ()  # a worker from before ShardManifest.delta_checksum_algorithms
    assert ck.crc_algorithm([new, new]) == pb.CHECKSUM_ALGORITHM_CRC32C
    assert ck.crc_algorithm([new, old]) == pb.CHECKSUM_ALGORITHM_CRC32
    assert ck.crc_algorithm([(pb.CHECKSUM_ALGORITHM_CRC32,)]) == pb.CHECKSUM_ALGORITHM_CRC32
    assert ck.crc_algorithm([]) == pb.CHECKSUM_ALGORITHM_CRC32
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert ck.preferred_algorithm(cpu, ["cpu"], [new]) == pb.CHECKSUM_ALGORITHM_CRC32C
    assert ck.preferred_algorithm(cuda, ["cuda:0"], [new]) == pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64
    # a CUDA recipient that does not list the weighted sum gets the best CRC it lists
    crcs_only = (pb.CHECKSUM_ALGORITHM_CRC32C, pb.CHECKSUM_ALGORITHM_CRC32)
    assert ck.preferred_algorithm(cuda, ["cuda:0"], [new, crcs_only]) == pb.CHECKSUM_ALGORITHM_CRC32C
    assert ck.preferred_algorithm(cuda, ["cuda:0"], [old]) == pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64


def test_a_delta_update_takes_the_weighted_sum_only_from_and_into_cuda() -> None:
    from weightwire.client.update.delta import checksum_algorithm
    from weightwire.core.devices import DeviceRef
    from weightwire.core.manifest import ParallelRank, ShardManifest

    def manifest(device: DeviceRef) -> ShardManifest:
        return ShardManifest(
            engine="torch", worker_id="w", rank=ParallelRank(), device=device, tensors={},
            layer_start=0, layer_end=1, num_layers=1,
            delta_checksum_algorithms=ck.VERIFIED_ALGORITHMS,
        )  # fmt: skip

    gpu, host = manifest(DeviceRef.cuda("00000000-0000-0000-0000-000000000001")), manifest(DeviceRef.host())
    on_host = [("w", torch.zeros(4))]
    # CUDA sources (the GPU branch) run in tests/gpu/test_cuda_deltas.py; here the host's
    assert checksum_algorithm(on_host, {"a": gpu}) == pb.CHECKSUM_ALGORITHM_CRC32C
    assert checksum_algorithm(on_host, {"a": host}) == pb.CHECKSUM_ALGORITHM_CRC32C
    assert checksum_algorithm([], {"a": gpu}) == pb.CHECKSUM_ALGORITHM_CRC32C


def test_a_process_without_the_crc32c_package_neither_lists_nor_sends_crc32c() -> None:
    # crc32c is a compiled dependency an engine image may leave out: weightwire must import without
    # it and fall back to CRC32 on both sides. sys.modules[name] = None makes its import fail.
    script = """
import sys
sys.modules["crc32c"] = None
import torch
from weightwire.core.delta import checksums as ck
from weightwire.v1 import weight_transfer_pb2 as pb
crc32c = pb.CHECKSUM_ALGORITHM_CRC32C
assert crc32c not in ck.VERIFIED_ALGORITHMS, ck.VERIFIED_ALGORITHMS
assert pb.CHECKSUM_ALGORITHM_CRC32 in ck.VERIFIED_ALGORITHMS
assert ck.crc_algorithm([(crc32c, pb.CHECKSUM_ALGORITHM_CRC32)]) == pb.CHECKSUM_ALGORITHM_CRC32
assert ck.running_crc(crc32c) is None
try:
    ck.crc32c(torch.ones(4))
except RuntimeError as e:
    assert "crc32c" in str(e)
else:
    raise AssertionError("crc32c without its package")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
