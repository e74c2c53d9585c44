"""A worker's gloo receiving process started in advance imports torch at the idle scheduling
priority (it must take no CPU from the update the worker receives meanwhile), and runs at the normal
one once the worker takes it for a group."""

from __future__ import annotations

import os
import sys
import time

import pytest
from weightwire.core.transports.isolated_gloo import ReceivingProcess, foreground

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling policies")


def _policies(pid: int) -> set[int]:
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(os.sched_getscheduler(int(tid)))
        except OSError:
            pass  # the thread ended meanwhile
    return out


def test_a_receiving_process_starts_idle_and_runs_at_normal_priority_once_taken() -> None:
    proc = ReceivingProcess()
    try:
        # Its first step, before importing torch (not waited for: at the idle priority on a busy
        # machine that can take long, which is the point).
        deadline = time.monotonic() + 30.0
        while os.sched_getscheduler(proc.pid) != os.SCHED_IDLE:
            assert time.monotonic() < deadline, "the receiving process did not start at the idle priority"
            time.sleep(0.01)
        foreground(proc.pid)  # what taking it for a group does
        proc.wait_ready(60.0)
        assert _policies(proc.pid) == {os.SCHED_OTHER}  # its threads, started since, too
        assert proc.alive
    finally:
        proc.kill()
