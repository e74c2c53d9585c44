"""The typed records trainer ranks exchange: a round trip keeps every field, and a record another
release (or a bug) shaped differently is refused with a reason, never read with defaults."""

from __future__ import annotations

import json

import pytest
import torch
from weightwire.client.inputs.plan import TensorSpec
from weightwire.client.inputs.types import PushResult
from weightwire.client.ranks.rank_agreement import UpdateDigest
from weightwire.client.ranks.rank_records import (
    PlanRecord,
    RankFailure,
    RankOutcome,
    RankResults,
    StopCause,
)
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb


def _wire(d: dict) -> object:
    return json.loads(json.dumps(d))


def _digest() -> UpdateDigest:
    return UpdateDigest.of(
        version=3,
        scope="1",
        routing="own_device",
        sender_rank=0,
        specs=[TensorSpec("w", torch.float32, (2,))],
        layouts=["local"],
        endpoints=["unix:/a"],
        fingerprints={"unix:/a": "f"},
        settings={"bucket": 1},
    )


def test_records_round_trip() -> None:
    plan = PlanRecord(
        _digest(),
        DeviceRef(pb.DEVICE_KIND_HOST, "boot-1"),
        RankFailure("STALE_VERSION", "FAILED_PRECONDITION", "old"),
    )
    assert PlanRecord.from_json(_wire(plan.to_json())) == plan
    outcome = RankOutcome(False, StopCause.FOLLOWED, "it stopped because trainer rank 1 was not fine")
    assert RankOutcome.from_json(_wire(outcome.to_json())) == outcome
    result = PushResult(
        "unix:/a",
        "tp0-pp0",
        3,
        2,
        4,
        64,
        1,
        1,
        0.5,
        0.25,
        "host_shm",
        "CONSISTENT",
        source_devices=("host:boot-1",),
    )
    err = WeightwireError(Reason.CANCELLED, "cancelled", worker="unix:/b")
    back = RankResults.from_json(_wire(RankResults({"unix:/a": result}, {"unix:/b": err}).to_json()))
    assert back.results == {"unix:/a": result}
    assert back.failures["unix:/b"].reason == "CANCELLED" and back.failures["unix:/b"].worker == "unix:/b"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("why"),
        lambda d: d.update(extra=1),
        lambda d: d.update(ok="yes"),
        lambda d: d.update(cause="maybe"),
        lambda d: d.update(why=7),
    ],
)
def test_a_malformed_outcome_is_refused(mutate) -> None:  # type: ignore[no-untyped-def]
    d = RankOutcome(True, StopCause.NONE, "").to_json()
    mutate(d)
    with pytest.raises((ValueError, TypeError)):
        RankOutcome.from_json(_wire(d))


def test_a_digest_with_a_field_of_another_type_is_refused() -> None:
    d = PlanRecord(_digest(), None, None).to_json()
    d["digest"]["version"] = "3"
    with pytest.raises(ValueError, match="version"):
        PlanRecord.from_json(_wire(d))
    d["digest"]["version"] = True  # a bool is not an int here
    with pytest.raises(ValueError, match="version"):
        PlanRecord.from_json(_wire(d))


def test_results_with_a_field_missing_are_refused() -> None:
    result = PushResult("unix:/a", "tp0-pp0", 3, 2, 4, 64, 1, 1, 0.5, 0.25, "host_shm", "CONSISTENT")
    d = RankResults({"unix:/a": result}, {}).to_json()
    del d["results"]["unix:/a"]["bytes_loaded"]
    with pytest.raises(ValueError, match="bytes_loaded"):
        RankResults.from_json(_wire(d))
