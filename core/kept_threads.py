"""Kept daemon threads for blocking reads of update streams, reused across streams.

Starting a thread costs a hand-off to the new thread (``Thread.start`` waits until it runs), which
on a busy host is a large share of a small update's cost. The trainer reads its workers' responses
on them (``weightwire.client.update.session``, a bounded set per pusher); a worker reads each PushWeights
stream's requests on them (``weightwire.server.worker.streams``, as many as streams are open, each let go
after a minute idle).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

__all__ = ["KeptThreads"]

log = logging.getLogger(__name__)


class KeptThreads:
    """Daemon threads that run submitted tasks, started only when none is idle.

    ``max_threads`` bounds them (None: one per task running at once, so no task ever waits for
    another to end; a blocking read must never queue behind another stream's read). With
    ``idle_exit_s`` a thread idle that long ends. Daemon, unlike a ThreadPoolExecutor's workers, so
    a process that exits with a stream still open is not held up until the stream's deadline.
    """

    def __init__(self, max_threads: int | None, name: str, *, idle_exit_s: float | None = None) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._max = max_threads
        self._name = name
        self._idle_exit_s = idle_exit_s
        self._mu = threading.Lock()
        self._threads = 0
        self._started = 0
        self._idle = 0
        self._closed = False

    @property
    def threads(self) -> int:
        """How many threads exist now."""
        return self._threads

    @property
    def idle(self) -> int:
        """How many of them wait for a task."""
        return self._idle

    def submit(self, fn: Callable[[], None]) -> None:
        with self._mu:
            if self._closed:
                raise RuntimeError("these threads were shut down")
            self._tasks.put(fn)
            if self._idle > 0:
                self._idle -= 1
                return
            if self._max is None or self._threads < self._max:
                self._threads += 1
                self._started += 1
                threading.Thread(target=self._run, name=f"{self._name}-{self._started}", daemon=True).start()

    def _next(self) -> Callable[[], None] | None:
        """The next task; None when shut down or idle for ``idle_exit_s`` (then this thread is gone)."""
        try:
            return self._tasks.get(timeout=self._idle_exit_s)
        except queue.Empty:
            with self._mu:
                # A task put under the lock while this thread counted as idle is this thread's.
                try:
                    return self._tasks.get_nowait()
                except queue.Empty:
                    self._idle -= 1
                    self._threads -= 1
                    return None

    def _run(self) -> None:
        while True:
            fn = self._next()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # a task reports its own errors; never let one kill the thread
                log.exception("task on a kept thread failed")
            # Not kept while idle: a task holds what it works on (a stream, its update, its tensors).
            del fn
            with self._mu:
                self._idle += 1

    def shutdown(self) -> None:
        with self._mu:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._tasks.put(None)
