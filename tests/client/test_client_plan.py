"""Pure client-side planning and staging: pre-send checks against manifests, bucket layout and
routing, packing, shared-memory staging buffers and their pool. No server involved."""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import torch
from weightwire.client.inputs.plan import (
    PlanError,
    TensorSpec,
    check_update,
    layout_flat,
    owners_by_name,
    pack_into,
    plan_buckets,
    strip_wrapper_prefixes,
)
from weightwire.client.transports import exporter as exp
from weightwire.client.update.staging import StagingPool
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

FULL = pb.UPDATE_SCOPE_FULL
PARTIAL = pb.UPDATE_SCOPE_PARTIAL


def manifest(
    worker_id: str, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], **rank: int
) -> ShardManifest:
    return ShardManifest.build(
        DeviceRef.host(),
        ParallelRank(**rank),
        [OwnedTensor(n, dtypes.from_torch(d), s) for n, (d, s) in tensors.items()],
        worker_id=worker_id,
    )


F32 = torch.float32
# Two pipeline stages, each with two tensor-parallel ranks; "shared" lives on both stages.
MANIFESTS = {
    "w00": manifest(
        "tp0-pp0",
        {
            "model.embed_tokens.weight": (F32, (8, 4)),
            "model.layers.0.w": (F32, (4, 4)),
            "shared": (F32, (2,)),
        },
        tp_size=2,
        pp_size=2,
    ),
    "w10": manifest(
        "tp1-pp0",
        {
            "model.embed_tokens.weight": (F32, (8, 4)),
            "model.layers.0.w": (F32, (4, 4)),
            "shared": (F32, (2,)),
        },
        tp_rank=1,
        tp_size=2,
        pp_size=2,
    ),
    "w01": manifest(
        "tp0-pp1",
        {"model.layers.1.w": (F32, (4, 4)), "lm_head.weight": (F32, (8, 4)), "shared": (F32, (2,))},
        tp_size=2,
        pp_rank=1,
        pp_size=2,
    ),
    "w11": manifest(
        "tp1-pp1",
        {"model.layers.1.w": (F32, (4, 4)), "lm_head.weight": (F32, (8, 4)), "shared": (F32, (2,))},
        tp_rank=1,
        tp_size=2,
        pp_rank=1,
        pp_size=2,
    ),
}
ALL = [
    TensorSpec("model.embed_tokens.weight", F32, (8, 4)),
    TensorSpec("model.layers.0.w", F32, (4, 4)),
    TensorSpec("model.layers.1.w", F32, (4, 4)),
    TensorSpec("lm_head.weight", F32, (8, 4)),
    TensorSpec("shared", F32, (2,)),
]


def test_full_update_that_fits_passes() -> None:
    assert check_update(ALL, MANIFESTS, scope=FULL) == []


def test_unknown_name_is_refused_with_its_name() -> None:
    with pytest.raises(PlanError) as e:
        check_update([*ALL, TensorSpec("model.layers.9.w", F32, (4, 4))], MANIFESTS, scope=FULL)
    assert e.value.reason == "UNKNOWN_TENSOR"
    assert "model.layers.9.w" in e.value.message
    assert "allow_unowned" in e.value.message


@pytest.mark.parametrize("prefix", ["_fsdp_wrapped_module.", "module."])
def test_wrapper_prefix_gets_a_hint_with_the_stripped_name(prefix: str) -> None:
    specs = [TensorSpec(prefix + s.name, s.dtype, s.shape) for s in ALL]
    with pytest.raises(PlanError) as e:
        check_update(specs, MANIFESTS, scope=FULL)
    assert e.value.reason == "UNKNOWN_TENSOR"
    assert f"{prefix}model.layers.0.w -> model.layers.0.w" in e.value.message
    assert prefix.rstrip(".") in e.value.message


def test_lm_head_of_a_tied_engine_model_is_refused_with_the_tie_named() -> None:
    """A tied Hugging Face model's state_dict carries lm_head.weight; a tied engine fills it from the
    embedding and owns no such name."""
    tied = {a: m for a, m in MANIFESTS.items() if a.endswith("0")}
    specs = [s for s in ALL if s.name != "model.layers.1.w"]
    with pytest.raises(PlanError) as e:
        check_update(specs, tied, scope=FULL)
    assert e.value.reason == "UNKNOWN_TENSOR"
    assert "ties its output layer to model.embed_tokens.weight" in e.value.message, e.value.message
    assert "leave it out of the push" in e.value.message


