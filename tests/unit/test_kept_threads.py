"""Kept threads (``weightwire.core.kept_threads``), as the pusher's response readers and the
worker's request readers use them: they run every task, stay bounded when bounded, never queue a
task when unbounded, end when idle, and never hold up interpreter exit while a stream is read."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from weightwire.core.kept_threads import KeptThreads


def test_runs_every_task_on_bounded_daemon_threads() -> None:
    pool = KeptThreads(3, "test-reader")
    release = threading.Event()
    started = threading.Semaphore(0)
    seen: list[str] = []
    names: set[str] = set()

    def blocked() -> None:
        names.add(threading.current_thread().name)
        assert threading.current_thread().daemon
        started.release()
        release.wait(30)
        seen.append("blocked")

    for _ in range(5):
        pool.submit(blocked)
    for _ in range(3):
        assert started.acquire(timeout=30)
    # At most three threads exist; the other two tasks wait for one of them.
    assert not started.acquire(timeout=0.2)
    release.set()
    for _ in range(2):
        assert started.acquire(timeout=30)
    pool.shutdown()
    for t in [t for t in threading.enumerate() if t.name.startswith("test-reader")]:
        t.join(30)
    assert seen == ["blocked"] * 5
    assert len(names) <= 3


def test_a_reader_still_blocked_does_not_hold_up_exit() -> None:
    script = (
        "import threading\n"
        "from weightwire.core.kept_threads import KeptThreads\n"
        "pool = KeptThreads(2, 'r')\n"
        "pool.submit(lambda: threading.Event().wait(600))\n"
        "print('submitted', flush=True)\n"
    )
    # A non-daemon reader would keep this process alive for ten minutes; the guard is generous.
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "submitted"


def test_unbounded_threads_never_queue_a_task_and_idle_ones_end() -> None:
    pool = KeptThreads(None, "test-unbounded", idle_exit_s=2.0)
    release = threading.Event()
    started = threading.Semaphore(0)

    def blocked() -> None:
        started.release()
        release.wait(30)

    for _ in range(6):
        pool.submit(blocked)
    # Every task runs at once: none waits for another to end.
    for _ in range(6):
        assert started.acquire(timeout=30)
    assert pool.threads == 6
    release.set()
    deadline = time.monotonic() + 30
    while pool.idle < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Reused while idle: a task submitted now starts no new thread.
    ran = threading.Event()
    pool.submit(ran.set)
    assert ran.wait(30)
    assert pool.threads == 6
    # Idle past idle_exit_s, every thread ends.
    for t in [t for t in threading.enumerate() if t.name.startswith("test-unbounded")]:
        t.join(30)
    assert pool.threads == 0
    pool.submit(ran.clear)  # a new thread starts when none is left
    for t in [t for t in threading.enumerate() if t.name.startswith("test-unbounded")]:
        t.join(30)
    assert not ran.is_set() and pool.threads == 0
