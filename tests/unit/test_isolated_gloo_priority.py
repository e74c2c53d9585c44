"""A worker's gloo receiving process started in advance imports torch at the idle scheduling
priority (it must take no CPU from the update the worker receives meanwhile), and runs at the normal
one once the worker takes it for a group."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from weightwire.core.transports.idle_priority import foreground
from weightwire.core.transports.isolated_gloo import ReceivingProcess

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


_WITHOUT_SYS_NICE = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"]


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0, reason="needs setpriv and root")
def test_a_receiving_process_that_could_not_leave_the_idle_priority_starts_at_the_normal_one() -> None:
    """Without CAP_SYS_NICE (an unprivileged user, a container's default capabilities) a thread at
    the idle priority may not return to the normal one: the receiving process then never goes idle,
    and forms its group as usual."""
    script = textwrap.dedent(
        """
        import os, time
        from weightwire.core.transports.isolated_gloo import ReceivingProcess
        proc = ReceivingProcess()
        try:
            seen = set()
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                seen.add(os.sched_getscheduler(proc.pid))
                time.sleep(0.005)
            proc.wait_ready(60.0)
            seen.add(os.sched_getscheduler(proc.pid))
            print(sorted(seen), proc.alive)
        finally:
            proc.kill()
        """
    )
    out = subprocess.run(
        [*_WITHOUT_SYS_NICE, sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [f"[{os.SCHED_OTHER}]", "True"], out.stdout
