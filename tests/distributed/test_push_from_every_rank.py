"""``push(fsdp_model.state_dict(), group=...)`` over a transfer group with every trainer rank a source
(issue 27), between real processes over gloo on loopback: 2 and 4 FSDP2 trainer ranks
(``slice_trainer.py``) into real ``weightwire serve`` workers of a TP2 x PP2 engine plus a replica.

Each worker receives exactly its slices (``bytes_received`` == its manifest's kept bytes) and holds
its shard of the checkpoint bit for bit; the group is formed once and reused; refusals (a rank that
plans another update, a FULL update that leaves a tensor out) happen on every rank before a byte
moves; a trainer rank or a worker lost mid-transfer ends every rank with a reason, no worker
commits, and the next push forms a new group and lands.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from group_fleet import CONFIG, Fleet, Member
from helpers import wait_until
from ports import free_port
from slice_ranks import Ranks
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("slices-fleet")
    (root / "sock").mkdir()
    f = Fleet(str(root / "sock"), str(root / "dump"))
    yield f
    f.stop()


@pytest.fixture
def ranks2(fleet: Fleet) -> Iterator[Ranks]:
    r = Ranks(2, fleet.addresses())
    yield r
    r.close()


def kept_bytes(member: Member) -> int:
    manifest = member.stub().GetManifest(pb.GetManifestRequest()).manifest
    assert manifest.receives_slices
    return ShardManifest.from_proto(manifest).kept_bytes


def assert_landed(fleet: Fleet, answers: list[dict[str, Any]], version: int, seed: int) -> None:
    """Every rank returned the same results; every worker got exactly its slices and holds them."""
    assert all(a["ok"] for a in answers), answers
    assert all(a["results"] == answers[0]["results"] for a in answers)
    results = answers[0]["results"]
    full = full_checkpoint(CONFIG, seed)
    for m in fleet.members:
        r = results[m.address]
        assert (r["version"], r["state"], r["transport"]) == (version, "CONSISTENT", "transfer_group")
        assert r["bytes_received"] == r["bytes_loaded"] == kept_bytes(m), m.worker_id
        fleet.assert_holds(m, version, full)


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_sends_and_every_worker_receives_only_its_slices(fleet: Fleet, world: int) -> None:
    ranks = Ranks(world, fleet.addresses())
    try:
        version = fleet.next_version()
        answers = ranks.push(version=version, seed=version)
        assert_landed(fleet, answers, version, version)
        # Rank 0 holds the streams: its progress callback sees every worker's bucket acked, its
        # metrics the committed push; the other ranks' see nothing of the workers.
        total = sum(kept_bytes(m) for m in fleet.members)
        n = len(fleet.members)
        assert answers[0]["progress"][-1] == [n, n, total, total]
        assert [p[0] for p in answers[0]["progress"]] == list(range(1, n + 1))
        assert answers[0]["committed_pushes"] == 1.0
        assert all(a["progress"] == [] for a in answers[1:])
        first = answers[0]["group_id"]
        # The next step reuses the group: no new formation, the same group id on every worker.
        answers = ranks.push(version=version + 1, seed=version + 7)
        assert_landed(fleet, answers, version + 1, version + 7)
        assert {a["group_id"] for a in answers} == {first} and answers[0]["formations"] == 1
        for m in fleet.members:
            tg = m.status().transfer_group
            assert (tg.group_id, tg.world_size) == (first, world + len(fleet.members))
    finally:
        ranks.close()


def test_workers_that_joined_another_group_say_so_and_the_next_push_reforms(
    fleet: Fleet, ranks2: Ranks
) -> None:
    """Another trainer's ranks push in between, so the workers leave this trainer's group for
    theirs. This trainer's next push is refused by the workers themselves (GROUP_NOT_JOINED): that
    reason must reach every rank, not a CANCELLED that blames each worker on itself (the cancel
    used to overtake the refusals); the push after it forms a new group and lands."""
    version = fleet.next_version()
    assert_landed(fleet, ranks2.push(version=version, seed=version), version, version)
    other = Ranks(2, fleet.addresses())
    try:
        assert_landed(fleet, other.push(version=version + 1, seed=version + 1), version + 1, version + 1)
    finally:
        other.close()
    answers = ranks2.push(version=version + 2, seed=version + 2)
    assert not any(a["ok"] for a in answers), answers
    failures = answers[0]["error"]["failures"]
    assert set(failures) == {m.address for m in fleet.members}
    assert "GROUP_NOT_JOINED" in {f["reason"] for f in failures.values()}, failures
    for address, f in failures.items():
        assert f["reason"] in ("GROUP_NOT_JOINED", "CANCELLED"), (address, f)
        if f["reason"] == "CANCELLED":
            assert address not in f["message"].split("because")[-1], (address, f)
    assert all(m.status().weights_version == version + 1 for m in fleet.members)
    assert_landed(fleet, ranks2.push(version=version + 2, seed=version + 2), version + 2, version + 2)


def test_a_fixed_store_port_serves_multi_rank_and_single_source_pushes_in_turn(fleet: Fleet) -> None:
    """One pusher per rank made with ``TransferGroupOptions(host, port=P)``, as docs/distributed.md
    shows: a multi-rank push, a single-source push from rank 0, then a multi-rank push again. Both
    kinds of group form on the one store the pusher listens with (each used to start its own on
    the same port: the second failed with GROUP_STORE_UNREACHABLE, "Address already in use").

    The group timeout is 60 s, not the trainer's default 20: the single-source group forms right
    after the multi-rank one, and each of the eight workers joins it with the gloo receiving
    process it started when it took one for the first group (a fresh interpreter importing torch,
    ~2 s of CPU each), and eight at once on a 2-core machine loaded by other work can take nearly
    all of 20 s: a run at load 7-8 failed with every worker's connection left 0.5 s of it ("timed
    out after 0.528 s waiting for 1 key(s)"), passing alone."""
    ranks = Ranks(2, fleet.addresses(), "--store-port", str(free_port()), "--group-timeout", "60")
    try:
        version = fleet.next_version()
        assert_landed(fleet, ranks.push(version=version, seed=version), version, version)
        single = ranks.push(version=version + 1, seed=version + 3, single=True)
        assert all(a["ok"] for a in single), single
        for m in fleet.members:
            assert single[0]["results"][m.address]["version"] == version + 1
            fleet.assert_holds(m, version + 1, full_checkpoint(CONFIG, version + 3))
        assert_landed(fleet, ranks.push(version=version + 2, seed=version + 5), version + 2, version + 5)
    finally:
        ranks.close()


