"""Transfer-group plans as data: who the members are, which group rank each one gets, which share a
broadcast, and every rule of a plan that needs no other member. Pure: no I/O, no torch.distributed.

The trainer (``weightwire.client``) builds a plan with ``plan_group`` from the manifests it read:
group ranks come from each worker's full identity (replica, stage, tensor rank, instance id), never
from a stage-local rank, so two pipeline stages can never join as the same rank. A worker checks the
plan it is sent (``check_spec``) and finds its own rank in it by its identity (``own_rank``). Forming
the group over the network is ``weightwire.core.transports.transfer_group``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping, Sequence

from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ParallelRank, ShardManifest
from weightwire.core.text import clip as text_clip
from weightwire.v1 import weight_transfer_pb2 as pb

GROUP_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
MAX_WORLD_SIZE = 4096
MAX_SUBGROUPS = 64
# Messages per bucket (ByteRange count); the tag of a message packs the bucket's sequence and the
# message's index, so both sides must agree on both (see ``message_tag``). The index after the last
# message's is the bucket's announcement (``weightwire.core.transports.whole_messages``).
MAX_RANGES = 1024
ANNOUNCEMENT_INDEX = MAX_RANGES
_TAG_INDEX_BITS = 11
_TAG_SEQUENCE_MODULUS = 1 << 20
MIN_TIMEOUT_MS = 100
MAX_TIMEOUT_MS = 3_600_000
_MAX_TEXT = 300


def clip(text: str, limit: int = _MAX_TEXT) -> str:
    return text_clip(text, limit)


@dataclasses.dataclass(frozen=True)
class MemberIdentity:
    """Who a group member is. Workers: their manifest's worker id, parallel rank and instance id
    (new at every process start). Trainers: their trainer rank and a process instance id."""

    role: int
    instance_id: str
    worker_id: str = ""
    rank: ParallelRank | None = None
    trainer_rank: int = 0

    @classmethod
    def of_worker(cls, manifest: ShardManifest) -> MemberIdentity:
        return cls(pb.TRANSFER_ROLE_WORKER, manifest.instance_id, manifest.worker_id, manifest.rank)

    @classmethod
    def of_trainer(cls, trainer_rank: int, instance_id: str) -> MemberIdentity:
        return cls(pb.TRANSFER_ROLE_TRAINER, instance_id, trainer_rank=trainer_rank)

    @property
    def is_trainer(self) -> bool:
        return self.role == pb.TRANSFER_ROLE_TRAINER

    def to_proto(self, group_rank: int) -> pb.TransferGroupMember:
        msg = pb.TransferGroupMember(
            group_rank=group_rank,
            role=self.role,  # type: ignore[arg-type]
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            trainer_rank=self.trainer_rank,
        )
        if self.rank is not None:
            msg.rank.CopyFrom(self.rank.to_proto())
        return msg

    @classmethod
    def from_proto(cls, msg: pb.TransferGroupMember) -> MemberIdentity:
        rank = ParallelRank.from_proto(msg.rank) if msg.HasField("rank") else None
        return cls(msg.role, msg.instance_id, msg.worker_id, rank, msg.trainer_rank)

    def describe(self) -> str:
        """``tp1-pp0 (tp1/2 pp0/2 dp1/2, instance 3f2a9c1e)`` or ``trainer rank 0 (instance ...)``."""
        instance = self.instance_id[:8] or "?"
        if self.is_trainer:
            return f"trainer rank {self.trainer_rank} (instance {instance})"
        where = self.rank.short() if self.rank is not None else "no rank"
        return f"{self.worker_id or 'worker'} ({where}, instance {instance})"


def _worker_order(manifest: ShardManifest) -> tuple[object, ...]:
    r = manifest.rank
    return (r.dp_rank, r.pp_rank, r.tp_rank, r.sp_rank, manifest.worker_id, manifest.instance_id)


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """A planned group: the spec every member gets, and each worker's group rank by its key."""

    spec: pb.TransferGroupSpec
    ranks: Mapping[str, int]
    # Workers (keys) that share a broadcast, by subgroup id.
    subgroup_workers: Mapping[int, tuple[str, ...]]

    @property
    def group_id(self) -> str:
        return self.spec.group_id


