"""The scheduling priority of a worker's gloo receiving process (``isolated_gloo``).

A worker starts its next receiving process in advance while it may be receiving an update, and that
process's import of torch (seconds of CPU) must not take the cores from the update: it starts at
the idle scheduling priority (``SCHED_IDLE``), where it may leave it again (``enter_idle``), and is
raised to the normal one when it is taken for a group, a few seconds after its start, and when it
forms a group (``foreground``: every thread, gloo's included). Where the platform has no such
policies, or Linux does not let the process return (no CAP_SYS_NICE, an RLIMIT_NICE that forbids
nice 0), it starts and stays at the normal priority: one left at the idle priority beside busy
engine threads would starve.

Kept free of heavy imports: the receiving process calls ``enter_idle`` before it imports torch.
"""

from __future__ import annotations

import os
import threading

__all__ = ["enter_idle", "foreground", "may_leave_idle"]


def may_leave_idle() -> bool:
    """Whether a thread of this process may go back from the idle scheduling priority to the normal
    one: tried on a thread of its own, which then ends."""
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            allowed.append(True)
        except (AttributeError, OSError):
            pass

    thread = threading.Thread(target=probe, name="weightwire-priority-probe")
    thread.start()
    thread.join()
    return bool(allowed)


def enter_idle() -> None:
    """This thread (and the threads it starts) at the idle priority, where it may leave it again."""
    if may_leave_idle():
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def foreground(pid: int) -> None:
    """Every thread of process ``pid`` at the normal scheduling priority again; nothing where the
    platform has no such policies."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE:
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except (AttributeError, OSError, ValueError):
            pass  # the thread ended, or the policy is not ours to change