def test_ranks_that_disagree_or_leave_a_tensor_out_are_refused_before_any_byte(
    fleet: Fleet, ranks2: Ranks
) -> None:
    before = {m.address: m.status().weights_version for m in fleet.members}
    version = max(before.values()) + 1
    # A FULL update without a tensor the workers own: refused on every rank, nothing sent.
    answers = ranks2.push(version=version, seed=1, drop=["model.norm.weight"])
    assert [a["ok"] for a in answers] == [False, False]
    assert {a["error"]["reason"] for a in answers} == {"INCOMPLETE_UPDATE"}, answers
    # Ranks that push different tensors (a PARTIAL update, rank 1 without the norm): refused.
    for r in (0, 1):
        drop = ["model.norm.weight"] if r else []
        ranks2.send(
            r, json.dumps({"op": "push", "version": version, "seed": 1, "scope": "partial", "drop": drop})
        )
    answers = [ranks2.read(0), ranks2.read(1)]
    assert [a["ok"] for a in answers] == [False, False]
    assert {a["error"]["reason"] for a in answers} == {"TRAINER_RANKS_DISAGREE"}, answers
    assert {m.address: m.status().weights_version for m in fleet.members} == before


def test_a_trainer_rank_lost_mid_transfer_fails_every_rank_and_the_group_reforms(fleet: Fleet) -> None:
    ranks = Ranks(3, fleet.addresses())
    try:
        before = fleet.next_version() - 1
        ranks.command(op="push", version=before + 1, seed=5, pause_rank=2)
        assert ranks.read(2) == {"paused": True}
        ranks.send(2, "die")
        answers = [ranks.read(0), ranks.read(1)]
        assert [a["ok"] for a in answers] == [False, False], answers
        # Rank 0 drove the workers: its error names the lost rank and carries every worker's
        # failure. Rank 1 cannot be told them (the ranks' exchange died with rank 2): it says a
        # rank was lost.
        assert answers[0]["error"]["reason"] == "TRAINER_RANK_LOST", answers[0]
        assert "trainer rank 2" in answers[0]["error"]["message"], answers[0]
        failures = answers[0]["error"]["failures"]
        assert set(failures) == {m.address for m in fleet.members}, failures
        assert {f["reason"] for f in failures.values()} <= {
            "TRANSFER_FAILED",
            "CANCELLED",
            "TRAINER_RANK_FAILED",
        }, failures
        assert answers[1]["error"]["reason"] == "TRAINER_RANK_LOST", answers[1]
        for m in fleet.members:
            assert wait_until(lambda m=m: m.status().state != pb.WORKER_STATE_UPDATING, timeout=30)
            assert m.status().weights_version == before
    finally:
        ranks.close()
    # A new trainer (its ranks restarted, as after a crash) forms a new group and lands.
    ranks = Ranks(2, fleet.addresses())
    try:
        answers = ranks.push(version=before + 1, seed=6)
        assert_landed(fleet, answers, before + 1, 6)
    finally:
        ranks.close()