def plan_group(
    manifests: Mapping[str, ShardManifest],
    *,
    trainer: MemberIdentity | None = None,
    trainers: Sequence[MemberIdentity] = (),
    group_id: str,
    backend: int,
    store_address: str,
    timeout_ms: int,
    max_bucket_bytes: int,
    broadcast: bool = True,
) -> GroupPlan:
    """The plan of a group of one trainer (group rank 0, which serves the store), or of every
    trainer rank of ``trainers`` (group ranks 0..M-1 in that order: every one a source, rank 0 serving
    the store), and ``manifests``' workers, keyed as in ``manifests`` (the trainer uses endpoint
    addresses).

    Workers get ranks M..M+N-1 (1..N with one trainer) in the order (replica, stage, tensor rank, sequence rank, worker id,
    instance id): a function of their full identities, so two stages can never share a rank. With
    ``broadcast``, workers that own exactly the same tensors (the tensor-parallel ranks of a stage,
    which all take full checkpoint tensors, and the same stage of every replica) form a subgroup
    rooted at the trainer, so a bucket they all need travels as one broadcast.
    """
    for key, manifest in manifests.items():
        if not manifest.instance_id:
            raise WeightwireError(
                Reason.INVALID_GROUP_SPEC,
                f"worker {manifest.worker_id or key} publishes no instance id; a transfer group needs it to tell processes apart",
            )
    sources = list(trainers) if trainers else ([trainer] if trainer is not None else [])
    if not sources or not all(t.is_trainer for t in sources):
        raise ValueError("plan_group needs the trainer (trainer=) or every trainer rank (trainers=)")
    ordered = sorted(manifests, key=lambda k: _worker_order(manifests[k]))
    members = [t.to_proto(r) for r, t in enumerate(sources)]
    ranks: dict[str, int] = {}
    for i, key in enumerate(ordered, start=len(sources)):
        ranks[key] = i
        members.append(MemberIdentity.of_worker(manifests[key]).to_proto(i))
    subgroup_workers: dict[int, tuple[str, ...]] = {}
    subgroups: list[pb.TransferSubgroup] = []
    if broadcast:
        classes: dict[frozenset[str], list[str]] = {}
        for key in ordered:
            classes.setdefault(frozenset(manifests[key].tensors), []).append(key)
        for keys in classes.values():
            if len(keys) < 2 or len(subgroups) >= MAX_SUBGROUPS:
                continue
            sid = len(subgroups)
            subgroup_workers[sid] = tuple(keys)
            subgroups.append(
                pb.TransferSubgroup(
                    subgroup_id=sid, member_ranks=[0, *sorted(ranks[k] for k in keys)], root_rank=0
                )
            )
    spec = pb.TransferGroupSpec(
        group_id=group_id,
        backend=backend,  # type: ignore[arg-type]
        store_address=store_address,
        world_size=len(members),
        members=members,
        subgroups=subgroups,
        timeout_ms=int(timeout_ms),
        max_bucket_bytes=int(max_bucket_bytes),
    )
    check_spec(spec)
    return GroupPlan(spec, ranks, subgroup_workers)


def spec_digest(spec: pb.TransferGroupSpec) -> str:
    """What every member compares to know they were given the same plan."""
    return hashlib.sha256(spec.SerializeToString(deterministic=True)).hexdigest()[:32]


