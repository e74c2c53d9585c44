"""The worker's part of an update whose every trainer rank is a source (``TRANSFER_MODE_SLICES``):
the regions a bucket lists, checked against the pieces this worker keeps, and received over the
worker's group straight into the tensors it keeps. No gRPC in here.

A slices bucket has no tensor specs: its one payload's ``TransferGroupHandle.slices`` lists this
worker's part of the update's transfer plan (``weightwire.core.transports.transfer_plan``), region by
region in plan order, each with the trainer member that sends it. Before a byte moves the worker
checks that the regions of each named tensor tile exactly the pieces its manifest keeps of it (no
gap, no overlap, nothing outside), that every source is a trainer member of its group, and that the
payload's size is the regions' bytes; then every member of the group compares the plan's
fingerprint with every other (``agree``: once per group and plan) and the bytes arrive (``receive_slices``), each region into
its place in the kept tensor. What is checked is kept for the next update with the same handle (a
trainer sends the same regions every step).
"""

from __future__ import annotations

import bisect
import collections
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from weightwire.core import dtypes
from weightwire.core.errors import Reason, WeightwireError, raises_without_frames
from weightwire.core.manifest import OwnedTensor, ShardManifest
from weightwire.core.transports.transfer_group_agreement import agree
from weightwire.core.transports.transfer_group_plan import clip
from weightwire.core.transports.transfer_group_slices import GroupRanks, Writes, receive_slices
from weightwire.core.transports.transfer_plan import Box, Transfer, TransferPlan, box_elements, kept_boxes
from weightwire.server.transports.host_staging import HostStaging
from weightwire.server.transports.transfer_group_member import JoinedGroup
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["MAX_SLICES", "SlicePlan", "backend_device", "check_slices", "kept_shape", "receive_bucket"]

MAX_SLICES = 65536
MAX_MESSAGE_BYTES = 1 << 30
# The tiling check counts on a grid cut at every region boundary; a tensor cut finer than this is
# refused rather than checked for seconds.
_MAX_GRID_CELLS = 1 << 24
_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{32}\Z")
# The key a worker's own transfers carry as their destination (the plan it rebuilds is only its own).
_SELF = "self"


class SlicePlan:
    """A checked slices handle: this worker's transfers as a plan, and the tensors they fill."""

    def __init__(self, plan: TransferPlan, names: frozenset[str], nbytes: int, trainers: int) -> None:
        self.plan = plan
        self.names = names
        self.nbytes = nbytes
        self.trainers = trainers


def kept_shape(owned: OwnedTensor) -> tuple[int, ...]:
    """The shape of the tensor a worker keeps of ``owned``: its pieces concatenated along their
    dimension (the whole tensor when it lists none)."""
    shape = list(owned.shape)
    if owned.pieces:
        shape[owned.pieces[0].dim] = sum(p.length for p in owned.pieces)
    return tuple(shape)


def _bad(message: str) -> WeightwireError:
    return WeightwireError(Reason.INVALID_GROUP_SPEC, message)


def _trainer_count(spec: pb.TransferGroupSpec) -> int:
    """Trainer members hold group ranks 0 .. M-1 (``plan_group``); the data plane relies on it."""
    trainers = sum(1 for m in spec.members if m.role == pb.TRANSFER_ROLE_TRAINER)
    if any((m.role == pb.TRANSFER_ROLE_TRAINER) != (m.group_rank < trainers) for m in spec.members):
        raise _bad(f"group {spec.group_id}: its trainer members are not group ranks 0..{trainers - 1}")
    return trainers


def _region(s: pb.SliceTransfer, owned: OwnedTensor) -> Box:
    shape = owned.shape
    if len(s.start) != len(shape) or len(s.stop) != len(shape):
        raise WeightwireError(
            Reason.TENSOR_OUT_OF_BOUNDS,
            f"a region of {owned.name!r} has {len(s.start)}/{len(s.stop)} bounds for a tensor of {len(shape)} dimensions",
            tensor=owned.name,
        )
    box = tuple((int(a), int(b)) for a, b in zip(s.start, s.stop, strict=True))
    inside = any(
        all(ka <= a < b <= kb for (a, b), (ka, kb) in zip(box, kb_, strict=True)) for kb_ in kept_boxes(owned)
    )
    if not inside:
        raise WeightwireError(
            Reason.TENSOR_OUT_OF_BOUNDS,
            f"region {box} of {owned.name!r} (shape {tuple(shape)}) is empty or outside what this worker keeps of it "
            f"({[p for p in kept_boxes(owned)]})",
            tensor=owned.name,
        )
    return box


