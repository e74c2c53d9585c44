"""The pusher's kept stream-reader threads: they run every task, stay bounded, and never hold up
interpreter exit while a stream is still being read."""

from __future__ import annotations

import subprocess
import sys
import threading

from weightwire.client.readers import ReaderThreads


def test_runs_every_task_on_bounded_daemon_threads() -> None:
    pool = ReaderThreads(3, "test-reader")
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
        "from weightwire.client.readers import ReaderThreads\n"
        "pool = ReaderThreads(2, 'r')\n"
        "pool.submit(lambda: threading.Event().wait(600))\n"
        "print('submitted', flush=True)\n"
    )
    # A non-daemon reader would keep this process alive for ten minutes; the guard is generous.
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "submitted"
