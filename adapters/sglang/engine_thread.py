"""Hand work from the worker service's gRPC thread to SGLang's scheduler thread.

SGLang runs every forward pass on its scheduler thread. Writing parameters from another thread
while a batch runs would mix old and new weights inside one forward, so the SGLang adapter never
touches the model itself: it submits each step (begin, load one bucket, end) to an
``EngineTaskQueue`` and waits; the plugin's hook on ``Scheduler.process_input_requests`` calls ``drain()``
once per pass of the event loop, between batches, which is where SGLang handles its own
``update_weights_from_tensor`` requests too. ``on_submit`` runs after each submit: the plugin uses
it to wake a scheduler that sleeps on idle (``wake.py``).

Used by ``weightwire.adapters.sglang.adapter`` (submit) and ``plugin`` (drain); tests drain from a
fake scheduler loop.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from weightwire.core.errors import Reason, WeightwireError

T = TypeVar("T")


class EngineTaskQueue:
    """Callables submitted from any thread, run in order by whichever thread calls ``drain``."""

    def __init__(self, *, timeout_s: float = 300.0, on_submit: Callable[[], None] | None = None) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future[object]]] = (
            queue.SimpleQueue()
        )
        self._timeout_s = timeout_s
        self._on_submit = on_submit
        self._drain_thread: int | None = None
        self.drained_tasks = 0

    def call(self, fn: Callable[[], T], *, what: str) -> T:
        """Run ``fn`` on the engine thread and return its result (or raise its exception).

        If the engine thread does not pick the task up within the timeout (event loop stuck or
        dead), the task is withdrawn and LOAD_FAILED raised. A task already running is always
        waited for: it may be reading the caller's tensors, which stay mapped only until we return.
        """
        if threading.get_ident() == self._drain_thread:
            # Called from a drained task: run inline (would otherwise wait on itself).
            return fn()
        fut: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._tasks.put((fn, fut))
        if self._on_submit is not None:
            self._on_submit()
        try:
            return fut.result(timeout=self._timeout_s)  # type: ignore[return-value]
        except concurrent.futures.TimeoutError:
            if fut.cancel():
                raise WeightwireError(
                    Reason.LOAD_FAILED,
                    f"SGLang's scheduler thread did not pick up '{what}' within {self._timeout_s:g} s: "
                    "is its event loop running? (WEIGHTWIRE_SGLANG_ENGINE_TIMEOUT_S sets this limit)",
                ) from None
            return fut.result()  # type: ignore[return-value]

    def drain(self, *, linger: Callable[[], float] | None = None) -> int:
        """Run every queued task on the calling thread; returns how many ran. Never raises: a
        task's exception goes to the thread that submitted it.

        With ``linger``, when the queue is empty, wait up to ``linger()`` seconds (0: not at all)
        for one more task before returning. The wait blocks on a lock, which releases
        the GIL: SGLang's idle event loop is pure Python and otherwise holds it nearly all the time,
        so the worker's gRPC threads in the same process (accepting a stream, receiving the next
        bucket, opening its handle) would get it only at each interpreter switch interval.
        """
        ran = 0
        self._drain_thread = threading.get_ident()
        try:
            while True:
                try:
                    fn, fut = self._tasks.get_nowait()
                except queue.Empty:
                    wait_s = linger() if linger is not None else 0.0
                    if wait_s <= 0:
                        return ran
                    try:
                        fn, fut = self._tasks.get(timeout=wait_s)
                    except queue.Empty:
                        return ran
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)
                except BaseException as e:
                    # Interpreter shutdown: release the waiting thread, then let it propagate.
                    fut.set_exception(e)
                    raise
                ran += 1
                self.drained_tasks += 1
        finally:
            self._drain_thread = None
