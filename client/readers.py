"""Kept daemon threads that read the responses of update streams, shared by every update of one
``WeightPusher`` (``weightwire.client.session`` submits one read per worker stream)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class ReaderThreads:
    """Kept daemon threads that read update streams (starting a thread per worker per push costs
    more than the push's own Python work). Daemon, unlike a ThreadPoolExecutor's workers, so a
    trainer that exits with a push in flight is not held up until the stream's deadline."""

    def __init__(self, max_threads: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._max = max_threads
        self._name = name
        self._mu = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[[], None]) -> None:
        with self._mu:
            if self._closed:
                raise RuntimeError("the pusher is closed")
            self._tasks.put(fn)
            if self._idle > 0:
                self._idle -= 1
                return
            if self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._run, name=f"{self._name}-{self._threads}", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn = self._tasks.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # a reader reports its own errors; never let one kill the thread
                log.exception("stream reader failed")
            with self._mu:
                self._idle += 1

    def shutdown(self) -> None:
        with self._mu:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._tasks.put(None)

