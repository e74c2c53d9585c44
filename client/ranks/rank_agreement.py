"""How the ranks of a trainer agree on one update before, during and after it: small exchanges of
bytes over the trainer's own process group, with a deadline, and the checks on what they carry.

``weightwire.client.ranks.collective_push`` runs, on every rank and in the same order:

1. ``agree``: each rank's ``UpdateDigest`` (version, scope, the tensors' names, dtypes and full
   shapes, the endpoints and the manifests it planned against, the routing, bucket settings) and its
   device label are exchanged; any difference, or any rank that could not plan, fails the update on
   every rank with a reason before a byte moves (``TRAINER_RANKS_DISAGREE``, ``TRAINER_RANK_FAILED``).
2. per bucket, ``step``: a flag (this rank is still fine) and, in the gathered routing, this rank's
   exported payload for the bucket. Everyone stops at the same bucket when anyone is not fine.
3. before any commit, ``outcomes``: whether each rank's workers acked every bucket; commit only when
   all did, abort everywhere otherwise; then the results and failures of every rank, so each rank
   returns the same results or raises the same ``PushError``.

Records are typed (``weightwire.client.ranks.rank_records``), travel as JSON (never pickle) and are
bounded in size. A collective that fails (a rank died) or does
not finish within the deadline (a rank is not taking part) raises ``RankLostError``.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from weightwire.client.inputs.dtensor_gather import RankLostError, all_gather_single
from weightwire.client.inputs.plan import PlanError, TensorSpec
from weightwire.client.inputs.types import PushResult
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ShardManifest

# Bounds on what one rank sends: a per-bucket step (flag and one serialised Payload), and any other
# record (digests, outcomes, the results of every worker a rank pushed to).
STEP_SLOT_BYTES = 4096
# What one rank's record of ``RankGroup.exchange`` may take to go in one collective (with its size).
EXCHANGE_SLOT_BYTES = 2048
MAX_RECORD_BYTES = 8 * 1024 * 1024
_MESSAGE_CHARS = 2000


class RankGroup:
    """The trainer's process group as an update uses it: every rank sends a few bytes and receives
    everyone's, with a deadline. NCCL groups exchange through the current CUDA device, others (gloo)
    through CPU tensors."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "a multi-rank push needs torch.distributed to be initialised (init_process_group)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the process group passed as group=")
        self.backend = str(dist.get_backend(group))
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.timeout = datetime.timedelta(seconds=max(0.001, float(timeout_s)))

    def _all_gather(self, t: torch.Tensor, what: str) -> torch.Tensor:

        out = t.new_empty((self.size, *t.shape))
        try:
            work = all_gather_single(out.reshape(-1), t.reshape(-1), group=self.group, async_op=True)
            work.wait(timeout=self.timeout)
            return out.cpu()
        except RuntimeError as e:
            text = str(e).splitlines()[0][:500] if str(e) else type(e).__name__
            raise RankLostError(
                f"trainer rank {self.rank}: the ranks' exchange of {what} failed ({text}): a rank died, or is not "
                f"calling push within {self.timeout.total_seconds():g} s (every rank must run the same push). "
                "Nothing was committed by this rank; the process group is out of step, so restart the trainer's ranks.",
                rank=str(self.rank),
            ) from e

    def exchange(self, data: bytes, what: str, *, max_bytes: int = MAX_RECORD_BYTES) -> list[bytes]:
        """Every rank's ``data`` (``data`` itself at this rank's index). One collective of a
        fixed slot per rank (its size and, when it fits, its bytes) where every rank's data fits
        ``EXCHANGE_SLOT_BYTES`` (the plan and outcome records of an update that goes well); a
        second one of the largest data's size otherwise."""
        if len(data) > max_bytes:
            raise ValueError(f"{what}: {len(data)} bytes is more than the {max_bytes} a rank may send")
        room = EXCHANGE_SLOT_BYTES - 8
        slot = torch.zeros(EXCHANGE_SLOT_BYTES, dtype=torch.uint8)
        slot[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        if 0 < len(data) <= room:
            slot[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = self._all_gather(slot.to(self.device), what)
        # Every rank reads the same sizes, so every rank takes the same branch.
        sizes = [max(0, min(int(n), max_bytes)) for n in rows[:, :8].clone().view(torch.int64).reshape(-1)]
        if max(sizes) <= room:
            return [bytes(rows[i, 8 : 8 + sizes[i]].numpy().tobytes()) for i in range(self.size)]
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = self._all_gather(buf.to(self.device), what)
        return [bytes(rows[i, : sizes[i]].numpy().tobytes()) for i in range(self.size)]

    def step(self, ok: bool, payload: bytes, what: str) -> list[tuple[bool, bytes]]:
        """One fixed-size slot per rank (one collective): a flag and up to ``STEP_SLOT_BYTES`` bytes."""
        if len(payload) > STEP_SLOT_BYTES - 16:
            raise ValueError(
                f"{what}: a payload of {len(payload)} bytes does not fit a {STEP_SLOT_BYTES}-byte step"
            )
        slot = torch.zeros(STEP_SLOT_BYTES, dtype=torch.uint8)
        head = torch.tensor([1 if ok else 0, len(payload)], dtype=torch.int64)
        slot[:16] = head.view(torch.uint8)
        if payload:
            slot[16 : 16 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = self._all_gather(slot.to(self.device), what)
        out: list[tuple[bool, bytes]] = []
        for i in range(self.size):
            flag, length = rows[i, :16].clone().view(torch.int64).tolist()
            length = max(0, min(int(length), STEP_SLOT_BYTES - 16))
            out.append((bool(flag), bytes(rows[i, 16 : 16 + length].numpy().tobytes())))
        return out


# --------------------------------------------------------------------------------------------
# Before the update: the same update on every rank
# --------------------------------------------------------------------------------------------


def _sha(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _spec_text(s: TensorSpec) -> str:
    return f"{s.name}:{str(s.dtype).removeprefix('torch.')}:{'x'.join(map(str, s.shape))}"


@dataclasses.dataclass(frozen=True)
class UpdateDigest:
    """What must be the same on every rank for one update to be one update. Each field is compared on
    its own, so a mismatch can say which part differs."""

    version: int
    scope: str
    routing: str
    sender_rank: int
    tensor_count: int
    names_in_order: str
    specs: str
    layouts: str
    endpoints: str
    manifests: str
    settings: str

    @classmethod
    def of(
        cls,
        *,
        version: int,
        scope: str,
        routing: str,
        sender_rank: int,
        specs: Sequence[TensorSpec],
        layouts: Sequence[str],
        endpoints: Sequence[str],
        fingerprints: Mapping[str, str],
        settings: Mapping[str, object],
    ) -> UpdateDigest:
        return cls(
            version=version,
            scope=scope,
            routing=routing,
            sender_rank=sender_rank,
            tensor_count=len(specs),
            names_in_order=_sha(s.name for s in specs),
            specs=_sha(sorted(_spec_text(s) for s in specs)),
            layouts=_sha(sorted(f"{s.name}@{lay}" for s, lay in zip(specs, layouts, strict=True))),
            endpoints=_sha(sorted(endpoints)),
            manifests=_sha(sorted(f"{a}={fingerprints.get(a, '')}" for a in endpoints)),
            settings=_sha(f"{k}={settings[k]}" for k in sorted(settings)),
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELD_WORDS = {
    "version": "the version",
    "scope": "the scope",
    "routing": "the routing",
    "sender_rank": "the sending rank",
    "tensor_count": "the number of tensors",
    "names_in_order": "the order of the tensors",
    "specs": "the tensors' names, dtypes or full shapes",
    "layouts": "how the tensors are sharded (DTensor mesh and placements, or a plain local tensor)",
    "endpoints": "the worker endpoints",
    "manifests": "the workers' manifests (a worker restarted between the ranks' reads?)",
    "settings": "the pusher settings (bucket size, alignment, transport, flags, dtype conversion)",
}


def disagreement(digests: Sequence[Mapping[str, Any]]) -> str | None:
    """None when every rank's digest is the same, else a message naming each differing part with
    every rank's value (hashes shortened), e.g. ``the version: rank 0 = 5, rank 1 = 4``."""
    first = digests[0]
    lines: list[str] = []
    for field in UpdateDigest.__dataclass_fields__:
        values = [d.get(field) for d in digests]
        if any(v != first.get(field) for v in values):
            # The order only matters when the set of tensors is the same.
            if field == "names_in_order" and any(d.get("specs") != first.get("specs") for d in digests):
                continue
            shown = ", ".join(f"rank {i} = {str(v)[:12]}" for i, v in enumerate(values))
            lines.append(f"{_FIELD_WORDS[field]}: {shown}")
    if not lines:
        return None
    return (
        "the trainer ranks are not pushing the same update (every rank must call push with the same version, "
        "scope, endpoints, routing and the same tensors in the same order; nothing was sent):\n  "
        + "\n  ".join(lines)
    )


def error_record(err: BaseException) -> dict[str, str]:
    """A rank's failure as it travels to the other ranks (reason, status code, message)."""
    if isinstance(err, WeightwireError):
        return {"reason": err.reason, "code": err.code, "message": err.message[:_MESSAGE_CHARS]}
    failures = getattr(err, "failures", None)
    if isinstance(failures, Mapping) and failures:
        worker, first = next(iter(failures.items()))
        return {
            "reason": getattr(first, "reason", Reason.INTERNAL.name),
            "code": getattr(first, "code", "UNKNOWN"),
            "message": f"{worker}: {getattr(first, 'message', first)}"[:_MESSAGE_CHARS],
        }
    return {
        "reason": Reason.INTERNAL.name,
        "code": "INTERNAL",
        "message": f"{type(err).__name__}: {err}"[:_MESSAGE_CHARS],
    }


def peer_failed(rank: int, record: Mapping[str, str], before_sending: bool) -> WeightwireError:
    """What the other ranks raise when ``rank`` failed with ``record``."""
    tail = "; nothing was sent to any worker" if before_sending else "; no worker committed"
    cls = PlanError if before_sending else WeightwireError
    return cls(
        Reason.TRAINER_RANK_FAILED,
        f"trainer rank {rank} failed: {record.get('reason')}: {record.get('message')}{tail}",
        rank=str(rank),
        rank_reason=str(record.get("reason", "")),
    )


# --------------------------------------------------------------------------------------------
# Devices: which rank sends to which worker
# --------------------------------------------------------------------------------------------


def label_text(label: DeviceRef | None) -> str | None:
    return None if label is None else f"{label.kind}:{label.uuid}"


def label_of(text: str | None) -> DeviceRef | None:
    if text is None:
        return None
    kind, _, uuid = text.partition(":")
    return DeviceRef(int(kind), uuid)


def rank_for_device(
    device: DeviceRef, labels: Sequence[DeviceRef | None], prefer: int | None = None
) -> int | None:
    """The rank whose payloads a worker on ``device`` imports: ``prefer`` when its label fits, else the
    lowest such rank. A rank without a label (inline bytes) fits every worker."""
    from weightwire.core.devices import is_own_device

    fits = [r for r, lb in enumerate(labels) if lb is None or is_own_device(lb, device)]
    if not fits:
        return None
    return prefer if prefer in fits else fits[0]


def unplaced_workers(
    manifests: Mapping[str, ShardManifest], labels: Sequence[DeviceRef | None], routing: str
) -> str | None:
    """A message for the workers no rank can give a payload from their own device, or None."""
    missing = [(a, m) for a, m in manifests.items() if rank_for_device(m.device, labels) is None]
    if not missing:
        return None
    shown = "\n  ".join(f"{m.worker_id or a} ({a}) is on {m.device}" for a, m in missing[:12])
    more = f"\n  ... and {len(missing) - 12} more" if len(missing) > 12 else ""
    ranks = ", ".join(f"rank {r} on {lb}" for r, lb in enumerate(labels))
    return (
        f"{len(missing)} worker(s) are on a device no trainer rank is on (routing={routing!r}; nothing was sent):\n  "
        f"{shown}{more}\nThe ranks are: {ranks}. Run a trainer rank on each engine device, or push from a process "
        "that can label a payload for those devices."
    )


# --------------------------------------------------------------------------------------------
# After the update: every rank's results and failures
# --------------------------------------------------------------------------------------------


def result_record(r: PushResult) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    d["source_devices"] = list(r.source_devices)
    return d


def result_of(d: Mapping[str, Any]) -> PushResult:
    fields = {f.name for f in dataclasses.fields(PushResult)}
    kw = {k: v for k, v in d.items() if k in fields}
    kw["source_devices"] = tuple(kw.get("source_devices", ()))
    return PushResult(**kw)


def failure_record(err: WeightwireError) -> dict[str, Any]:
    return {
        "reason": err.reason,
        "code": err.code,
        "message": err.message[:_MESSAGE_CHARS],
        "worker": err.worker,
        "metadata": {k: v[:_MESSAGE_CHARS] for k, v in list(err.metadata.items())[:16]},
    }


def failure_of(d: Mapping[str, Any]) -> WeightwireError:
    return WeightwireError(
        str(d.get("reason", "UNKNOWN")),
        str(d.get("message", "")),
        code=str(d.get("code", "UNKNOWN")),
        worker=d.get("worker") or None,
        **{str(k): str(v) for k, v in dict(d.get("metadata", {})).items()},
    )


__all__ = [
    "MAX_RECORD_BYTES",
    "STEP_SLOT_BYTES",
    "RankGroup",
    "UpdateDigest",
    "disagreement",
    "error_record",
    "failure_of",
    "failure_record",
    "label_of",
    "label_text",
    "peer_failed",
    "rank_for_device",
    "result_of",
    "result_record",
    "unplaced_workers",
]
