"""A member of an every-rank-a-source push that dies mid-update (a worker, or a trainer rank,
SIGKILLed) ends every rank within seconds, not at the transfer group's timeout, naming the member
that died; no surviving worker commits or stays UPDATING, and every one is CONSISTENT at its old
version (nothing of the update reached its model). So does an update the workers refuse at its
header, whose refusal used to reach the ranks only at the group's timeout.

Real processes: two FSDP2 trainer ranks (``slice_trainer.py``, gloo) with a group timeout of 60 s,
into four ``weightwire serve`` workers (TP2 x PP2). The bound (15 s) is generous for a loaded
2-core machine and still a quarter of the timeout each death used to cost.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from group_fleet import CONFIG, Fleet
from helpers import wait_until
from slice_ranks import Ranks
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = pytest.mark.timeout(600)

GROUP_TIMEOUT_S = 60.0
# Every rank must have ended this long after the death (the group's timeout is 60 s).
ENDS_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("dead-member-fleet")
    (root / "sock").mkdir()
    f = Fleet(str(root / "sock"), str(root / "dump"), replicas=1)
    yield f
    f.stop()


def _ranks(fleet: Fleet) -> Ranks:
    return Ranks(2, fleet.addresses(), "--group-timeout", str(GROUP_TIMEOUT_S))


def _survivors_end_at_their_old_version(fleet: Fleet, victim: object, version: int, since: float) -> None:
    for m in fleet.members:
        if m is victim:
            continue
        assert wait_until(lambda m=m: m.status().state != pb.WORKER_STATE_UPDATING, timeout=ENDS_WITHIN_S)
        st = m.status()
        assert st.weights_version == version, m.worker_id
        # Nothing of the update that did not commit reached its model: a worker's gloo receives are
        # staged and land only at the commit.
        assert st.state == pb.WORKER_STATE_CONSISTENT, (m.worker_id, st.state, st.last_error)
    assert time.monotonic() - since < ENDS_WITHIN_S + 2


def test_a_worker_killed_mid_push_ends_every_rank_at_once_naming_it(fleet: Fleet) -> None:
    victim = next(m for m in fleet.members if m.rank.pp_rank == 1 and m.rank.tp_rank == 1)
    ranks = _ranks(fleet)
    try:
        before = fleet.next_version()
        assert all(a["ok"] for a in ranks.push(version=before, seed=1)), "the first push lands"
        ranks.command(op="push", version=before + 1, seed=2, pause_rank=1)
        assert ranks.read(1) == {"paused": True}
        victim.process.proc.kill()  # SIGKILL while it holds its bucket and waits for rank 1's bytes
        victim.process.proc.wait()
        died = time.monotonic()
        ranks.send(1, "go")
        answers = [ranks.read(0), ranks.read(1)]
        took = [time.monotonic() - died]
        assert [a["ok"] for a in answers] == [False, False], answers
        assert took[0] < ENDS_WITHIN_S, f"the ranks ended {took[0]:.1f} s after the worker died: {answers}"
        failures = answers[0]["error"]["failures"]
        assert failures == answers[1]["error"]["failures"]
        assert failures[victim.address]["reason"] in ("UNAVAILABLE", "TRANSFER_FAILED"), failures
        for a in answers:
            assert victim.address in a["error"]["message"] or victim.worker_id in a["error"]["message"], a
        _survivors_end_at_their_old_version(fleet, victim, before, died)
    finally:
        ranks.close()
        fleet.restart(victim)


def test_a_trainer_rank_killed_mid_push_ends_every_rank_at_once_naming_it(fleet: Fleet) -> None:
    ranks = _ranks(fleet)
    try:
        before = fleet.next_version()
        assert all(a["ok"] for a in ranks.push(version=before, seed=3)), "the first push lands"
        ranks.command(op="push", version=before + 1, seed=4, pause_rank=1)
        assert ranks.read(1) == {"paused": True}
        ranks.send(1, "die")
        ranks.procs[1].wait()
        died = time.monotonic()
        answer = ranks.read(0)
        took = time.monotonic() - died
        assert not answer["ok"], answer
        assert took < ENDS_WITHIN_S, f"rank 0 ended {took:.1f} s after trainer rank 1 died"
        assert "trainer rank 1" in answer["error"]["message"], answer
        for f in answer["error"]["failures"].values():
            assert f["reason"] in ("TRANSFER_FAILED", "CANCELLED", "TRAINER_RANK_LOST"), f
        _survivors_end_at_their_old_version(fleet, None, before, died)
    finally:
        ranks.close()


# A refusal is the workers' own answer, nothing died: every rank must have it this soon.
REFUSED_WITHIN_S = 10.0


def test_a_step_the_workers_refuse_at_its_header_ends_every_rank_at_once(fleet: Fleet) -> None:
    """A stale step over the group the ranks formed: every worker refuses it at its header
    (STALE_VERSION) and never joins the plan's comparison, which a trainer rank's sends wait in
    once every bucket is queued. The ranks used to learn rank 0's verdict only when that
    comparison reached the group's timeout (60 s here); every rank must end within seconds with
    the workers' reason, nothing committed, and the next push lands (on a group formed anew).
    Repeated: whether a rank was caught depended on timing."""
    ranks = _ranks(fleet)
    try:
        version = fleet.next_version()
        for attempt in range(3):
            good = ranks.push(version=version, seed=5 + attempt)
            assert [a["ok"] for a in good] == [True, True], good
            assert {r["version"] for r in good[0]["results"].values()} == {version}
            fleet.assert_holds(fleet.members[attempt], version, full_checkpoint(CONFIG, 5 + attempt))
            started = time.monotonic()
            ranks.command(op="push", version=version, seed=8)  # not newer than what they hold
            answers = []
            for r in (0, 1):
                answers.append(ranks.read(r))
                took = time.monotonic() - started
                assert took < REFUSED_WITHIN_S, (
                    f"attempt {attempt}: rank {r} ended after {took:.1f} s: {answers}"
                )
            assert [a["ok"] for a in answers] == [False, False], answers
            failures = answers[0]["error"]["failures"]
            assert failures == answers[1]["error"]["failures"], answers
            assert set(failures) == set(fleet.addresses())
            assert "STALE_VERSION" in {f["reason"] for f in failures.values()}, failures
            assert {f["reason"] for f in failures.values()} <= {"STALE_VERSION", "CANCELLED"}, failures
            for m in fleet.members:
                assert wait_until(lambda m=m: m.status().state != pb.WORKER_STATE_UPDATING, timeout=10)
                st = m.status()
                assert (st.weights_version, st.state) == (version, pb.WORKER_STATE_CONSISTENT), m.worker_id
            version += 1
    finally:
        ranks.close()