def test_allow_unowned_returns_the_names_to_skip() -> None:
    extra = TensorSpec("optimizer.step", torch.int64, ())
    assert check_update([*ALL, extra], MANIFESTS, scope=FULL, allow_unowned=True) == ["optimizer.step"]


def test_dtype_mismatch_names_tensor_and_worker() -> None:
    specs = [s if s.name != "lm_head.weight" else TensorSpec(s.name, torch.bfloat16, s.shape) for s in ALL]
    with pytest.raises(PlanError) as e:
        check_update(specs, MANIFESTS, scope=FULL)
    assert e.value.reason == "DTYPE_MISMATCH"
    assert "lm_head.weight: pushed dtype bfloat16" in e.value.message
    assert "expects float32" in e.value.message


def test_shape_mismatch_tells_the_full_shape() -> None:
    # A TP shard pushed instead of the full checkpoint tensor.
    specs = [s if s.name != "model.embed_tokens.weight" else TensorSpec(s.name, F32, (4, 4)) for s in ALL]
    with pytest.raises(PlanError) as e:
        check_update(specs, MANIFESTS, scope=FULL)
    assert e.value.reason == "SHAPE_MISMATCH"
    assert "pushed shape [4, 4]" in e.value.message and "[8, 4]" in e.value.message


def test_full_scope_lists_missing_names_per_worker() -> None:
    specs = [s for s in ALL if s.name != "lm_head.weight"]
    with pytest.raises(PlanError) as e:
        check_update(specs, MANIFESTS, scope=FULL)
    assert e.value.reason == "INCOMPLETE_UPDATE"
    assert e.value.metadata["missing"] == "lm_head.weight"
    assert "tp0-pp1" in e.value.message and "tp1-pp1" in e.value.message
    assert "tp0-pp0" not in e.value.message
    # The same subset is a valid PARTIAL update.
    assert check_update(specs, MANIFESTS, scope=PARTIAL) == []


def test_name_pushed_twice_is_refused() -> None:
    with pytest.raises(PlanError) as e:
        check_update([*ALL, ALL[0]], MANIFESTS, scope=FULL)
    assert e.value.reason == "DUPLICATE_TENSOR"


def test_strip_wrapper_prefixes() -> None:
    assert (
        strip_wrapper_prefixes("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.w")
        == "model.layers.0.mlp.w"
    )
    assert strip_wrapper_prefixes("module._orig_mod.lm_head.weight") == "lm_head.weight"
    assert strip_wrapper_prefixes("model.norm.weight") == "model.norm.weight"


def test_buckets_route_only_to_owners_and_group_by_owner_set() -> None:
    plans = plan_buckets(ALL, owners_by_name(MANIFESTS), bucket_bytes=1 << 20, align_bytes=256)
    by_recipients = {p.recipients: [s.name for s in p.specs] for p in plans}
    assert by_recipients == {
        ("w00", "w10"): ["model.embed_tokens.weight", "model.layers.0.w"],
        ("w01", "w11"): ["model.layers.1.w", "lm_head.weight"],
        ("w00", "w01", "w10", "w11"): ["shared"],
    }


def test_buckets_are_bounded_aligned_and_big_tensors_get_their_own() -> None:
    specs = [TensorSpec(f"t{i}", F32, (100,)) for i in range(10)] + [TensorSpec("big", F32, (1000,))]
    owners = {s.name: ("w",) for s in specs}
    plans = plan_buckets(specs, owners, bucket_bytes=1024, align_bytes=256)
    for p in plans:
        assert all(s.offset_bytes % 256 == 0 for s in p.specs)
        ends = [s.offset_bytes + s.nbytes for s in p.specs]
        assert p.size_bytes == max(ends)
        if [s.name for s in p.specs] == ["big"]:
            assert p.size_bytes == 4000
        else:
            assert p.size_bytes <= 1024
        # no two tensors overlap
        spans = sorted((s.offset_bytes, s.offset_bytes + s.nbytes) for s in p.specs)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert sorted(n for p in plans for n in (s.name for s in p.specs)) == sorted(s.name for s in specs)
    assert (
        sum(1 for p in plans if len(p.specs) == 2) == 5
    )  # 400 B tensors: two per 1 KiB bucket (256-aligned)


