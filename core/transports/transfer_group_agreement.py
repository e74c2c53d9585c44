"""Every member of a transfer group compares the transfer plan's fingerprint with every other
before any byte of an update moves (``agree``), at most once per group and plan (``AgreedPlans``).

A member with another plan would pair its messages with the wrong bytes, or receive a message
longer than it posted (which gloo answers by ending the receiving process), so the comparison comes
before every update's first message. Once the members of one group have compared a fingerprint,
comparing it again proves nothing new: every member contributed that same fingerprint to the same
collective, and a group outlives only updates that succeeded on every member (a failed one tears
the group down on every member, trainer ranks and workers alike). So each member keeps the
fingerprints its group agreed on, and a later update with one of them skips the collective:

- every trainer rank holds the same fingerprint (the ranks compare theirs in their own process
  group before the transfer group is touched, ``client/ranks/slice_push``) and the same record of
  the group's agreed ones (the same successful updates);
- every worker is sent the fingerprint of its update by trainer rank 0 with its first bucket, and
  keeps the same record;
- so either every member finds the fingerprint agreed and skips, or none does and all compare
  (a plan that changed between pushes is compared again, as at the group's first update).

Called by ``client/ranks/slice_push`` on every trainer rank and by
``server/transports/transfer_group_slices.receive_bucket`` on every worker.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from weightwire.core.errors import Reason
from weightwire.core.transports.transfer_group_waits import post, wait
from weightwire.core.transports.transfer_plan import TransferPlan, TransferPlanError

__all__ = ["AgreedPlans", "agree"]

# A trainer that alternates between a few plans (full and partial updates) keeps them all agreed.
_KEPT_FINGERPRINTS = 16


class AgreedPlans:
    """The plan fingerprints one group's members compared and found equal, as one member holds
    them: made with the member's side of the group and dropped with it, never shared between
    groups."""

    def __init__(self, keep: int = _KEPT_FINGERPRINTS) -> None:
        self._keep = keep
        self._fingerprints: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __contains__(self, fingerprint: object) -> bool:
        return fingerprint in self._fingerprints

    def __len__(self) -> int:
        return len(self._fingerprints)

    def add(self, fingerprint: str) -> None:
        self._fingerprints[fingerprint] = None
        self._fingerprints.move_to_end(fingerprint)
        while len(self._fingerprints) > self._keep:
            self._fingerprints.popitem(last=False)


def agree(
    pg: Any,
    plan: TransferPlan,
    rank: int,
    world_size: int,
    timeout_s: float,
    stopped: Callable[[], bool] | None = None,
    device: torch.device | None = None,
    agreed: AgreedPlans | None = None,
) -> bool:
    """Every member's plan fingerprint against every other's; ``GROUP_PLAN_MISMATCH`` on every
    member naming the ranks that differ from this one (CANCELLED once ``stopped()``, see
    ``transfer_group_waits.wait``). ``device`` is where the group's backend moves bytes from
    (``transfer_group.staging_device``: the host for gloo, the member's GPU for NCCL). With
    ``agreed`` (this member's record for the group, every member passing its own or none): nothing
    is compared when the fingerprint is in it already, and it is added once compared. Returns
    whether the members compared now."""
    if agreed is not None and plan.fingerprint in agreed:
        return False
    mine = torch.frombuffer(bytearray(bytes.fromhex(plan.fingerprint)), dtype=torch.uint8)
    if device is not None:
        mine = mine.to(device)
    # Primed with the complement of this member's fingerprint: a short or missing contribution
    # reads as a different plan, never as this one.
    gathered = [torch.bitwise_not(mine) for _ in range(world_size)]
    work = post(lambda: pg.allgather([gathered], [mine]), "comparing transfer plans")
    wait(work, timeout_s, "comparing transfer plans", stopped)
    differ = [r for r, g in enumerate(gathered) if not torch.equal(g, mine)]
    if differ:
        raise TransferPlanError(
            Reason.GROUP_PLAN_MISMATCH,
            f"group rank {rank}'s transfer plan {plan.fingerprint} differs from that of rank(s) {differ}; "
            "every member must plan from the same holdings and manifests",
            ranks=",".join(map(str, differ)),
        )
    if agreed is not None:
        agreed.add(plan.fingerprint)
    return True
