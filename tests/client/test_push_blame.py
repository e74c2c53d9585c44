"""Blame across workers of real ``weightwire serve`` processes: a worker that refused an update for
its own reason is reported with that reason, even when the client had already cancelled its stream
because another worker refused first; CANCELLED is kept for a worker the client really cancelled."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engines import CONFIG, Engine, layout, start_engine
from prometheus_client import CollectorRegistry
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.client import PushError, WeightPusher
from weightwire.client.observe.trainer_metrics import TrainerMetrics
from weightwire.core.errors import Reason

pytestmark = pytest.mark.timeout(180)

# The first refusal cancels the other stream while that worker's own refusal is on its way; that
# race went the client's way in about half the pushes before the fix, so a few rounds show it.
_ROUNDS = 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = start_engine(layout(tp=2, pp=1), tmp_path_factory.mktemp("dumps"))
    yield eng
    eng.stop()


def _versions(pusher: WeightPusher) -> dict[str, int]:
    return {a: s.weights_version for a, s in pusher.status().items()}


def test_every_stale_worker_reports_its_own_stale_version(engine: Engine) -> None:
    """Each worker's reported reason is the one it recorded itself (GetStatus.last_error) whenever
    it ruled on this update; CANCELLED only for one whose stream ended before it ruled."""
    full = full_checkpoint(CONFIG, 1)
    registry = CollectorRegistry()
    with WeightPusher(engine.addresses, transport="host_shm", metrics=TrainerMetrics(registry)) as pusher:
        current = max(_versions(pusher).values())
        pusher.push(full, version=current + 5)
        own_reasons = 0
        for _ in range(_ROUNDS):
            failed_before = {a: s.updates_failed for a, s in pusher.status().items()}
            with pytest.raises(PushError) as e:
                pusher.push(full, version=current + 2)
            failures = e.value.failures
            assert set(failures) == set(engine.addresses)
            assert next(iter(failures.values())).kind is Reason.STALE_VERSION  # the worker at fault first
            for address, status in pusher.status().items():
                err = failures[address]
                assert err.worker == address
                if status.updates_failed == failed_before[address] + 1:  # it recorded this update
                    assert status.last_error.version == current + 2
                    assert (err.code, err.reason) == (status.last_error.code, status.last_error.reason), str(
                        e.value
                    )
                    own_reasons += err.kind is Reason.STALE_VERSION
                else:
                    assert err.kind is Reason.CANCELLED, str(e.value)
        assert own_reasons > _ROUNDS  # most rounds, both workers ruled (and said so)
        assert _versions(pusher) == dict.fromkeys(engine.addresses, current + 5)
    # The trainer's failure counter carries the same reasons as the errors.
    counted = {
        reason: sum(
            registry.get_sample_value(
                "weightwire_trainer_worker_failures_total", {"worker": w, "reason": reason}
            )
            or 0
            for w in ("tp0-pp0", "tp1-pp0")
        )
        for reason in ("STALE_VERSION", "CANCELLED")
    }
    assert counted == {"STALE_VERSION": own_reasons, "CANCELLED": 2 * _ROUNDS - own_reasons}


def test_a_worker_cancelled_because_another_refused_is_cancelled_and_consistent(engine: Engine) -> None:
    full = full_checkpoint(CONFIG, 2)
    stale, fresh = engine.addresses
    with WeightPusher(engine.addresses, transport="host_shm") as pusher:
        current = max(_versions(pusher).values())
        pusher.push(full, version=current + 1)
        with WeightPusher([stale], transport="host_shm") as ahead:
            ahead.push(full, version=current + 10)
        with pytest.raises(PushError) as e:
            pusher.push(full, version=current + 5)
        failures = e.value.failures
        assert failures[stale].kind is Reason.STALE_VERSION
        # The fresh worker would have taken the update; the client cancelled it: CANCELLED, naming
        # the worker at fault and the state the worker says it was left in.
        assert failures[fresh].kind is Reason.CANCELLED, str(e.value)
        assert "because tp0-pp0 failed" in failures[fresh].message
        assert "its state: " in failures[fresh].message
        assert list(failures) == [stale, fresh]  # the worker at fault first
        assert _versions(pusher) == {stale: current + 10, fresh: current + 1}