def split_address(address: str) -> tuple[str, int]:
    """``10.0.0.1:29500`` / ``[fd00::1]:29500`` / ``trainer-0:29500`` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT with a port in 1..65535")
    return host, int(port)


def _bad_spec(message: str) -> WeightwireError:
    return WeightwireError(Reason.INVALID_GROUP_SPEC, message)


def check_spec(spec: pb.TransferGroupSpec) -> None:  # noqa: C901 - known; split when next changed
    """Every rule of a TransferGroupSpec that needs no other member; raises INVALID_GROUP_SPEC."""
    if not GROUP_ID_RE.match(spec.group_id):
        raise _bad_spec(f"group id {clip(spec.group_id, 80)!r} must be 1 to 64 characters of [A-Za-z0-9._-]")
    if spec.backend not in (pb.TRANSFER_BACKEND_GLOO, pb.TRANSFER_BACKEND_NCCL):
        raise _bad_spec(
            f"backend {spec.backend} is unspecified or unknown; use TRANSFER_BACKEND_GLOO or TRANSFER_BACKEND_NCCL"
        )
    try:
        if len(spec.store_address) > 256:
            raise ValueError(f"{len(spec.store_address)} characters (at most 256)")
        split_address(spec.store_address)
    except ValueError as e:
        raise _bad_spec(f"store address: {clip(str(e))}") from None
    if not 2 <= spec.world_size <= MAX_WORLD_SIZE:
        raise _bad_spec(f"world size {spec.world_size} is outside 2..{MAX_WORLD_SIZE}")
    if len(spec.members) != spec.world_size:
        raise _bad_spec(f"the plan lists {len(spec.members)} members for world size {spec.world_size}")
    if not MIN_TIMEOUT_MS <= spec.timeout_ms <= MAX_TIMEOUT_MS:
        raise _bad_spec(f"timeout_ms {spec.timeout_ms} is outside {MIN_TIMEOUT_MS}..{MAX_TIMEOUT_MS}")
    if spec.max_bucket_bytes <= 0:
        raise _bad_spec(f"max_bucket_bytes {spec.max_bucket_bytes} must be positive")
    seen_ranks: set[int] = set()
    seen_instances: set[str] = set()
    for m in spec.members:
        if not 0 <= m.group_rank < spec.world_size:
            raise _bad_spec(f"member group rank {m.group_rank} is outside 0..{spec.world_size - 1}")
        if m.group_rank in seen_ranks:
            raise WeightwireError(
                Reason.GROUP_DUPLICATE_RANK,
                f"the plan gives group rank {m.group_rank} to more than one member; ranks must come from each "
                "member's full identity (replica, stage, tensor rank, instance), not a stage-local rank",
                group_rank=str(m.group_rank),
            )
        seen_ranks.add(m.group_rank)
        if m.role not in (pb.TRANSFER_ROLE_TRAINER, pb.TRANSFER_ROLE_WORKER):
            raise _bad_spec(f"member {m.group_rank} has role {m.role} (unspecified or unknown)")
        if not m.instance_id or len(m.instance_id) > 128:
            raise _bad_spec(f"member {m.group_rank} needs an instance id of 1 to 128 characters")
        if m.instance_id in seen_instances:
            raise _bad_spec(f"instance id {clip(m.instance_id, 40)!r} appears for more than one member")
        seen_instances.add(m.instance_id)
        if len(m.worker_id) > 128:
            raise _bad_spec(f"member {m.group_rank}'s worker id is longer than 128 characters")
    if len(spec.subgroups) > MAX_SUBGROUPS:
        raise _bad_spec(f"{len(spec.subgroups)} subgroups; at most {MAX_SUBGROUPS}")
    roles = {m.group_rank: m.role for m in spec.members}
    seen_ids: set[int] = set()
    for sg in spec.subgroups:
        if sg.subgroup_id in seen_ids or sg.subgroup_id < 0:
            raise _bad_spec(f"subgroup id {sg.subgroup_id} is negative or appears twice")
        seen_ids.add(sg.subgroup_id)
        ranks = list(sg.member_ranks)
        if len(ranks) < 2 or ranks != sorted(set(ranks)) or not all(0 <= r < spec.world_size for r in ranks):
            raise _bad_spec(
                f"subgroup {sg.subgroup_id}: members must be 2 or more distinct group ranks, ascending"
            )
        if sg.root_rank not in ranks or roles.get(sg.root_rank) != pb.TRANSFER_ROLE_TRAINER:
            raise _bad_spec(
                f"subgroup {sg.subgroup_id}: root {sg.root_rank} must be one of its members and a trainer"
            )


def own_rank(spec: pb.TransferGroupSpec, me: MemberIdentity) -> int:
    """This member's group rank: the plan's entry whose instance id is ours, which must also carry
    our role, worker id and parallel rank. GROUP_UNKNOWN_MEMBER otherwise (e.g. the trainer read
    our manifest before this process restarted)."""
    m = next((m for m in spec.members if m.instance_id == me.instance_id), None)
    if m is None:
        raise WeightwireError(
            Reason.GROUP_UNKNOWN_MEMBER,
            f"this process ({me.describe()}) is not in the plan of group {spec.group_id} (it lists "
            f"{len(spec.members)} members); it restarted or was never read: read the manifests again and form a new group",
            instance_id=me.instance_id,
        )
    planned = MemberIdentity.from_proto(m)
    if planned != me:
        raise WeightwireError(
            Reason.GROUP_UNKNOWN_MEMBER,
            f"the plan names this process as {planned.describe()} at group rank {m.group_rank}, but it is "
            f"{me.describe()}; read the manifests again and form a new group",
            group_rank=str(m.group_rank),
        )
    return m.group_rank


def message_tag(sequence: int, index: int) -> int:
    """The torch.distributed tag of message ``index`` of the bucket with ``sequence`` (fits 31 bits)."""
    return (sequence % _TAG_SEQUENCE_MODULUS) << _TAG_INDEX_BITS | index


def check_ranges(ranges: Sequence[pb.ByteRange], size_bytes: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of each range, checked: ascending, non-overlapping, non-empty, inside
    ``[0, size_bytes)``, at most MAX_RANGES. No ranges: the whole buffer as one message."""
    if not ranges:
        return [(0, size_bytes)] if size_bytes > 0 else []
    if len(ranges) > MAX_RANGES:
        raise WeightwireError(
            Reason.INVALID_OFFSET, f"{len(ranges)} byte ranges in one bucket; at most {MAX_RANGES}"
        )
    out: list[tuple[int, int]] = []
    end = 0
    for r in ranges:
        if r.size_bytes <= 0 or r.offset_bytes < end or r.offset_bytes + r.size_bytes > size_bytes:
            raise WeightwireError(
                Reason.INVALID_OFFSET,
                f"byte range [{r.offset_bytes}, +{r.size_bytes}) is empty, overlaps the one before it or lies "
                f"outside the payload's {size_bytes} bytes; ranges must be ascending and non-overlapping",
            )
        out.append((r.offset_bytes, r.size_bytes))
        end = r.offset_bytes + r.size_bytes
    return out


__all__ = [
    "ANNOUNCEMENT_INDEX",
    "GROUP_ID_RE",
    "MAX_RANGES",
    "MAX_SUBGROUPS",
    "MAX_TIMEOUT_MS",
    "MAX_WORLD_SIZE",
    "MIN_TIMEOUT_MS",
    "GroupPlan",
    "MemberIdentity",
    "check_ranges",
    "check_spec",
    "clip",
    "message_tag",
    "own_rank",
    "plan_group",
    "spec_digest",
    "split_address",
]
