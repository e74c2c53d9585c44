"""Transfer-group plans from tables: group ranks from full identities (never stage-local), broadcast
subgroups from equal ownership, every spec rule, finding one's own rank, byte ranges and tags."""

from __future__ import annotations

import dataclasses

import pytest
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest
from weightwire.core.transports.transfer_group_plan import (
    MAX_RANGES,
    MemberIdentity,
    check_ranges,
    check_spec,
    message_tag,
    own_rank,
    plan_group,
    split_address,
)
from weightwire.v1 import weight_transfer_pb2 as pb

F32 = pb.DTYPE_FLOAT32
STAGE_TENSORS = {
    0: ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"],
    1: ["model.layers.1.mlp.up_proj.weight", "lm_head.weight"],
}


def manifest(
    tp: int, pp: int, dp: int = 0, *, dp_size: int = 2, instance: str | None = None
) -> ShardManifest:
    rank = ParallelRank(tp_rank=tp, tp_size=2, pp_rank=pp, pp_size=2, dp_rank=dp, dp_size=dp_size)
    tensors = [OwnedTensor(n, F32, (4, 4)) for n in STAGE_TENSORS[pp]]
    return ShardManifest.build(
        DeviceRef.host("b00t"),
        rank,
        tensors,
        worker_id=f"tp{tp}-pp{pp}-dp{dp}",
        instance_id=instance or f"i-{tp}{pp}{dp}",
    )


def engine(dp_size: int = 2) -> dict[str, ShardManifest]:
    """TP2 x PP2 per replica, keyed by an address, listed in a scrambled order."""
    out = {
        f"10.0.0.{dp}:{5000 + 10 * pp + tp}": manifest(tp, pp, dp, dp_size=dp_size)
        for dp in range(dp_size)
        for pp in (1, 0)
        for tp in (1, 0)
    }
    return dict(sorted(out.items(), reverse=True))


TRAINER = MemberIdentity.of_trainer(0, "trainer-instance")


def plan(manifests: dict[str, ShardManifest], **kw: object):
    args = dict(
        trainer=TRAINER,
        group_id="g-1",
        backend=pb.TRANSFER_BACKEND_GLOO,
        store_address="10.0.0.9:29500",
        timeout_ms=30_000,
        max_bucket_bytes=1 << 26,
    )
    args.update(kw)
    return plan_group(manifests, **args)  # type: ignore[arg-type]


def test_ranks_follow_replica_stage_tensor_rank() -> None:
    p = plan(engine())
    by_rank = {r: p.spec.members[r] for r in range(p.spec.world_size)}
    assert p.spec.world_size == 9 and by_rank[0].role == pb.TRANSFER_ROLE_TRAINER
    order = [(m.rank.dp_rank, m.rank.pp_rank, m.rank.tp_rank) for m in list(by_rank.values())[1:]]
    assert order == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    # The field bug: rank_offset + tp_rank gives tp0 of both stages the same rank. Here every
    # worker's rank is distinct, and its member entry is its own identity.
    assert len(set(p.ranks.values())) == 8
    for address, m in engine().items():
        member = p.spec.members[p.ranks[address]]
        assert (member.worker_id, member.instance_id) == (m.worker_id, m.instance_id)


def test_subgroups_join_workers_that_own_the_same_tensors() -> None:
    p = plan(engine())
    assert len(p.spec.subgroups) == 2
    for sg in p.spec.subgroups:
        assert sg.root_rank == 0 and sg.member_ranks[0] == 0
        stages = {p.spec.members[r].rank.pp_rank for r in sg.member_ranks[1:]}
        assert len(stages) == 1 and len(sg.member_ranks) == 5  # trainer + 2 TP ranks x 2 replicas
    assert not plan(engine(), broadcast=False).spec.subgroups


def test_same_identity_twice_still_gets_two_ranks_by_instance() -> None:
    # Two replicas that both call themselves dp0 (independent engines) differ by instance id.
    a, b = manifest(0, 0, 0, dp_size=1, instance="aaa"), manifest(0, 0, 0, dp_size=1, instance="bbb")
    p = plan({"x:1": b, "y:1": a})
    assert sorted(p.ranks.values()) == [1, 2] and p.spec.members[1].instance_id == "aaa"


def test_worker_without_instance_id_is_refused() -> None:
    m = dataclasses.replace(manifest(0, 0), instance_id="")
    with pytest.raises(WeightwireError) as e:
        plan({"x:1": m})
    assert e.value.reason == "INVALID_GROUP_SPEC"


def _spec() -> pb.TransferGroupSpec:
    return plan(engine(dp_size=1)).spec


def _mutate(field: str, value: object) -> pb.TransferGroupSpec:
    spec = _spec()
    if field == "dup_rank":
        spec.members[2].group_rank = 1
    elif field == "dup_instance":
        spec.members[2].instance_id = spec.members[1].instance_id
    elif field == "member_role":
        spec.members[1].role = pb.TRANSFER_ROLE_UNSPECIFIED
    elif field == "rank_range":
        spec.members[1].group_rank = 99
    elif field == "bad_root":
        spec.subgroups[0].root_rank = spec.subgroups[0].member_ranks[1]
    elif field == "unsorted_subgroup":
        spec.subgroups[0].member_ranks[:] = list(reversed(spec.subgroups[0].member_ranks))
    elif field == "drop_member":
        del spec.members[-1]
    else:
        setattr(spec, field, value)
    return spec


