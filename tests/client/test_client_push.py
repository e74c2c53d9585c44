"""WeightPusher end to end against a TP=2 x PP=2 engine of real ``weightwire serve`` processes on
CPU: full and partial pushes over host shared memory and inline bytes, flat buffers, gathered
buckets whose labels include devices that are not this host's, and every client-side refusal
(nothing is sent: the workers' counters and versions do not move). Parameter contents are checked
bit for bit through the workers' dump files."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator

import pytest
import torch
from engines import CONFIG, Engine, dump_exists, layout, shard_mismatches, start_engine
from weightwire.adapters.torch.demo import expected_shard, full_checkpoint
from weightwire.client import (
    FlatBucket,
    GatheredBucket,
    PlanError,
    PushError,
    WeightPusher,
    layout_flat,
    pack_into,
)
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = start_engine(layout(tp=2, pp=2), tmp_path_factory.mktemp("dumps"))
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def pusher(engine: Engine) -> Iterator[WeightPusher]:
    # Small buckets so even the demo model spans several buckets per stage.
    with WeightPusher(engine.addresses, bucket_size_bytes=32 * 1024, timeout_s=60) as p:
        yield p


_versions = itertools.count(1)


def next_version(pusher: WeightPusher) -> int:
    """A version above every worker's current one (tests share the engine)."""
    current = max(s.weights_version for s in pusher.status().values())
    v = next(_versions)
    while v <= current:
        v = next(_versions)
    return v


def counters(pusher: WeightPusher) -> dict[str, tuple[int, int, int]]:
    return {a: (s.weights_version, s.updates_succeeded, s.updates_failed) for a, s in pusher.status().items()}


def test_full_push_lands_every_shard_exactly(engine: Engine, pusher: WeightPusher) -> None:
    manifests = pusher.manifests()
    assert sorted(m.worker_id for m in manifests.values()) == ["tp0-pp0", "tp0-pp1", "tp1-pp0", "tp1-pp1"]
    for _ in range(2):
        v = next_version(pusher)
        full = full_checkpoint(CONFIG, seed=v)
        seen: list[int] = []
        results = pusher.push(
            full.items(), version=v, progress=lambda p, seen=seen: seen.append(p.buckets_done)
        )
        assert set(results) == set(engine.addresses)
        for addr, r in results.items():
            m = manifests[addr]
            assert (r.version, r.state, r.transport) == (v, "CONSISTENT", "host_shm")
            assert r.tensors_loaded == len(m.tensors)
            assert r.buckets >= 2 and r.handles_opened >= 1
            assert r.duration_s > 0 and r.gbps > 0
        assert shard_mismatches(engine.dump_dir, manifests, full, v) == {}
        assert seen == list(range(1, len(seen) + 1)) and len(seen) >= 4


def test_buckets_go_only_to_owning_stage(engine: Engine, pusher: WeightPusher) -> None:
    base = next_version(pusher)
    pusher.push(full_checkpoint(CONFIG, seed=base), version=base)
    v = next_version(pusher)
    new = full_checkpoint(CONFIG, seed=v)
    first_stage = {
        n: t
        for n, t in new.items()
        if n.startswith(("model.embed_tokens.", "model.layers.0.", "model.layers.1."))
    }
    results = pusher.push(first_stage, version=v, scope="partial")
    manifests = pusher.manifests()
    for addr, r in results.items():
        m = manifests[addr]
        assert r.version == v  # every worker commits the version...
        if m.rank.pp_rank == 0:
            assert r.buckets >= 1 and r.tensors_loaded == len(m.tensors)
        else:  # ...but the last stage got no bucket at all
            assert r.buckets == 0 and r.tensors_loaded == 0
    mixed = {**full_checkpoint(CONFIG, seed=base), **first_stage}
    assert shard_mismatches(engine.dump_dir, manifests, mixed, v) == {}


def test_inline_transport(engine: Engine) -> None:
    with WeightPusher(engine.addresses, transport="inline", bucket_size_bytes=64 * 1024) as p:
        v = next_version(p)
        full = full_checkpoint(CONFIG, seed=v)
        results = p.push(full, version=v, verify_checksums=True)
        assert {r.transport for r in results.values()} == {"inline"}
        assert shard_mismatches(engine.dump_dir, p.manifests(), full, v) == {}


def test_tensor_larger_than_a_bucket_gets_its_own(engine: Engine) -> None:
    # 4 KiB buckets; the embedding and lm_head are 64 KiB each.
    with WeightPusher(engine.addresses, bucket_size_bytes=4096) as p:
        v = next_version(p)
        full = full_checkpoint(CONFIG, seed=v)
        p.push(full, version=v, verify_checksums=True)
        assert shard_mismatches(engine.dump_dir, p.manifests(), full, v) == {}


