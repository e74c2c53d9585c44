"""The plan comparison of a transfer group (``transfer_group_agreement``), over real gloo process
groups of three members (threads of this process): compared at a group's first update, skipped by
every member for a plan the group agreed on already, compared again when the plan changed, and a
member with another plan still refused on every member before anything is recorded."""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports.transfer_group_agreement import AgreedPlans, agree
from weightwire.core.transports.transfer_plan import TransferPlan

pytestmark = pytest.mark.timeout(60)

MEMBERS = 3
TIMEOUT_S = 10.0


def plan(name: str) -> TransferPlan:
    return TransferPlan((), uuid.uuid5(uuid.NAMESPACE_OID, name).hex)


def gloo_groups() -> list[Any]:
    """Three members of one gloo process group, formed on threads of this process."""
    store = torch.distributed.HashStore()
    prefix = uuid.uuid4().hex
    groups: list[Any] = [None] * MEMBERS

    def form(rank: int) -> None:
        opts = torch.distributed.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
        opts._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore(prefix, store), rank, MEMBERS, opts
        )

    threads = [threading.Thread(target=form, args=(r,)) for r in range(MEMBERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def on_every_member(call: Callable[[int], Any]) -> list[Any]:
    """``call(rank)`` on one thread per member; each member's result or the error it raised."""
    out: list[Any] = [None] * MEMBERS

    def run(rank: int) -> None:
        try:
            out[rank] = call(rank)
        except Exception as e:
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(MEMBERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_group_compares_a_plan_once_and_every_member_skips_it_afterwards() -> None:
    pgs, records = gloo_groups(), [AgreedPlans() for _ in range(MEMBERS)]
    first = plan("first")
    assert (
        on_every_member(lambda r: agree(pgs[r], first, r, MEMBERS, TIMEOUT_S, agreed=records[r]))
        == [True] * MEMBERS
    )
    # The next update with the same plan: no collective at all. Called on one member at a time, a
    # comparison would wait for the others until its timeout.
    for r in range(MEMBERS):
        began = time.monotonic()
        assert agree(pgs[r], first, r, MEMBERS, TIMEOUT_S, agreed=records[r]) is False
        assert time.monotonic() - began < 1.0
    # Without a record, every update compares.
    assert on_every_member(lambda r: agree(pgs[r], first, r, MEMBERS, TIMEOUT_S)) == [True] * MEMBERS


def test_a_plan_changed_between_updates_is_compared_again() -> None:
    pgs, records = gloo_groups(), [AgreedPlans() for _ in range(MEMBERS)]
    first, second = plan("first"), plan("second")
    on_every_member(lambda r: agree(pgs[r], first, r, MEMBERS, TIMEOUT_S, agreed=records[r]))
    assert (
        on_every_member(lambda r: agree(pgs[r], second, r, MEMBERS, TIMEOUT_S, agreed=records[r]))
        == [True] * MEMBERS
    )
    assert all(first.fingerprint in rec and second.fingerprint in rec for rec in records)
    # Back to the first plan: agreed already, skipped.
    assert [agree(pgs[r], first, r, MEMBERS, TIMEOUT_S, agreed=records[r]) for r in range(MEMBERS)] == [
        False
    ] * MEMBERS


def test_a_member_with_another_plan_after_an_agreed_one_is_refused_on_every_member() -> None:
    pgs, records = gloo_groups(), [AgreedPlans() for _ in range(MEMBERS)]
    first = plan("first")
    on_every_member(lambda r: agree(pgs[r], first, r, MEMBERS, TIMEOUT_S, agreed=records[r]))
    # The plan changes, and member 2 plans something else than the others.
    plans = [plan("second"), plan("second"), plan("other")]
    outcomes = on_every_member(lambda r: agree(pgs[r], plans[r], r, MEMBERS, TIMEOUT_S, agreed=records[r]))
    assert all(isinstance(e, WeightwireError) and e.kind is Reason.GROUP_PLAN_MISMATCH for e in outcomes), (
        outcomes
    )
    assert [e.metadata["ranks"] for e in outcomes] == ["2", "2", "0,1"]
    # Nothing refused is kept as agreed: the next update with either plan compares again.
    assert all(p.fingerprint not in rec for p in plans for rec in records)
    assert all(first.fingerprint in rec for rec in records)


def test_a_record_keeps_the_latest_plans() -> None:
    record = AgreedPlans(keep=2)
    for name in ("a", "b", "a", "c"):
        record.add(plan(name).fingerprint)
    assert plan("a").fingerprint in record and plan("c").fingerprint in record
    assert plan("b").fingerprint not in record
    assert len(record) == 2
