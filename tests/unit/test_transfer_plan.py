"""The M-to-N transfer plan: every element each worker keeps arrives exactly once, from a trainer
rank that holds it, and nothing else arrives; the plan is the same whatever order its inputs come
in; missing coverage and mismatched tensors are refused with a reason."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest, TensorPiece
from weightwire.core.transports.transfer_plan import (
    Replicate,
    Shard,
    TensorSpec,
    TransferPlanError,
    byte_runs,
    dtensor_box,
    kept_boxes,
    plan_transfers,
)
from weightwire.v1 import weight_transfer_pb2 as pb

HOST = DeviceRef.host("b0070000-0000-0000-0000-000000000000")
F32 = pb.DTYPE_FLOAT32


def manifest(worker: str, tensors: list[OwnedTensor]) -> ShardManifest:
    return ShardManifest.build(HOST, ParallelRank(), tensors, worker_id=worker, instance_id=worker)


def region(shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def check_exact(specs: list[TensorSpec], workers: dict[str, ShardManifest]) -> None:
    """Receive the plan into per-worker counters: each kept element exactly once, nothing else;
    each transfer's box inside what its source holds; bytes per worker == its kept bytes."""
    plan = plan_transfers(specs, workers)
    by_name = {s.name: s for s in specs}
    got = {(w, s.name): torch.zeros(s.shape, dtype=torch.int32) for w in workers for s in specs}
    for t in plan.transfers:
        held = by_name[t.tensor].holdings[t.source]
        assert all(ha <= a < b <= hb for (a, b), (ha, hb) in zip(t.box, held, strict=True)), t
        for w in t.destinations:
            got[w, t.tensor][region(by_name[t.tensor].shape, t.box)] += 1
    for w, m in workers.items():
        for s in specs:
            want = torch.zeros(s.shape, dtype=torch.int32)
            if s.name in m.tensors:
                for box in kept_boxes(m.tensors[s.name]):
                    want[region(s.shape, box)] += 1
            assert torch.equal(got[w, s.name], want), (w, s.name)
    sent = plan.bytes_to()
    for w, m in workers.items():
        assert sent.get(w, 0) == sum(m.tensors[s.name].kept_bytes for s in specs if s.name in m.tensors)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[TensorSpec], dict[str, ShardManifest]]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    placements = [
        draw(st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, ndim - 1)))) for _ in mesh
    ]
    spec = TensorSpec.dtensor("w", shape, F32, mesh, placements)
    specs = [spec, TensorSpec.whole_on("b", (draw(st.integers(1, 5)),), F32, [draw(st.integers(0, 3))])]
    workers = {}
    for i in range(draw(st.integers(1, 4))):
        tensors = []
        dim = draw(st.integers(0, ndim - 1))
        cuts = sorted({*draw(st.lists(st.integers(0, shape[dim]), max_size=4)), 0, shape[dim]})
        spans = [(a, b) for a, b in itertools.pairwise(cuts) if draw(st.booleans())]
        pieces = tuple(TensorPiece(dim, a, b - a) for a, b in spans)
        if spans or draw(st.booleans()):
            tensors.append(OwnedTensor("w", F32, shape, pieces))
        if draw(st.booleans()):
            tensors.append(OwnedTensor("b", F32, specs[1].shape))
        workers[f"w{i}"] = manifest(f"w{i}", tensors)
    return specs, workers


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_kept_element_arrives_exactly_once_from_a_holder(
    layout: tuple[list[TensorSpec], dict[str, ShardManifest]],
) -> None:
    check_exact(*layout)


def test_fsdp_ranks_into_tp_workers_with_a_replica() -> None:
    """4 FSDP ranks (Shard(0)) into TP2 x 2 replicas: column and row slices of a 2-D weight, a
    replicated norm; each worker gets its slices from the ranks holding them, a region needed by
    both replicas is one transfer to both."""
    specs = [
        TensorSpec.dtensor("col", (8, 6), F32, (4,), [Shard(0)]),
        TensorSpec.dtensor("row", (8, 6), F32, (4,), [Shard(0)]),
        TensorSpec.dtensor("norm", (6,), F32, (4,), [Shard(0)]),
    ]
    workers = {}
    for replica, tp in itertools.product(range(2), range(2)):
        workers[f"r{replica}-tp{tp}"] = manifest(
            f"r{replica}-tp{tp}",
            [
                OwnedTensor("col", F32, (8, 6), (TensorPiece(0, 4 * tp, 4),)),
                OwnedTensor("row", F32, (8, 6), (TensorPiece(1, 3 * tp, 3),)),
                OwnedTensor("norm", F32, (6,)),
            ],
        )
    check_exact(specs, workers)
    plan = plan_transfers(specs, workers)
    col = [t for t in plan.transfers if t.tensor == "col"]
    assert sorted((t.source, t.destinations) for t in col) == [
        (0, ("r0-tp0", "r1-tp0")),
        (1, ("r0-tp0", "r1-tp0")),
        (2, ("r0-tp1", "r1-tp1")),
        (3, ("r0-tp1", "r1-tp1")),
    ]
    # Every rank sends: no funnel.
    assert set(plan.bytes_from()) == {0, 1, 2, 3}


