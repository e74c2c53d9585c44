"""Load under pytest: a short run (4 workers, 5 s) in every CI run, the 16-worker run marked slow.

The figures go to the closing summary; docs/reliability.md records them with the command to rerun.
Assertions are about correctness under repetition (every update verified inside ``run_load``, every
worker CONSISTENT at the last version, no mapping or segment left), never about speed.
"""

from __future__ import annotations

import pathlib

import pytest

from .common import LOAD_REPORTS
from .load import run_load

# Generous: a leak of one update's staging bytes per update would exceed it within a few hundred
# updates; steady state is well under 2 MiB here.
MAX_WORKER_RSS_GROWTH_KIB = 64 * 1024


def _check(workers: int, seconds: float, root: pathlib.Path) -> None:
    report = run_load(workers, seconds, root=root)
    LOAD_REPORTS.append(report.summary())
    assert report.updates >= 1
    assert report.verified_dumps == report.updates * workers
    assert report.segments_left == 0
    assert report.max_rss_growth_kib < MAX_WORKER_RSS_GROWTH_KIB, report.summary()


def test_load_short(tmp_path: pathlib.Path) -> None:
    _check(4, 5.0, tmp_path)


@pytest.mark.slow
def test_load_16_workers(tmp_path: pathlib.Path) -> None:
    _check(16, 30.0, tmp_path)