def _flat_stage(
    full: dict[str, torch.Tensor], manifests: dict[str, ShardManifest], pp_rank: int
) -> list[tuple[str, torch.Tensor]]:
    owned = {n for m in manifests.values() if m.rank.pp_rank == pp_rank for n in m.tensors}
    return [(n, t) for n, t in full.items() if n in owned]


def test_push_flat_from_shared_memory_without_copy_and_from_plain_memory(
    engine: Engine, pusher: WeightPusher
) -> None:
    manifests = pusher.manifests()
    v = next_version(pusher)
    full = full_checkpoint(CONFIG, seed=v)
    buckets = []
    for pp_rank in (0, 1):
        named = _flat_stage(full, manifests, pp_rank)
        specs, size = layout_flat(named)
        if pp_rank == 0:
            # An "all-gather output" living in the pusher's shared memory: exported in place. Put it
            # at an offset inside the buffer to check offsets are rebased.
            backing = pusher.host_buffer(size + 1024)
            buf = backing[1024 : 1024 + size]
        else:
            buf = torch.empty(size, dtype=torch.uint8)  # ordinary memory: copied once into staging
        pack_into(buf, specs, [t for _, t in named])
        buckets.append(FlatBucket(buf, specs))
    results = pusher.push_flat(buckets, version=v)
    for addr, r in results.items():
        assert r.buckets == 1 and r.tensors_loaded == len(manifests[addr].tensors)
    assert shard_mismatches(engine.dump_dir, manifests, full, v) == {}


def test_push_flat_of_the_same_buckets_again_is_checked_for_what_changed(
    engine: Engine, pusher: WeightPusher
) -> None:
    # The client remembers which exact spec objects, manifests, scope and sizes already passed its
    # checks; new contents go through, and a change in scope, size or specs is still refused.
    manifests = pusher.manifests()
    full = full_checkpoint(CONFIG, seed=1)
    layouts = [layout_flat(_flat_stage(full, manifests, pp)) for pp in (0, 1)]
    buckets = [FlatBucket(pusher.host_buffer(size), specs) for specs, size in layouts]
    for _ in range(2):
        v = next_version(pusher)
        full = full_checkpoint(CONFIG, seed=v)
        for b, pp in zip(buckets, (0, 1), strict=True):
            pack_into(b.buffer, b.specs, [t for _, t in _flat_stage(full, manifests, pp)])
        pusher.push_flat(buckets, version=v)
        assert shard_mismatches(engine.dump_dir, manifests, full, v) == {}
    before = counters(pusher)
    stage0 = buckets[:1]
    pusher.push_flat(stage0, version=next_version(pusher), scope="partial")
    with pytest.raises(PlanError) as incomplete:
        pusher.push_flat(stage0, version=next_version(pusher))  # the same objects, now FULL
    assert incomplete.value.reason == "INCOMPLETE_UPDATE"
    specs0 = buckets[0].specs
    with pytest.raises(PlanError) as bounds:
        pusher.push_flat(
            [FlatBucket(buckets[0].buffer[:-1], specs0), buckets[1]], version=next_version(pusher)
        )
    assert bounds.value.reason == "TENSOR_OUT_OF_BOUNDS"
    wrong = [
        dataclasses.replace(specs0[0], shape=(*specs0[0].shape[:-1], specs0[0].shape[-1] + 1)),
        *specs0[1:],
    ]
    with pytest.raises(PlanError) as shape:
        pusher.push_flat([FlatBucket(buckets[0].buffer, wrong), buckets[1]], version=next_version(pusher))
    assert shape.value.reason == "SHAPE_MISMATCH"
    after = counters(pusher)
    assert {a: c[1:] for a, c in after.items()} == {
        a: (c[1] + 1, c[2]) for a, c in before.items()
    }  # only the partial push ran


