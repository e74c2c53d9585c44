"""Blame names each worker so a person can find it: by its worker id, and where engines started
apart gave two workers the same id (one engine per replica or machine), by id and address."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from weightwire.client.update.blame import collect_results
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import PushError, Reason, WeightwireError
from weightwire.core.manifest import ParallelRank, ShardManifest


def _manifest(worker_id: str) -> ShardManifest:
    return ShardManifest.build(
        DeviceRef("cpu", "b0070000-0000-0000-0000-000000000000"), ParallelRank(), [], worker_id=worker_id
    )


def _stream(error: WeightwireError | None, *, cancelled_by_us: bool = False) -> Any:
    """What ``collect_results`` reads of a finished ``WorkerStream``: no result, its error."""
    return SimpleNamespace(
        result=None, error=error, acks=[], sent_jobs=[1], cancelled_by_us=cancelled_by_us, settled_status=None
    )


def _failures(ids: dict[str, str]) -> dict[str, WeightwireError]:
    lost = WeightwireError(Reason.UNAVAILABLE, "the worker went away", code="UNAVAILABLE")
    streams = {
        a: _stream(lost if a == "10.0.0.2:5000" else _cancelled(), cancelled_by_us=a != "10.0.0.2:5000")
        for a in ids
    }
    with pytest.raises(PushError) as err:
        collect_results(
            streams,
            {a: _manifest(w) for a, w in ids.items()},
            timeout_s=60,
            committed=False,
            deadline_hit=False,
            first_failure="10.0.0.2:5000",
        )
    return dict(err.value.failures)


def _cancelled() -> WeightwireError:
    return WeightwireError(Reason.CANCELLED, "cancelled by the client", code="CANCELLED")


def test_two_engines_with_the_same_worker_ids_are_told_apart_by_address() -> None:
    failures = _failures({"10.0.0.1:5000": "tp0-pp0", "10.0.0.1:5001": "tp1-pp0", "10.0.0.2:5000": "tp0-pp0"})
    assert failures["10.0.0.2:5000"].reason == "UNAVAILABLE"
    assert failures["10.0.0.2:5000"].message.startswith("worker tp0-pp0 at 10.0.0.2:5000: ")
    assert failures["10.0.0.1:5000"].message.startswith("worker tp0-pp0 at 10.0.0.1:5000: update cancelled")
    assert "because tp0-pp0 at 10.0.0.2:5000 failed" in failures["10.0.0.1:5000"].message
    # An id no other worker has stays as it is.
    assert failures["10.0.0.1:5001"].message.startswith(
        "worker tp1-pp0: update cancelled because tp0-pp0 at 10.0.0.2:5000 failed"
    )


def test_unique_worker_ids_name_the_workers_alone() -> None:
    failures = _failures({"10.0.0.1:5000": "tp0-pp0", "10.0.0.2:5000": "tp1-pp0"})
    assert failures["10.0.0.2:5000"].message.startswith("worker tp1-pp0: ")
    assert "because tp1-pp0 failed" in failures["10.0.0.1:5000"].message