def test_a_worker_lost_mid_transfer_is_named_and_the_group_reforms_after_its_restart(
    fleet: Fleet, ranks2: Ranks
) -> None:
    victim = next(
        m for m in fleet.members if m.rank.pp_rank == 1 and m.rank.tp_rank == 1 and m.rank.dp_rank == 0
    )
    before = fleet.next_version() - 1
    ranks2.command(op="push", version=before + 1, seed=8)
    first = [ranks2.read(0), ranks2.read(1)]
    assert_landed(fleet, first, before + 1, 8)
    ranks2.command(op="push", version=before + 2, seed=9, pause_rank=1)
    assert ranks2.read(1) == {"paused": True}
    victim.process.proc.kill()  # SIGKILL mid-transfer: it holds its bucket and waits for bytes
    victim.process.proc.wait()
    ranks2.send(1, "go")
    answers = [ranks2.read(0), ranks2.read(1)]
    assert [a["ok"] for a in answers] == [False, False], answers
    failures = answers[0]["error"]["failures"]
    assert failures[victim.address]["reason"] in ("UNAVAILABLE", "TRANSFER_FAILED"), failures
    for m in fleet.members:
        if m is victim:
            continue
        # Cancelled because of it, or (a receive or the plan's comparison that still involved the
        # victim when it died) its own transfer failed; never a hang, never committed.
        assert failures[m.address]["reason"] in ("CANCELLED", "TRANSFER_FAILED"), failures[m.address]
        assert wait_until(lambda m=m: m.status().state != pb.WORKER_STATE_UPDATING, timeout=30)
        assert m.status().weights_version == before + 1
    fleet.restart(victim)
    # Its channel reconnects first (UNAVAILABLE at worst, on every rank alike); then the next push
    # reads the manifests again, forms a new group with the restarted worker and lands.
    for _ in range(50):
        answers = ranks2.push(version=before + 2, seed=9)
        if answers[0]["ok"]:
            break
        assert {f["reason"] for f in answers[0]["error"]["failures"].values()} <= {"UNAVAILABLE"}, answers
    assert_landed(fleet, answers, before + 2, 9)
    assert answers[0]["group_id"] != first[0]["group_id"] and answers[0]["formations"] == 2


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal where NCCL cannot run"
)
def test_nccl_without_a_gpu_is_refused_on_every_rank_before_anything_is_sent(fleet: Fleet) -> None:
    before = {m.address: m.status().weights_version for m in fleet.members}
    ranks = Ranks(2, fleet.addresses(), "--backend", "nccl")
    try:
        answers = ranks.push(version=max(before.values()) + 1, seed=3)
    finally:
        ranks.close()
    assert [a["ok"] for a in answers] == [False, False]
    # Refused while planning, the same on every rank; no worker was called.
    assert {a["error"]["reason"] for a in answers} == {"TRANSPORT_UNAVAILABLE"}, answers
    assert "NCCL" in answers[0]["error"]["message"] or "nccl" in answers[0]["error"]["message"]
    assert {m.address: m.status().weights_version for m in fleet.members} == before
