"""``push`` reuses the plan of an earlier push with the same names, dtypes and shapes against the
same manifests (``jobs.TensorPlans``): the planning checks are skipped, the contents still land, and
anything that changes the answer (a shape, the scope, re-read manifests) is planned and checked
again. Against a real in-process worker over gRPC."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import InProcessWorker
from weightwire.adapters.torch.demo import expected_shard, full_checkpoint
from weightwire.client import PlanError, WeightPusher
from weightwire.client.inputs import plan as planning
from weightwire.core.manifest import ParallelRank


def test_same_push_again_skips_the_checks_and_a_change_is_checked(
    inproc_worker: Callable[..., InProcessWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = inproc_worker(ParallelRank())
    checked: list[int] = []
    full_check = planning.check_update
    monkeypatch.setattr(
        planning,
        "check_update",
        lambda specs, *a, **k: (checked.append(len(specs)), full_check(specs, *a, **k))[1],
    )
    with WeightPusher([worker.address], bucket_size_bytes=32 * 1024) as pusher:
        for version in (1, 2, 3):
            full = full_checkpoint(worker.config, seed=version)
            pusher.push(full.items(), version=version)
            want = expected_shard(full, worker.rank, worker.config)
            assert all(torch.equal(worker.state()[k], v) for k, v in want.items())
        assert len(checked) == 1  # planned and checked once, reused twice

        # A wrong shape is never served the old plan: it is checked, refused, nothing sent.
        bad = dict(full_checkpoint(worker.config, seed=4))
        name = next(iter(bad))
        bad[name] = torch.zeros(3, 3)
        with pytest.raises(PlanError):
            pusher.push(bad.items(), version=4)
        assert len(checked) == 2
        assert pusher.status()[worker.address].weights_version == 3

        # Another scope, then re-read manifests: planned again each time.
        pusher.push(full_checkpoint(worker.config, seed=5).items(), version=5, scope="partial")
        assert len(checked) == 3
        pusher.refresh_manifests()
        pusher.push(full_checkpoint(worker.config, seed=6).items(), version=6)
        assert len(checked) == 4
