"""The typed records trainer ranks exchange during one multi-rank update, and their strict decoding.

Each exchange of ``weightwire.client.ranks.collective_push`` carries one of these, as JSON (never
pickle) through ``RankGroup.exchange``: ``PlanRecord`` before anything moves, ``RankOutcome`` before
any commit, ``RankResults`` at the end; an every-rank-a-source update (``slice_push``) says its plan
with ``SlicesPlanRecord``, and forming its group (``transfer_group_sources``) who each rank is with
``MemberRecord``. A record is decoded field by field with its type checked; a
missing or extra field, or a value of another type (a rank running another weightwire release, or
a bug), is refused with ``TRAINER_RANKS_DISAGREE`` naming the rank and the field instead of being
read with a default.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from weightwire.client.inputs.types import PushResult
from weightwire.client.ranks.rank_agreement import (
    RankGroup,
    UpdateDigest,
    error_record,
    failure_of,
    failure_record,
    label_of,
    label_text,
    result_of,
    result_record,
)
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.text import clip

_WHY_CHARS = 2000


class RecordError(WeightwireError):
    """A record from another rank that this rank cannot read."""

    def __init__(self, rank: int, what: str, problem: str) -> None:
        super().__init__(
            Reason.TRAINER_RANKS_DISAGREE,
            f"trainer rank {rank} sent {what} this rank cannot read ({problem}); every rank must run the same "
            "weightwire release",
            rank=str(rank),
        )


def _take(d: object, fields: Mapping[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """``d``'s fields, exactly ``fields`` with those types (ValueError naming the first that is not)."""
    if not isinstance(d, dict):
        raise ValueError(f"a {type(d).__name__} where an object belongs")
    if set(d) != set(fields):
        missing, extra = sorted(set(fields) - set(d)), sorted(set(d) - set(fields))
        raise ValueError(f"fields missing {missing}, unexpected {extra}")
    for name, kind in fields.items():
        value = d[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            raise ValueError(f"field {name!r} is a {type(value).__name__}")
    return d


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


_NONE = type(None)


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """Why a rank could not plan or push: reason, status code and message."""

    reason: str
    code: str
    message: str

    @classmethod
    def of(cls, err: BaseException) -> RankFailure:
        rec = error_record(err)
        return cls(rec["reason"], rec["code"], rec["message"])

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: object) -> RankFailure:
        f = _take(d, {"reason": str, "code": str, "message": str})
        return cls(f["reason"], f["code"], clip(f["message"], _WHY_CHARS))


@dataclasses.dataclass(frozen=True)
class PlanRecord:
    """One rank's plan of the update: its digest (None when it could not plan), the device label its
    payloads carry (None for unlabelled transports), and its error."""

    digest: UpdateDigest | None
    label: DeviceRef | None
    error: RankFailure | None

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest.to_json() if self.digest is not None else None,
            "label": label_text(self.label),
            "error": self.error.to_json() if self.error is not None else None,
        }

    @classmethod
    def from_json(cls, d: object) -> PlanRecord:
        f = _take(d, {"digest": (dict, _NONE), "label": (str, _NONE), "error": (dict, _NONE)})
        digest = None
        if f["digest"] is not None:
            types = {
                fl.name: (int if fl.type in ("int", int) else str) for fl in dataclasses.fields(UpdateDigest)
            }
            digest = UpdateDigest(**_take(f["digest"], types))
        label = label_of(f["label"]) if f["label"] is not None else None
        error = RankFailure.from_json(f["error"]) if f["error"] is not None else None
        return cls(digest, label, error)


@dataclasses.dataclass(frozen=True)
class SlicesPlanRecord:
    """One rank's plan of an every-rank-a-source update (``slice_push``): the transfer plan's
    fingerprint ("" when it could not plan), the group it still holds with these workers ("" for
    none), what it pushes (version, scope, update id, cast_to, the bucket size that splits each
    worker's part) and its error."""

    fingerprint: str
    group: str
    version: int
    scope: int
    update_id: str
    cast_to: str
    error: RankFailure | None
    bucket_bytes: int

    @property
    def update(self) -> list[object]:
        """What every rank must push alike, as the disagreement names it."""
        return [self.version, self.scope, self.update_id, self.cast_to, self.bucket_bytes]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self)
        out["error"] = self.error.to_json() if self.error is not None else None
        return out

    @classmethod
    def from_json(cls, d: object) -> SlicesPlanRecord:
        f = _take(
            d,
            {
                "fingerprint": str,
                "group": str,
                "version": int,
                "scope": int,
                "update_id": str,
                "cast_to": str,
                "error": (dict, _NONE),
                "bucket_bytes": int,
            },
        )
        error = RankFailure.from_json(f["error"]) if f["error"] is not None else None
        return cls(
            f["fingerprint"],
            f["group"],
            f["version"],
            f["scope"],
            f["update_id"],
            f["cast_to"],
            error,
            f["bucket_bytes"],
        )