def _check_tiling(owned: OwnedTensor, boxes: Sequence[Box]) -> None:
    """The regions cover every kept element of ``owned`` exactly once: counted on the grid the
    regions' and pieces' boundaries cut (each region lies inside a kept piece already)."""
    kept = kept_boxes(owned)
    cuts = [sorted({v for b in (*kept, *boxes) for v in b[d]}) for d in range(len(owned.shape))]
    cells = 1
    for c in cuts:
        cells *= max(1, len(c) - 1)
    if cells > _MAX_GRID_CELLS:
        raise _bad(f"{owned.name!r} arrives as {len(boxes)} regions, cut too finely to check")

    def index(box: Box) -> tuple[slice, ...]:
        return tuple(
            slice(bisect.bisect_left(c, a), bisect.bisect_left(c, b))
            for c, (a, b) in zip(cuts, box, strict=True)
        )

    count = torch.zeros([max(1, len(c) - 1) for c in cuts], dtype=torch.int32)
    for b in boxes:
        count[index(b)] += 1
    need = torch.zeros_like(count, dtype=torch.bool)
    for b in kept:
        need[index(b)] = True
    if bool((count[need] != 1).any()):
        twice = bool((count[need] > 1).any())
        raise WeightwireError(
            Reason.TENSOR_OUT_OF_BOUNDS if twice else Reason.INCOMPLETE_UPDATE,
            f"the regions of {owned.name!r} "
            + ("overlap" if twice else "leave part of what this worker keeps uncovered")
            + "; each kept element must arrive exactly once",
            tensor=owned.name,
        )


def check_slices(payload: pb.Payload, spec: pb.TransferGroupSpec, manifest: ShardManifest) -> SlicePlan:
    """Every rule of a slices payload that needs no bytes; raises WeightwireError."""
    h = payload.transfer_group
    if h.group_id != spec.group_id:
        raise WeightwireError(
            Reason.GROUP_NOT_JOINED,
            f"the bucket names transfer group {clip(h.group_id, 80)!r}, but this worker is in group {spec.group_id}; form the group again",
            group_id=clip(h.group_id, 80),
        )
    if len(h.slices) > MAX_SLICES:
        raise _bad(f"{len(h.slices)} regions in one bucket; at most {MAX_SLICES}")
    if not _FINGERPRINT_RE.match(h.plan_fingerprint):
        raise _bad("plan_fingerprint must be 32 lowercase hex characters")
    if not 1 <= h.max_message_bytes <= MAX_MESSAGE_BYTES:
        raise _bad(f"max_message_bytes {h.max_message_bytes} is outside 1..{MAX_MESSAGE_BYTES}")
    trainers = _trainer_count(spec)
    transfers: list[Transfer] = []
    by_tensor: dict[str, list[Box]] = collections.defaultdict(list)
    total = 0
    for s in h.slices:
        owned = manifest.tensors.get(s.tensor)
        if owned is None:
            raise WeightwireError(
                Reason.TENSOR_OUT_OF_BOUNDS,
                f"the bucket sends a region of {clip(s.tensor, 120)!r}, which this worker does not keep",
                tensor=clip(s.tensor, 120),
            )
        if not 0 <= s.source_rank < trainers:
            raise _bad(
                f"source rank {s.source_rank} of a region of {owned.name!r} is not a trainer member of group {spec.group_id}"
            )
        box = _region(s, owned)
        nbytes = box_elements(box) * dtypes.itemsize(owned.dtype)
        total += nbytes
        by_tensor[owned.name].append(box)
        transfers.append(Transfer(owned.name, box, s.source_rank, (_SELF,), nbytes, tuple(owned.shape)))
    for name, boxes in by_tensor.items():
        _check_tiling(manifest.tensors[name], boxes)
    if payload.size_bytes != total:
        raise WeightwireError(
            Reason.INVALID_SIZE,
            f"payload says size_bytes {payload.size_bytes}, but its regions hold {total} bytes",
        )
    return SlicePlan(
        TransferPlan(tuple(transfers), h.plan_fingerprint), frozenset(by_tensor), total, trainers
    )