@pytest.mark.parametrize(
    ("field", "value", "reason", "words"),
    [
        ("group_id", "bad id!", "INVALID_GROUP_SPEC", "group id"),
        ("group_id", "", "INVALID_GROUP_SPEC", "group id"),
        ("group_id", "g-1\n", "INVALID_GROUP_SPEC", "group id"),
        ("backend", pb.TRANSFER_BACKEND_UNSPECIFIED, "INVALID_GROUP_SPEC", "backend"),
        ("store_address", "no-port", "INVALID_GROUP_SPEC", "store address"),
        ("store_address", "host:70000", "INVALID_GROUP_SPEC", "store address"),
        ("store_address", "h" * 300 + ":1", "INVALID_GROUP_SPEC", "at most 256"),
        ("world_size", 6, "INVALID_GROUP_SPEC", "members for world size"),
        ("world_size", 1, "INVALID_GROUP_SPEC", "world size"),
        ("drop_member", None, "INVALID_GROUP_SPEC", "members for world size"),
        ("timeout_ms", 0, "INVALID_GROUP_SPEC", "timeout_ms"),
        ("timeout_ms", 10**9, "INVALID_GROUP_SPEC", "timeout_ms"),
        ("max_bucket_bytes", 0, "INVALID_GROUP_SPEC", "max_bucket_bytes"),
        ("dup_rank", None, "GROUP_DUPLICATE_RANK", "group rank 1"),
        ("dup_instance", None, "INVALID_GROUP_SPEC", "instance id"),
        ("member_role", None, "INVALID_GROUP_SPEC", "role"),
        ("rank_range", None, "INVALID_GROUP_SPEC", "outside"),
        ("bad_root", None, "INVALID_GROUP_SPEC", "root"),
        ("unsorted_subgroup", None, "INVALID_GROUP_SPEC", "ascending"),
    ],
)
def test_spec_rules(field: str, value: object, reason: str, words: str) -> None:
    spec = _mutate(field, value)
    with pytest.raises(WeightwireError) as e:
        check_spec(spec)
    assert e.value.reason == reason and words in e.value.message


def test_a_planned_spec_passes() -> None:
    check_spec(_spec())


def test_own_rank_by_identity() -> None:
    manifests = engine(dp_size=1)
    p = plan(manifests)
    for address, m in manifests.items():
        assert own_rank(p.spec, MemberIdentity.of_worker(m)) == p.ranks[address]
    assert own_rank(p.spec, TRAINER) == 0


def test_own_rank_of_a_restarted_or_changed_worker_is_refused() -> None:
    m = manifest(0, 1, dp_size=1)
    p = plan(engine(dp_size=1))
    restarted = dataclasses.replace(m, instance_id="new-instance")
    with pytest.raises(WeightwireError) as e:
        own_rank(p.spec, MemberIdentity.of_worker(restarted))
    assert e.value.reason == "GROUP_UNKNOWN_MEMBER" and "is not in the plan" in e.value.message
    # Same instance, other identity (a plan that put this process at another stage).
    moved = MemberIdentity.of_worker(
        dataclasses.replace(m, rank=ParallelRank(tp_rank=0, tp_size=2, pp_rank=0, pp_size=2))
    )
    with pytest.raises(WeightwireError) as e:
        own_rank(p.spec, moved)
    assert e.value.reason == "GROUP_UNKNOWN_MEMBER" and "names this process as" in e.value.message


@pytest.mark.parametrize(
    ("ranges", "size", "expected"),
    [
        ([], 100, [(0, 100)]),
        ([], 0, []),
        ([(0, 10), (10, 5), (64, 36)], 100, [(0, 10), (10, 5), (64, 36)]),
    ],
)
def test_ranges_accepted(ranges: list[tuple[int, int]], size: int, expected: list[tuple[int, int]]) -> None:
    msgs = [pb.ByteRange(offset_bytes=o, size_bytes=n) for o, n in ranges]
    assert check_ranges(msgs, size) == expected


@pytest.mark.parametrize(
    "ranges",
    [
        [(0, 0)],
        [(0, 10), (5, 10)],
        [(10, 5), (0, 5)],
        [(90, 11)],
        [(-1, 5)],
        [(i, 1) for i in range(MAX_RANGES + 1)],
    ],
)
def test_ranges_refused(ranges: list[tuple[int, int]]) -> None:
    msgs = [pb.ByteRange(offset_bytes=o, size_bytes=n) for o, n in ranges]
    with pytest.raises(WeightwireError) as e:
        check_ranges(msgs, 2000 if len(ranges) > 100 else 100)
    assert e.value.reason == "INVALID_OFFSET"


def test_tags_are_distinct_per_sequence_and_index_and_fit_31_bits() -> None:
    tags = {message_tag(s, i) for s in range(1, 200) for i in range(MAX_RANGES)}
    assert len(tags) == 199 * MAX_RANGES
    assert max(message_tag(s, MAX_RANGES - 1) for s in (1, 2**40, 2**62)) < 2**31


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.1:29500", ("10.0.0.1", 29500)),
        ("[fd00::1]:1", ("fd00::1", 1)),
        ("trainer-0:29500", ("trainer-0", 29500)),
    ],
)
def test_split_address(address: str, expected: tuple[str, int]) -> None:
    assert split_address(address) == expected
