"""weightwire's errors survive pickling with their reason, message, metadata and failures: Ray,
multiprocessing and concurrent.futures pickle what a worker raises (the verl checkpoint engine runs
in Ray actors), and the default rebuild from ``args`` fails for these constructors."""

from __future__ import annotations

import pickle

from weightwire.client.inputs.dtensor_gather import RankLostError
from weightwire.client.inputs.plan import PlanError
from weightwire.core.errors import PushError, Reason, WeightwireError


def _round_trip(err: BaseException) -> BaseException:
    return pickle.loads(pickle.dumps(err))


def test_a_worker_error_keeps_its_reason_message_and_metadata() -> None:
    err = WeightwireError(Reason.STALE_VERSION, "version 3 is not newer than 5", worker="unix:/w0", base="5")
    back = _round_trip(err)
    assert type(back) is WeightwireError
    assert (back.kind, back.reason, back.code, back.message, back.worker, back.metadata) == (
        Reason.STALE_VERSION,
        "STALE_VERSION",
        "FAILED_PRECONDITION",
        "version 3 is not newer than 5",
        "unix:/w0",
        {"base": "5"},
    )
    assert str(back) == str(err)


def test_a_push_error_keeps_every_worker_failure() -> None:
    failures = {
        "w0": WeightwireError(Reason.SHAPE_MISMATCH, "mlp.gate_proj.weight: shape (8, 4) is not (16, 4)"),
        "w1": WeightwireError(Reason.CANCELLED, "another worker failed"),
    }
    back = _round_trip(PushError(failures, {"w2": "committed"}))
    assert isinstance(back, PushError)
    assert {w: (e.kind, e.message) for w, e in back.failures.items()} == {
        w: (e.kind, e.message) for w, e in failures.items()
    }
    assert back.results == {"w2": "committed"}
    assert "SHAPE_MISMATCH" in str(back)


def test_subclasses_with_their_own_constructors_round_trip() -> None:
    plan = _round_trip(
        PlanError(Reason.UNKNOWN_TENSOR, "no worker owns lm_head.weight", tensor="lm_head.weight")
    )
    assert (
        type(plan) is PlanError
        and plan.kind is Reason.UNKNOWN_TENSOR
        and plan.metadata["tensor"] == "lm_head.weight"
    )
    lost = _round_trip(RankLostError("trainer rank 1 is gone", rank="1"))
    assert type(lost) is RankLostError
    assert isinstance(lost, PushError) and isinstance(lost, WeightwireError)
    assert lost.kind is Reason.TRAINER_RANK_LOST and lost.metadata == {"rank": "1"} and lost.failures == {}