def check_kept(kept: Mapping[str, torch.Tensor], manifest: ShardManifest, names: frozenset[str]) -> None:
    """The adapter's kept tensors have the kept shapes and dtypes (a bug there would misplace bytes)."""
    for name in names:
        owned = manifest.tensors[name]
        t = kept.get(name)
        if t is None or tuple(t.shape) != kept_shape(owned) or dtypes.from_torch(t.dtype) != owned.dtype:
            got = "none" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise WeightwireError(
                Reason.INTERNAL,
                f"the engine adapter keeps {name!r} as {got}, not {kept_shape(owned)} {dtypes.name(owned.dtype)} as its manifest says",
                tensor=name,
            )


def backend_device(group: Any, kept: Mapping[str, torch.Tensor]) -> torch.device:
    """Where the group's backend moves this worker's bytes from: the host for gloo (a GPU's kept
    tensor receives through a host mirror), the kept tensors' GPU for NCCL."""
    if group.backend == pb.TRANSFER_BACKEND_NCCL and kept:
        return next(iter(kept.values())).device
    return torch.device("cpu")


@raises_without_frames
def receive_bucket(
    member: JoinedGroup,
    checked: SlicePlan,
    max_message_bytes: int,
    kept: Mapping[str, torch.Tensor],
    manifest: ShardManifest,
    staging: dict[object, torch.Tensor],
    lock: threading.Lock,
    will_write: Callable[[], None],
    host: HostStaging,
    stopped: Callable[[], bool] | None = None,
    landings: list[Callable[[], None]] | None = None,
    ordinal: int = 0,
) -> int:
    """Agree on the plan with every member (at the update's first bucket, ``ordinal`` 0, unless
    the group agreed on it at an earlier update: ``transfer_group_agreement``; the trainer ranks
    decide the same way), check every source's announcement, then (after
    ``will_write``: from here on bytes may land in the model) receive every region into ``kept``.
    Returns the bytes received; TRANSFER_FAILED / GROUP_PLAN_MISMATCH / MESSAGE_TRUNCATED on
    failure, CANCELLED as soon as ``stopped()`` (the update's call ended) while the plans are
    compared or the sources' announcements awaited, where a silent trainer rank holds every
    member (nothing was written yet; the caller tears down). Once every source announced its
    messages, the receives into the kept tensors wait for the senders or their sockets closing,
    up to the group's timeout: gloo offers no way to end a posted receive sooner, and one given up
    on would still write into the model when its sender sends after all. What it raises leaves its
    frames behind, so that the group the caller then closes is destroyed at once and its peers'
    operations on it fail. With ``landings``, bytes a staging process group holds back
    (``isolated_gloo``) land only when the caller runs what is appended to it (at the commit).
    ``ordinal``: this bucket's place among the update's slices buckets; its buffers are kept apart
    from the other buckets' (``staging``), so that one update's buckets, landed at its commit,
    never share one, and the next update with the same split finds each bucket's ready. ``host``:
    where the host copies of kept tensors on a GPU come from over gloo (the group's, kept for the
    next update)."""
    group = member.group
    pg = group.process_group()
    timeout_s = group.timeout.total_seconds()
    into = dict(kept)
    mirrors: dict[str, torch.Tensor] = {}
    if group.backend == pb.TRANSFER_BACKEND_GLOO:
        # gloo receives into host memory: a kept tensor on a GPU gets its bytes through a host copy.
        for name in checked.names:
            if into[name].device.type != "cpu":
                mirrors[name] = into[name] = host.take(name, into[name].shape, into[name].dtype)
    own = cast(dict[Any, torch.Tensor], cast(dict[object, Any], staging).setdefault(("bucket", ordinal), {}))
    with lock:
        if ordinal == 0:
            agree(
                pg,
                checked.plan,
                group.rank,
                group.world_size,
                timeout_s,
                stopped,
                backend_device(group, into),
                member.agreed_plans,
            )
        received = receive_slices(
            pg,
            checked.plan,
            GroupRanks(checked.trainers, (_SELF,)),
            _SELF,
            into,
            manifest.tensors,
            timeout_s=timeout_s,
            max_message_bytes=max_message_bytes,
            staging=own,
            writes=Writes(will_write, landings),
            stopped=stopped,
        )

    def mirror() -> None:
        for name, held in mirrors.items():
            kept[name].copy_(held)

    if landings:
        landings.append(mirror)  # after the landing into the host mirrors
    else:
        mirror()
    with member.cond:
        member.bytes_received += received
    return received