def test_gathered_payloads_each_worker_picks_its_own(engine: Engine, pusher: WeightPusher) -> None:
    """One bucket, three labelled copies: a GPU that is not here, another machine's host memory (a
    real segment holding the WRONG weights) and this host's shared memory. Every worker must import
    this host's copy and only it."""
    manifests = pusher.manifests()
    v = next_version(pusher)
    full = full_checkpoint(CONFIG, seed=v)
    decoy = full_checkpoint(CONFIG, seed=v + 1000)
    specs, size = layout_flat(list(full.items()))

    mine = pusher.host_buffer(size)
    pack_into(mine, specs, list(full.values()))
    wrong = pusher.host_buffer(size)
    pack_into(wrong, specs, list(decoy.values()))
    other_host = pusher.export_payload(wrong)
    other_host.device.CopyFrom(DeviceRef.host("11111111-2222-3333-4444-555555555555").to_proto())
    other_gpu = pb.Payload(
        device=DeviceRef.cuda("GPU-6a4c1c0e-0000-4000-8000-00000000beef").to_proto(),
        size_bytes=size,
        cuda_ipc=pb.CudaIpcHandle(
            memory_handle=b"\x01" * 64, storage_size_bytes=size, ref_counter_handle=b"/torch_1_elsewhere"
        ),
    )
    results = pusher.push_gathered([GatheredBucket(specs, [other_gpu, other_host, mine], size)], version=v)
    for addr, r in results.items():
        assert r.tensors_loaded == len(manifests[addr].tensors)
        assert r.handles_opened == 1 and r.transport == "host_shm"
        assert r.source_devices == (str(DeviceRef.host()),) and r.peer_device_imports == 0
    assert shard_mismatches(engine.dump_dir, manifests, full, v) == {}


def test_gathered_bucket_without_own_label_is_refused(engine: Engine, pusher: WeightPusher) -> None:
    manifests = pusher.manifests()
    v = next_version(pusher)
    full = full_checkpoint(CONFIG, seed=v)
    specs, size = layout_flat(list(full.items()))
    buf = pusher.host_buffer(size)
    pack_into(buf, specs, list(full.values()))
    foreign = pusher.export_payload(buf)
    foreign.device.CopyFrom(DeviceRef.host("99999999-0000-0000-0000-000000000000").to_proto())
    bucket = GatheredBucket(specs, [foreign], size)
    before = counters(pusher)

    with pytest.raises(PlanError) as plan_err:  # the client sees it first
        pusher.push_gathered([bucket], version=v)
    assert plan_err.value.reason == "NO_PAYLOAD_FOR_DEVICE"
    assert counters(pusher) == before

    with pytest.raises(PushError) as push_err:  # the workers refuse it on their own too
        pusher.push_gathered([bucket], version=v, precheck_labels=False)
    failures = push_err.value.failures
    assert set(failures) == set(engine.addresses) and not push_err.value.results
    refused = {a for a, e in failures.items() if e.reason == "NO_PAYLOAD_FOR_DEVICE"}
    assert refused and all(e.reason == "CANCELLED" for a, e in failures.items() if a not in refused)
    for a in refused:
        assert failures[a].code == "FAILED_PRECONDITION"
        assert DeviceRef.host().uuid in failures[a].message
    statuses = pusher.status()
    for a, st in statuses.items():
        assert st.weights_version == before[a][0]
        assert st.state == pb.WORKER_STATE_CONSISTENT
        assert not dump_exists(engine.dump_dir, manifests[a].worker_id, v)


# --------------------------------------------------------------------------------------------
# Client-side refusals: nothing reaches any worker
# --------------------------------------------------------------------------------------------


def _refused(pusher: WeightPusher, named: object, **kw: object) -> PlanError:
    before = counters(pusher)
    with pytest.raises(PlanError) as e:
        pusher.push(named, version=next_version(pusher), **kw)  # type: ignore[arg-type]
    assert counters(pusher) == before, "a refused plan must not reach any worker"
    # The push opened its streams while it planned and cancelled them: give the workers longer than
    # they wait to tell a cancel from a clean end (0.5 s), then check that none recorded anything.
    time.sleep(0.8)
    assert counters(pusher) == before, "a stream cancelled before its header must leave no trace"
    return e.value


def test_unknown_name_is_refused_before_sending(pusher: WeightPusher) -> None:
    full = full_checkpoint(CONFIG, seed=1)
    err = _refused(pusher, {**full, "model.layers.99.mlp.up_proj.weight": torch.zeros(2)})
    assert err.reason == "UNKNOWN_TENSOR" and "model.layers.99.mlp.up_proj.weight" in err.message


def test_allow_unowned_skips_names_nobody_owns(engine: Engine, pusher: WeightPusher) -> None:
    v = next_version(pusher)
    full = full_checkpoint(CONFIG, seed=v)
    pusher.push({**full, "optimizer.lr": torch.tensor(1e-4)}, version=v, allow_unowned=True)
    assert shard_mismatches(engine.dump_dir, pusher.manifests(), full, v) == {}


