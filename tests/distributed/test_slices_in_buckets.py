"""An every-rank-a-source push whose workers' parts are several times the pusher's bucket size goes
as several buckets per worker (``slice_buckets.split_buckets``), and a trainer rank killed between two
of them leaves every worker CONSISTENT at its old version with its old weights, bit for bit.

Real processes: two FSDP2 trainer ranks (``slice_trainer.py``, gloo) with a 32 KiB bucket size, into
four ``weightwire serve`` workers (TP2 x PP2) that keep over four times that each.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from group_fleet import CONFIG, Fleet, Member
from helpers import wait_until
from slice_ranks import Ranks
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = pytest.mark.timeout(600)

BUCKET_BYTES = 32 << 10


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("bucketed-slices-fleet")
    (root / "sock").mkdir()
    f = Fleet(str(root / "sock"), str(root / "dump"), replicas=1)
    yield f
    f.stop()


def _ranks(fleet: Fleet) -> Ranks:
    return Ranks(2, fleet.addresses(), "--group-timeout", "60", "--bucket-bytes", str(BUCKET_BYTES))


def _kept_bytes(member: Member) -> int:
    manifest = member.stub().GetManifest(pb.GetManifestRequest()).manifest
    return ShardManifest.from_proto(manifest).kept_bytes


def test_a_shard_several_times_the_bucket_size_goes_in_several_buckets_bit_exact(fleet: Fleet) -> None:
    ranks = _ranks(fleet)
    try:
        for seed in (11, 12):  # the second push reuses the split, its payloads and its buffers
            version = fleet.next_version()
            answers = ranks.push(version=version, seed=seed)
            assert all(a["ok"] for a in answers), answers
            results = answers[0]["results"]
            full = full_checkpoint(CONFIG, seed)
            for m in fleet.members:
                r = results[m.address]
                kept = _kept_bytes(m)
                assert kept > 4 * BUCKET_BYTES, (m.worker_id, kept)
                assert (r["version"], r["state"]) == (version, "CONSISTENT")
                assert r["bytes_received"] == r["bytes_loaded"] == kept, m.worker_id
                # The worker acked one bucket per <= 32 KiB of its part (a tensor over it goes alone):
                # at least kept / 32 KiB of them.
                assert r["buckets"] >= kept // BUCKET_BYTES, (m.worker_id, r["buckets"], kept)
                fleet.assert_holds(m, version, full)
            buckets = sum(results[m.address]["buckets"] for m in fleet.members)
            assert answers[0]["progress"][-1][:2] == [buckets, buckets]
    finally:
        ranks.close()


def test_a_plan_changed_between_pushes_on_one_group_is_compared_again_and_lands(fleet: Fleet) -> None:
    """One group, three pushes: the full plan (compared), a PARTIAL one of one tensor (a plan the
    group never agreed on: compared again), the full plan again (agreed already: no comparison).
    Each lands bit for bit on every worker, on the same group throughout."""
    ranks = _ranks(fleet)
    pushed = "model.layers.0.input_layernorm.weight"
    drop = [n for n in full_checkpoint(CONFIG, 0) if n != pushed]
    try:
        groups = set()
        expected = dict(full_checkpoint(CONFIG, 31))
        for seed, scope in ((31, "full"), (32, "partial"), (33, "full")):
            version = fleet.next_version()
            partial = {"scope": "partial", "drop": drop} if scope == "partial" else {}
            answers = ranks.push(version=version, seed=seed, **partial)
            assert all(a["ok"] for a in answers), (seed, answers)
            if scope == "partial":
                expected[pushed] = full_checkpoint(CONFIG, seed)[pushed]
            else:
                expected = dict(full_checkpoint(CONFIG, seed))
            for m in fleet.members:
                r = answers[0]["results"][m.address]
                assert (r["version"], r["state"]) == (version, "CONSISTENT"), (seed, m.worker_id)
                fleet.assert_holds(m, version, expected)
                groups.add(m.status().transfer_group.group_id)
        assert len(groups) == 1, groups  # no push formed a new group: the plans were compared on one
    finally:
        ranks.close()


def test_a_trainer_rank_killed_between_buckets_leaves_every_worker_at_its_old_weights(fleet: Fleet) -> None:
    ranks = _ranks(fleet)
    try:
        before = fleet.next_version()
        assert all(a["ok"] for a in ranks.push(version=before, seed=21)), "the first push lands"
        received = {m.address: m.status().transfer_group.bytes_received for m in fleet.members}
        ranks.command(op="push", version=before + 1, seed=22, pause_between_buckets=1)
        assert ranks.read(1) == {"paused": True}
        # Every worker received its first bucket whole (the group's count moves once a bucket has
        # arrived): its bytes are staged, and the update cannot commit without rank 1's next ones.
        assert wait_until(
            lambda: all(
                m.status().transfer_group.bytes_received > received[m.address] for m in fleet.members
            ),
            timeout=30,
        )
        for m in fleet.members:
            assert m.status().state == pb.WORKER_STATE_UPDATING, m.worker_id
        ranks.send(1, "die")
        ranks.procs[1].wait()
        answer = ranks.read(0)
        assert not answer["ok"], answer
        assert "trainer rank 1" in answer["error"]["message"], answer
        for m in fleet.members:
            assert wait_until(lambda m=m: m.status().state != pb.WORKER_STATE_UPDATING, timeout=30)
            st = m.status()
            assert (st.weights_version, st.state) == (before, pb.WORKER_STATE_CONSISTENT), (m.worker_id, st)
    finally:
        ranks.close()
    # What each model holds now, read back through a PARTIAL push of one tensor (each worker
    # dumps its whole model at the commit): every other tensor is still version ``before``'s.
    pushed = "model.layers.0.input_layernorm.weight"
    drop = [n for n in full_checkpoint(CONFIG, 0) if n != pushed]
    ranks = _ranks(fleet)
    try:
        answers = ranks.push(version=before + 1, seed=23, scope="partial", drop=drop)
        assert all(a["ok"] for a in answers), answers
    finally:
        ranks.close()
    expected = dict(full_checkpoint(CONFIG, 21))
    expected[pushed] = full_checkpoint(CONFIG, 23)[pushed]
    for m in fleet.members:
        fleet.assert_holds(m, before + 1, expected)
    assert not torch.equal(expected[pushed], full_checkpoint(CONFIG, 21)[pushed])
