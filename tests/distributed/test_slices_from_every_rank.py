"""Every trainer rank a source (issue 27's data plane, over gloo on loopback between real processes):
FSDP2 shards of 2 and 4 trainer ranks into a TP2 x PP2 engine and into TP2 x 2 replicas, each worker
receiving exactly its slices straight into its parameters (packed per destination, or regions of
whole rows received in place) (bit-exact against the checkpoint; bytes
received == its manifest's kept bytes), each trainer rank sending only bytes it holds; a member
with another plan is refused on every member before a byte moves; a trainer rank lost mid-update
ends every worker with TRANSFER_FAILED, not a hang.

Each member is a ``slice_member.py`` process; the test process serves the store only.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(240)


def run_group(
    trainers: int,
    engine: tuple[int, int, int],
    *,
    variant_rank: int | None = None,
    in_place: bool = False,
    die_rank: int | None = None,
    short: tuple[int, str] | None = None,
) -> list[dict]:
    tp, pp, dp = engine
    world = trainers + tp * pp * dp
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
    )
    group = uuid.uuid4().hex
    procs = []
    for rank in range(world):
        cmd = [
            sys.executable,
            os.path.join(HERE, "slice_member.py"),
            "--store",
            f"127.0.0.1:{store.port}",
            "--group",
            group,
            "--trainers",
            str(trainers),
            "--engine",
            f"{tp},{pp},{dp}",
            "--rank",
            str(rank),
        ]
        if rank == variant_rank:
            cmd.append("--plan-variant")
        if in_place:
            cmd += ["--direct-min-bytes", "0"]
        if rank == die_rank:
            cmd.append("--die-after-agree")
        if short is not None and rank == short[0]:
            cmd += ["--short-messages", short[1]]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=180)
            if rank == die_rank:
                assert p.returncode == 3, err[-2000:]
                results.append({"rank": rank, "died": True})
                continue
            assert p.returncode == 0, err[-2000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


@pytest.mark.parametrize(
    ("trainers", "engine", "in_place"),
    [(2, (2, 2, 1), False), (4, (2, 1, 2), True)],
    ids=["2-to-tp2pp2-packed", "4-to-tp2x2-rows-in-place"],
)
def test_every_rank_sends_only_its_shards_and_every_worker_gets_exactly_its_slices(
    trainers: int, engine: tuple[int, int, int], in_place: bool
) -> None:
    results = run_group(trainers, engine, in_place=in_place)
    assert all("error" not in r for r in results), results
    assert len({r["fingerprint"] for r in results}) == 1
    senders, receivers = results[:trainers], results[trainers:]
    for r in senders:
        assert r["sent"] == r["planned"] > 0, r  # every rank a source, each its own share
    for r in receivers:
        assert r["exact"], r["worker"]
        assert (r["in_place_messages"] > 0) == in_place, r
        assert r["received"] == r["kept_bytes"], r
    assert sum(r["sent"] for r in senders) == sum(r["received"] for r in receivers)


def test_a_member_with_another_plan_is_refused_on_every_member() -> None:
    results = run_group(1, (2, 1, 1), variant_rank=2)
    assert {r["error"] for r in results} == {"GROUP_PLAN_MISMATCH"}, results
    assert all("sent" not in r and "received" not in r for r in results)


def test_a_trainer_rank_lost_after_the_check_ends_every_worker_with_a_reason() -> None:
    """Trainer rank 1 of 2 exits between the plan check and its first send: every worker's
    receive from it fails (its sockets closed) as TRANSFER_FAILED naming it, within the group's
    timeout, and no worker reports its slices complete."""
    results = run_group(2, (2, 1, 1), die_rank=1)
    workers = results[2:]
    assert all(r.get("error") == "TRANSFER_FAILED" for r in workers), workers
    assert all("trainer rank 1" in r["message"] for r in workers), workers
    assert all("received" not in r for r in workers)
    # The surviving trainer rank ends too: its sends completed or failed with the reason.
    assert results[0].get("error") in (None, "TRANSFER_FAILED"), results[0]


@pytest.mark.parametrize("what", ["data", "announcement"])
def test_a_trainer_rank_sending_short_messages_is_refused_never_counted(what: str) -> None:
    """Trainer rank 1 of 2 agrees the plan, then sends every slices message (or its announcements)
    at half its size. gloo completes such receives as if they were whole: every worker must still
    end with MESSAGE_TRUNCATED naming that rank, and none reports its slices received."""
    results = run_group(2, (2, 1, 1), short=(1, what))
    workers = results[2:]
    assert all(r.get("error") == "MESSAGE_TRUNCATED" for r in workers), workers
    assert all("trainer rank 1" in r["message"] for r in workers), workers
    assert all("received" not in r for r in workers)