@pytest.mark.parametrize("prefix", ["_fsdp_wrapped_module.", "module."])
def test_wrapper_prefix_is_refused_with_the_stripped_name(pusher: WeightPusher, prefix: str) -> None:
    full = full_checkpoint(CONFIG, seed=1)
    err = _refused(pusher, {prefix + n: t for n, t in full.items()})
    assert err.reason == "UNKNOWN_TENSOR"
    assert f"{prefix}model.embed_tokens.weight -> model.embed_tokens.weight" in err.message


def test_dtype_mismatch_is_refused(pusher: WeightPusher) -> None:
    full = full_checkpoint(CONFIG, seed=1)
    full["model.layers.2.mlp.down_proj.weight"] = full["model.layers.2.mlp.down_proj.weight"].to(
        torch.bfloat16
    )
    err = _refused(pusher, full)
    assert err.reason == "DTYPE_MISMATCH" and "model.layers.2.mlp.down_proj.weight" in err.message


def test_shape_mismatch_is_refused(pusher: WeightPusher) -> None:
    full = full_checkpoint(CONFIG, seed=1)
    manifests = pusher.manifests()
    tp0 = next(m for m in manifests.values() if m.rank.tp_rank == 0 and m.rank.pp_rank == 0)
    # The trainer pushes a TP shard where the full checkpoint tensor is expected.
    full["model.layers.0.self_attn.q_proj.weight"] = expected_shard(full, tp0.rank, CONFIG)[
        "model.layers.0.self_attn.q_proj.weight"
    ]
    err = _refused(pusher, full)
    assert err.reason == "SHAPE_MISMATCH" and "model.layers.0.self_attn.q_proj.weight" in err.message


def test_full_update_missing_names_is_refused(pusher: WeightPusher) -> None:
    full = full_checkpoint(CONFIG, seed=1)
    del full["lm_head.weight"], full["model.layers.3.input_layernorm.weight"]
    err = _refused(pusher, full)
    assert err.reason == "INCOMPLETE_UPDATE"
    assert err.metadata["missing"] == "lm_head.weight,model.layers.3.input_layernorm.weight"
    assert "tp0-pp1" in err.message and "tp1-pp1" in err.message and "tp0-pp0" not in err.message


def test_stale_version_fails_on_every_worker_with_its_reason(pusher: WeightPusher) -> None:
    v = next_version(pusher)
    pusher.push(full_checkpoint(CONFIG, seed=v), version=v)
    with pytest.raises(PushError) as e:
        pusher.push(full_checkpoint(CONFIG, seed=1), version=v)
    reasons = {err.reason for err in e.value.failures.values()}
    assert "STALE_VERSION" in reasons and reasons <= {"STALE_VERSION", "CANCELLED"}
    assert "STALE_VERSION" in str(e.value)


def test_shared_memory_is_released_on_close(engine: Engine) -> None:
    import os

    def ours() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"ww-{os.getpid()}-")}

    before = ours()
    p = WeightPusher(engine.addresses, bucket_size_bytes=16 * 1024)
    v = next_version(p)
    results = p.push(full_checkpoint(CONFIG, seed=v), version=v)
    assert sum(r.buckets for r in results.values()) > 8
    # Many buckets (and tensors bigger than one), yet only the two double-buffering segments exist.
    assert len(ours() - before) == 2
    p.host_buffer(4096)
    assert len(ours() - before) == 3
    p.close()
    assert ours() == before


@pytest.mark.parametrize("workers", ["all", "one"])
def test_a_push_lets_go_of_the_callers_tensors_when_it_returns(engine: Engine, workers: str) -> None:
    # Freed by reference counting alone, with the garbage collector off: a trainer that pushes
    # fresh tensors every step (a cast, a gather) must not hold a model's worth of memory per push
    # until the next cycle pass (on a GPU that showed as memory creeping over many updates).
    import gc
    import weakref

    addresses = engine.addresses if workers == "all" else engine.addresses[:1]
    with WeightPusher(addresses, bucket_size_bytes=32 * 1024, timeout_s=60) as p:
        gc.collect()
        gc.disable()
        try:
            alive: list[weakref.ref[torch.Tensor]] = []
            for _ in range(3):
                v = next_version(p)
                full = full_checkpoint(CONFIG, seed=v)
                if workers == "one":
                    owned = set(p.manifests()[addresses[0]].tensors)
                    full = {k: t for k, t in full.items() if k in owned}
                alive.extend(weakref.ref(t) for t in full.values())
                results = p.push(full, version=v, scope="full" if workers == "all" else "partial")
                assert {r.version for r in results.values()} == {v}
                del full
            assert [r() for r in alive if r() is not None] == []
        finally:
            gc.enable()
