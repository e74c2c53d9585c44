"""The store side of forming a transfer group: each member claims its rank, then checks that
every rank is held by the member the plan names, with the same world size and the same plan, and
the first refusal is shared with every member through an abort flag.

``weightwire.core.transports.transfer_group.TransferGroup.form`` runs one ``Rendezvous`` per
member before it builds the process groups. No gRPC in here.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports.transfer_group_plan import MemberIdentity, clip, spec_digest
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["Rendezvous", "member_record"]

# How often members look at the store while they wait for each other during formation.
_POLL_S = 0.02
# What one member's identity record in the store may weigh (a few hundred bytes in practice).
_MAX_RECORD_BYTES = 4096


def member_record(identity: MemberIdentity, rank: int) -> bytes:
    """What a member writes under its rank in the store (and hashes for the check over the group)."""
    return identity.to_proto(rank).SerializeToString(deterministic=True)


@dataclasses.dataclass(eq=False)
class Rendezvous:
    """The store side of forming one group: claims, checks and the shared abort flag. ``store`` is
    the group's (prefixed) store, ``rank`` this member's, ``deadline`` a ``time.monotonic()`` one."""

    store: Any
    spec: pb.TransferGroupSpec
    rank: int
    me: MemberIdentity
    deadline: float

    @property
    def world(self) -> int:
        return self.spec.world_size

    def refuse(self, err: WeightwireError) -> WeightwireError:
        """Tell every member (first refusal wins) and return the error to raise here."""
        record = {"reason": err.reason, "message": clip(err.message, 1000), "metadata": err.metadata}
        try:
            self.store.compare_set("abort", "", json.dumps(record))
        except Exception:  # the store itself is gone: the others find out at their deadline
            pass
        return err

    def _aborted(self) -> WeightwireError | None:
        if not self.store.check(["abort"]):
            return None
        try:
            record = json.loads(self.store.get("abort")[:_MAX_RECORD_BYTES])
            reason, message = str(record["reason"]), clip(str(record["message"]), 1000)
            metadata = {str(k)[:64]: clip(str(v), 1000) for k, v in dict(record.get("metadata", {})).items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            reason, message, metadata = "GROUP_TIMEOUT", "(unreadable refusal)", {}
        if reason not in Reason.__members__:
            reason = "GROUP_TIMEOUT"
        return WeightwireError(reason, f"another member refused the group: {message}", **metadata)

    def wait_for(self, keys: Sequence[str], what: str) -> None:
        """Until every key exists. Keys first, then the abort flag: a member that can run its own
        checks reports its own diagnosis rather than another member's."""
        while True:
            if self.store.check(list(keys)):
                return
            err = self._aborted()
            if err is not None:
                raise err
            if time.monotonic() >= self.deadline:
                missing = [k for k in keys if not self.store.check([k])]
                ranks = [k.rpartition("/")[2] for k in missing]
                described = ", ".join(
                    f"{r} ({MemberIdentity.from_proto(self.spec.members[int(r)]).describe()})"
                    for r in ranks[:8]
                    if r.isdigit() and int(r) < len(self.spec.members)
                )
                raise self.refuse(
                    WeightwireError(
                        Reason.GROUP_TIMEOUT,
                        f"group {self.spec.group_id}: {len(missing)} member(s) did not {what} within "
                        f"{self.spec.timeout_ms / 1000:g} s: group rank {described or ', '.join(ranks[:8])}"
                        f"{' ...' if len(ranks) > 8 else ''}",
                        missing_ranks=",".join(ranks[:64]),
                        group_id=self.spec.group_id,
                    )
                )
            time.sleep(_POLL_S)

    def run(self) -> None:
        """Claim our rank, then check that every rank is held by the member the plan names, with the
        same world size and the same plan. Raises (after telling the others) on the first problem."""
        mine = member_record(self.me, self.rank)
        held = self.store.compare_set(f"member/{self.rank}", "", mine)
        if held != mine:
            other = _parse_record(held)
            raise self.refuse(
                WeightwireError(
                    Reason.GROUP_DUPLICATE_RANK,
                    f"group {self.spec.group_id}: group rank {self.rank} is claimed by {other} and by "
                    f"{self.me.describe()}; group ranks must come from each member's full identity (replica, stage, "
                    "tensor rank, instance), never from a stage-local rank",
                    group_rank=str(self.rank),
                    group_id=self.spec.group_id,
                )
            )
        self.store.set(f"world/{self.rank}", str(self.world))
        self.store.set(f"plan/{self.rank}", spec_digest(self.spec))
        self.store.set(f"ready/{self.rank}", "1")
        self.wait_for([f"ready/{r}" for r in range(self.world)], "join")
        # Identities first, then world sizes, then plans: the most specific finding is reported.
        for r in range(self.world):
            planned = MemberIdentity.from_proto(self.spec.members[r])
            actual_raw = self.store.get(f"member/{r}")
            if actual_raw != member_record(planned, r):
                raise self.refuse(
                    WeightwireError(
                        Reason.GROUP_UNKNOWN_MEMBER,
                        f"group {self.spec.group_id}: group rank {r} is held by {_parse_record(actual_raw)}, but the plan "
                        f"says {planned.describe()}",
                        group_rank=str(r),
                        group_id=self.spec.group_id,
                    )
                )
        for r in range(self.world):
            world = self.store.get(f"world/{r}").decode("ascii", "replace")
            if world != str(self.world):
                raise self.refuse(
                    WeightwireError(
                        Reason.GROUP_WRONG_WORLD_SIZE,
                        f"group {self.spec.group_id}: group rank {r} "
                        f"({MemberIdentity.from_proto(self.spec.members[r]).describe()}) was told world size "
                        f"{clip(world, 12)}, {self.me.describe()} was told {self.world}; every member must get the same plan",
                        group_rank=str(r),
                        group_id=self.spec.group_id,
                    )
                )
        digest = spec_digest(self.spec)
        for r in range(self.world):
            if self.store.get(f"plan/{r}").decode("ascii", "replace") != digest:
                raise self.refuse(
                    WeightwireError(
                        Reason.GROUP_PLAN_MISMATCH,
                        f"group {self.spec.group_id}: group rank {r} "
                        f"({MemberIdentity.from_proto(self.spec.members[r]).describe()}) was given a different plan "
                        "than this member; every member must get the same TransferGroupSpec",
                        group_rank=str(r),
                        group_id=self.spec.group_id,
                    )
                )
        self.store.set(f"checked/{self.rank}", "1")
        self.wait_for([f"checked/{r}" for r in range(self.world)], "finish its checks")


def _parse_record(raw: bytes) -> str:
    try:
        if len(raw) > _MAX_RECORD_BYTES:
            raise ValueError
        return MemberIdentity.from_proto(pb.TransferGroupMember.FromString(raw)).describe()
    except Exception:
        return "an unreadable member record"