@dataclasses.dataclass(frozen=True)
class MemberRecord:
    """Who a rank is in the transfer group it is about to form with the others (its instance id),
    or why it cannot take part (rank 0 could not serve the rendezvous store)."""

    instance: str
    error: RankFailure | None

    def to_json(self) -> dict[str, Any]:
        return {"instance": self.instance, "error": self.error.to_json() if self.error is not None else None}

    @classmethod
    def from_json(cls, d: object) -> MemberRecord:
        f = _take(d, {"instance": str, "error": (dict, _NONE)})
        return cls(f["instance"], RankFailure.from_json(f["error"]) if f["error"] is not None else None)


@dataclasses.dataclass(frozen=True)
class DeltaDecisionRecord:
    """What a rank knows for deciding whether a multi-rank push goes as a delta: the base version
    its keeper holds (0: none) and, from rank 0, whether every worker holds that base consistently
    and whether a worker restarted since its manifest was read; ``crc32c``: whether this rank can
    compute CRC-32C result checksums (and, from rank 0, every worker verifies them)."""

    base: int
    at_base: bool
    restarted: bool
    crc32c: bool

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: object) -> DeltaDecisionRecord:
        f = _take(d, {"base": int, "at_base": bool, "restarted": bool, "crc32c": bool})
        return cls(f["base"], f["at_base"], f["restarted"], f["crc32c"])


class StopCause(enum.Enum):
    """Why a rank is not fine at the commit gate."""

    NONE = "none"  # it is fine: every bucket went out and was acked
    OWN = "own"  # something went wrong on this rank (a worker failed, an export, a deadline)
    FOLLOWED = "followed"  # it stopped only because another rank was not fine


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """Whether a rank's workers acked everything, and if not why."""

    ok: bool
    cause: StopCause
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "cause": self.cause.value, "why": clip(self.why, _WHY_CHARS)}

    @classmethod
    def from_json(cls, d: object) -> RankOutcome:
        f = _take(d, {"ok": bool, "cause": str, "why": str})
        return cls(f["ok"], StopCause(f["cause"]), clip(f["why"], _WHY_CHARS))


@dataclasses.dataclass(frozen=True)
class RankResults:
    """What one rank's workers answered: results of those that committed, failures of the others."""

    results: dict[str, PushResult]
    failures: dict[str, WeightwireError]

    def to_json(self) -> dict[str, Any]:
        return {
            "results": {a: result_record(r) for a, r in self.results.items()},
            "failures": {a: failure_record(e) for a, e in self.failures.items()},
        }

    @classmethod
    def from_json(cls, d: object) -> RankResults:
        f = _take(d, {"results": dict, "failures": dict})
        return cls(
            {str(a): result_of(_take(r, _RESULT_FIELDS)) for a, r in f["results"].items()},
            {str(a): failure_of(_take(e, _FAILURE_FIELDS)) for a, e in f["failures"].items()},
        )


# JSON types of PushResult's fields as its annotations name them (a float field may arrive as an int).
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int,
    "float": (float, int),
    "str": str,
    "tuple[str, ...]": list,
}
_RESULT_FIELDS: dict[str, type | tuple[type, ...]] = {
    fl.name: _JSON_TYPES[str(fl.type)] for fl in dataclasses.fields(PushResult)
}
_FAILURE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "reason": str,
    "code": str,
    "message": str,
    "worker": (str, _NONE),
    "metadata": dict,
}

Record = TypeVar(
    "Record", PlanRecord, RankOutcome, RankResults, SlicesPlanRecord, MemberRecord, DeltaDecisionRecord
)


def exchange(ranks: RankGroup, record: Record, what: str) -> list[Record]:
    """Every rank's record of the same kind as ``record`` (this rank's own at its index)."""
    raw = json.dumps(record.to_json(), sort_keys=True, separators=(",", ":")).encode()
    out: list[Record] = []
    for r, data in enumerate(ranks.exchange(raw, what)):
        try:
            out.append(type(record).from_json(json.loads(data.decode())))
        except (ValueError, TypeError, KeyError) as e:
            raise RecordError(r, what, clip(str(e), 300)) from None
    return out


def digests(records: Sequence[PlanRecord]) -> list[dict[str, Any]]:
    """The ranks' digests as ``disagreement`` compares them (every record must carry one)."""
    return [r.digest.to_json() for r in records if r.digest is not None]


__all__ = [
    "DeltaDecisionRecord",
    "MemberRecord",
    "PlanRecord",
    "RankFailure",
    "RankOutcome",
    "RankResults",
    "RecordError",
    "SlicesPlanRecord",
    "StopCause",
    "digests",
    "exchange",
]
