"""The end of a multi-rank update: every rank's outcome (the commit gate: all commit or none), then
every rank's results, so every rank returns the same results or raises the same ``PushError``.

``weightwire.client.ranks.collective_push`` exchanges these records (``rank_records``) on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightwire.client.inputs.types import PushResult
from weightwire.client.ranks.rank_records import RankOutcome, RankResults, StopCause
from weightwire.core.errors import PushError, Reason, WeightwireError

__all__ = ["abort_reason", "merged_results", "own_outcome"]


def own_outcome(ok: bool, problem: str | None, stopped_by: str | None) -> RankOutcome:
    """This rank's outcome: its own problem, else that it followed ``stopped_by`` (every rank stopped
    at a bucket that rank was not fine with), else ``ok``."""
    if problem is not None:
        return RankOutcome(ok, StopCause.OWN, problem)
    if stopped_by is not None:
        return RankOutcome(ok, StopCause.FOLLOWED, f"it stopped because {stopped_by} was not fine")
    return RankOutcome(ok, StopCause.NONE if ok else StopCause.OWN, "")


def abort_reason(outcomes: Sequence[RankOutcome]) -> str | None:
    """None when every rank may commit, else why every rank aborts."""
    bad = [(r, o) for r, o in enumerate(outcomes) if not o.ok]
    if not bad:
        return None
    # Name a rank with a cause of its own before the ones that only stopped because of it.
    bad.sort(key=lambda ro: ro[1].cause is StopCause.FOLLOWED)
    r, o = bad[0]
    return f"trainer rank {r} could not complete the update ({o.why or 'no reason given'})"


def merged_results(
    records: Sequence[RankResults], aborted: str | None, me: int, endpoints: Sequence[str]
) -> dict[str, PushResult]:
    """Every rank's results, in ``endpoints`` order; raises the ``PushError`` of every failure (the
    workers' own before the ones cancelled because of them), or of ``aborted`` when none failed."""
    all_results: dict[str, PushResult] = {}
    root: dict[str, WeightwireError] = {}
    cancelled: dict[str, WeightwireError] = {}
    for rec in records:
        all_results.update(rec.results)
        for a, err in rec.failures.items():
            (cancelled if err.reason == Reason.CANCELLED.name else root)[a] = err
    if root or cancelled or aborted is not None:
        if not root and not cancelled:
            root[f"trainer rank {me}"] = WeightwireError(Reason.TRAINER_RANK_FAILED, aborted or "aborted")
        raise PushError({**root, **cancelled}, dict(all_results))  # type: ignore[arg-type]
    order = {a: i for i, a in enumerate(endpoints)}
    return dict(sorted(all_results.items(), key=lambda kv: order.get(kv[0], len(order))))
