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
from typing import Any

import pytest
import torch
from weightwire.core.transports.transfer_group_store import StoreServer

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(240)


def run_group(
    trainers: int,
    engine: tuple[int, int, int],
    *,
    variant_rank: int | None = None,
    in_place: bool = False,
    die_rank: int | None = None,
    die_after: str = "agree",
    short: tuple[int, str] | None = None,
    isolated: bool = False,
) -> list[dict]:
    tp, pp, dp = engine
    world = trainers + tp * pp * dp
    store: Any = (
        StoreServer("127.0.0.1")
        if isolated  # what a receiving process rendezvouses on
        else torch.distributed.TCPStore(
            "127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
        )
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
            cmd.append(f"--die-after-{die_after}")
        if isolated:
            cmd.append("--isolated")
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
        if isinstance(store, StoreServer):
            store.close()
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


def test_a_trainer_rank_lost_after_announcing_leaves_every_worker_s_tensors_untouched() -> None:
    """As ``weightwire serve`` receives (a receiving process holding the bytes back until the
    update commits), with regions received in place into the parameters: trainer rank 0 of 2
    announces its messages and exits before the first. Each worker's receives were posted and
    primed (whole_messages), yet its parameters stay bit for bit what they were: the priming is
    where the bytes are held, never in the model a failed update must leave alone."""
    results = run_group(2, (2, 1, 1), die_rank=0, die_after="announcing", in_place=True, isolated=True)
    workers = results[2:]
    assert all(r["in_place_messages"] > 0 for r in workers), workers
    assert all(r.get("error") == "TRANSFER_FAILED" for r in workers), workers
    assert all("trainer rank 0" in r["message"] for r in workers), workers
    assert all(r["unchanged"] for r in workers), workers


def test_isolated_workers_land_every_slice_when_the_update_completes() -> None:
    """The same receive through a receiving process with regions in place, completing: every
    worker's parameters equal its slices of the checkpoint only after what was held back lands."""
    results = run_group(2, (2, 1, 1), in_place=True, isolated=True)
    assert all("error" not in r for r in results), results
    for r in results[2:]:
        assert r["exact"] and r["in_place_messages"] > 0 and r["received"] == r["kept_bytes"], r


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