def test_replicas_among_trainer_ranks_share_the_sending() -> None:
    """Eight whole tensors held by all four ranks (DDP): each rank sends two."""
    specs = [TensorSpec.whole_on(f"t{i}", (16,), F32, range(4)) for i in range(8)]
    workers = {"w": manifest("w", [OwnedTensor(f"t{i}", F32, (16,)) for i in range(8)])}
    plan = plan_transfers(specs, workers)
    assert plan.bytes_from() == {r: 2 * 64 for r in range(4)}


def test_the_plan_does_not_depend_on_input_order() -> None:
    specs = [TensorSpec.dtensor(f"t{i}", (8, 4), F32, (2, 2), [Shard(0), Shard(1)]) for i in range(5)]
    names = [f"w{i}" for i in range(3)]
    workers = {
        n: manifest(n, [OwnedTensor(f"t{i}", F32, (8, 4), (TensorPiece(0, 2 * j, 2),)) for i in range(5)])
        for j, n in enumerate(names)
    }
    first = plan_transfers(specs, workers)
    rng = random.Random(7)
    for _ in range(3):
        shuffled_specs = specs[:]
        rng.shuffle(shuffled_specs)
        order = names[:]
        rng.shuffle(order)
        again = plan_transfers(shuffled_specs, {n: workers[n] for n in order})
        assert again == first
    moved = dict(workers)
    moved["w0"] = manifest(
        "w0", [OwnedTensor(f"t{i}", F32, (8, 4), (TensorPiece(0, 2, 2),)) for i in range(5)]
    )
    assert plan_transfers(specs, moved).fingerprint != first.fingerprint


def test_a_region_no_rank_holds_is_refused_naming_tensor_worker_and_bytes() -> None:
    spec = TensorSpec.dtensor("w", (8, 4), F32, (4,), [Shard(0)])
    holes = TensorSpec("w", spec.shape, F32, {r: b for r, b in spec.holdings.items() if r != 2})
    workers = {
        "a": manifest("a", [OwnedTensor("w", F32, (8, 4), (TensorPiece(0, 0, 4),))]),
        "b": manifest("b", [OwnedTensor("w", F32, (8, 4), (TensorPiece(0, 4, 4),))]),
    }
    plan_transfers([spec], workers)
    with pytest.raises(TransferPlanError) as e:
        plan_transfers([holes], workers)
    assert e.value.kind is Reason.INCOMPLETE_UPDATE
    assert (e.value.worker, e.value.metadata) == ("b", {"tensor": "w", "missing_bytes": str(2 * 4 * 4)})
    # Worker a keeps only what ranks 0 and 1 hold: without rank 2 it is still covered.
    assert plan_transfers([holes], {"a": workers["a"]}).bytes_to() == {"a": 64}
    nobody = TensorSpec("w", spec.shape, F32, {})
    with pytest.raises(TransferPlanError, match="no trainer rank holds any"):
        plan_transfers([nobody], workers)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (TensorSpec.whole_on("w", (8, 5), F32, [0]), Reason.SHAPE_MISMATCH),
        (TensorSpec.whole_on("w", (8, 4), pb.DTYPE_BFLOAT16, [0]), Reason.DTYPE_MISMATCH),
        (TensorSpec("w", (8, 4), F32, {0: ((0, 9), (0, 4))}), Reason.INVALID_SHAPE),
    ],
)
def test_mismatched_tensors_are_refused(spec: TensorSpec, reason: Reason) -> None:
    workers = {"a": manifest("a", [OwnedTensor("w", F32, (8, 4))])}
    with pytest.raises(TransferPlanError) as e:
        plan_transfers([spec], workers)
    assert e.value.kind is reason


@pytest.mark.parametrize(
    ("shape", "mesh", "placements"),
    [
        ((10, 3), (4,), [Shard(0)]),
        ((7, 6), (2, 3), [Shard(0), Shard(1)]),
        ((9,), (2, 2), [Shard(0), Shard(0)]),
        ((5, 4), (3, 2), [Replicate(), Shard(1)]),
        ((2, 2), (4,), [Shard(0)]),
    ],
)
def test_dtensor_boxes_follow_torch_chunking(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: list
) -> None:
    """Each rank's box equals the local tensor torch.chunk makes, placement after placement."""
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for coord in itertools.product(*(range(n) for n in mesh)):
        local = full
        for size, p, i in zip(mesh, placements, coord, strict=True):
            if isinstance(p, Shard):
                chunks = torch.chunk(local, size, dim=p.dim)
                local = chunks[i] if i < len(chunks) else local.narrow(p.dim, 0, 0)
        box = dtensor_box(shape, mesh, placements, coord)
        if local.numel() == 0:
            assert box is None
        else:
            assert box is not None and torch.equal(full[region(shape, box)], local), coord


@pytest.mark.parametrize(
    "box", [((1, 3), (0, 4), (2, 5)), ((0, 2), (0, 4), (0, 5)), ((1, 2), (1, 2), (0, 5))]
)
def test_byte_runs_cover_exactly_the_box(box: tuple[tuple[int, int], ...]) -> None:
    shape = (3, 4, 5)
    flat = torch.arange(60, dtype=torch.int32)
    want = flat.reshape(shape)[region(shape, box)].flatten()
    runs = byte_runs(box, shape, 4)
    raw = flat.view(torch.uint8)
    got = torch.cat([raw[o : o + n] for o, n in runs]).view(torch.int32)
    assert torch.equal(got, want)
    if box[1:] == ((0, 4), (0, 5)):
        assert len(runs) == 1