def test_unowned_tensors_are_not_planned() -> None:
    plans = plan_buckets([TensorSpec("x", F32, (2,))], {}, bucket_bytes=64)
    assert plans == []


def test_pack_roundtrip_every_dtype() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [
        ("f32", torch.randn(3, 5, generator=gen)),
        ("bf16", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("i64", torch.arange(6).reshape(2, 3)),
        ("bool", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(3.5, dtype=torch.float64)),
        ("strided", torch.randn(4, 6, generator=gen).t()),  # not contiguous
        ("empty", torch.empty(0, 4)),
    ]
    specs, size = layout_flat(tensors, align_bytes=64)
    buf = torch.zeros(size, dtype=torch.uint8)
    pack_into(buf, specs, [t for _, t in tensors])
    for spec, (_, t) in zip(specs, tensors, strict=True):
        view = buf.narrow(0, spec.offset_bytes, spec.nbytes).view(spec.dtype).view(spec.shape)
        assert torch.equal(view, t)
        assert spec.offset_bytes % 64 == 0


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"ww-{os.getpid()}-")}


def test_shm_segment_is_created_private_and_unlinked() -> None:
    before = _shm_names()
    seg = exp.ShmSegment(4096)
    path = f"/dev/shm/{seg.name}"
    assert os.stat(path).st_mode & 0o777 == 0o600
    seg.tensor()[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    with open(path, "rb") as f:
        assert f.read(4) == bytes([1, 2, 3, 4])
    seg.close()
    seg.close()  # idempotent
    assert _shm_names() == before


def test_shm_exporter_wraps_views_of_its_own_segments_only() -> None:
    exporter = exp.HostShmExporter()
    try:
        seg = exporter.allocate(1024)
        view = seg.tensor()[256:512]
        wrapped = exporter.wrap(view)
        assert wrapped is not None and wrapped.base_offset_bytes == 256
        payload = exporter.export(wrapped, 512, exporter.label)  # type: ignore[arg-type]
        assert payload.host_shm.name == seg.name and payload.size_bytes == 512
        assert payload.device == DeviceRef.host().to_proto()
        assert exporter.wrap(torch.zeros(16, dtype=torch.uint8)) is None  # ordinary memory: must be copied
    finally:
        exporter.close()


def test_auto_transport() -> None:
    here = DeviceRef.host()
    elsewhere = DeviceRef.host("0f0f0f0f-0000-0000-0000-000000000000")
    cpu = torch.device("cpu")
    assert exp.choose_transport([here, here], cpu) == "host_shm"
    assert exp.choose_transport([here, elsewhere], cpu) == "inline"


def test_staging_pool_reuses_waits_and_grows_bounded() -> None:
    before = _shm_names()
    exporter = exp.HostShmExporter()
    pool = StagingPool(exporter, bucket_bytes=1024, depth=2)
    never = lambda: False  # noqa: E731
    deadline = time.monotonic() + 30
    try:
        a = pool.acquire(100, never, deadline)
        b = pool.acquire(1024, never, deadline)
        assert a is not b and a.capacity_bytes == 1024
        got: list[exp.StagingBuffer] = []
        waiter = threading.Thread(target=lambda: got.append(pool.acquire(10, never, deadline)))
        waiter.start()
        waiter.join(0.2)
        assert not got  # both buffers are in flight: the third acquire must wait for a release
        pool.release(a)
        waiter.join(10)
        assert got == [a]  # reused, not a new segment
        pool.release(a)
        big = pool.acquire(5000, never, deadline)  # bigger than a bucket: a free buffer is replaced
        assert big.capacity_bytes >= 5000 and big is not a
        assert len([s for s in exporter._segments if not s._closed]) <= 2
        pool.release(big)
        pool.release(b)
    finally:
        pool.close()
        exporter.close()
    assert _shm_names() == before
