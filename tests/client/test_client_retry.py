"""A push that failed on one worker and cancelled the others returns only once the cancelled updates
have ended on their workers, so a trainer that retries at once is never refused (UPDATE_IN_PROGRESS)
because of its own failed update. Real worker processes: one whose engine loads slowly, one whose
engine fails every load a little sooner."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from engines import CONFIG
from helpers import WorkerProcess, spawn_worker
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.client import PushError, WeightPusher
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = pytest.mark.timeout(180)

_SCRIPT = os.path.join(os.path.dirname(__file__), "paced_worker.py")
# The slow worker is still inside its load when the other worker's load fails.
SLOW_LOAD_S = 1.0
FAILING_LOAD_S = 0.2
ATTEMPTS = 6


@pytest.fixture(scope="module")
def slow_and_failing() -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    slow = spawn_worker(
        command=[sys.executable, _SCRIPT, "--load-delay-s", str(SLOW_LOAD_S), "--worker-id", "slow"],
        timeout=90,
    )
    try:
        failing = spawn_worker(
            command=[
                sys.executable,
                _SCRIPT,
                "--load-delay-s",
                str(FAILING_LOAD_S),
                "--fail-loads",
                "--worker-id",
                "failing",
            ],
            timeout=90,
        )
    except BaseException:
        slow.stop()
        raise
    yield slow, failing
    failing.stop()
    slow.stop()


def test_an_immediate_retry_is_never_refused_by_its_own_cancelled_update(
    slow_and_failing: tuple[WorkerProcess, WorkerProcess],
) -> None:
    slow, failing = slow_and_failing
    full = full_checkpoint(CONFIG, seed=1)
    with WeightPusher([slow.address, failing.address], timeout_s=60) as pusher:
        for attempt in range(1, ATTEMPTS + 1):
            with pytest.raises(PushError) as refused:
                pusher.push(full, version=attempt)
            failures = refused.value.failures
            assert failures[failing.address].reason == "LOAD_FAILED", refused.value
            # Cancelled because the other worker failed, never refused as busy with the previous attempt.
            assert failures[slow.address].reason == "CANCELLED", refused.value
            # push returned only after the cancelled update ended on the slow worker.
            statuses = pusher.status()
            assert statuses[slow.address].state != pb.WORKER_STATE_UPDATING, attempt
            assert statuses[slow.address].weights_version == 0
