"""A trainer rank's sends of an update whose every rank is a source, on a thread of their own
(``RankSends``): started, stopped when the update is called off, waited for; and how a failed send
lets go of its process group (``let_go``). ``weightwire.client.ranks.slice_push`` runs them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from weightwire.core.errors import Reason, WeightwireError

__all__ = ["RankSends", "let_go"]

# How long a rank told to stop its sends (rank 0 called the update off) waits for them to end: the
# plan's comparison ends within its next poll; sends on a group that every other member tears down
# fail at once.
_STOP_GRACE_S = 5.0


class RankSends:
    """This rank's part of the plan, sent on a thread of its own (``send(stopped)``, which returns
    its error): started on rank 0 once every worker's bucket is queued (the last route's
    ``queued``), on the others right away. ``stop`` ends the plan's comparison, where the sends wait for workers that refused the update at its
    header and never take part (CANCELLED); a rank other than 0 stops so when rank 0 calls the
    update off (``wait``'s ``watch``)."""

    def __init__(self, send: Callable[[Callable[[], bool]], WeightwireError | None]) -> None:
        self._stop = threading.Event()
        self._send = lambda: send(self._stop.is_set)
        self._thread: threading.Thread | None = None
        # Set when the sends ended, or when rank 0 called the update off (``called_off``).
        self._ended = threading.Event()
        self.called_off: str | None = None
        self.error: WeightwireError | None = None

    def start(self) -> None:
        # A thread starts on GPU 0: the sends run on the caller's current GPU (NCCL sends from it,
        # ``TransferGroupOptions.device`` asks it at each use).
        gpu = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def run() -> None:
            if gpu is not None:
                torch.cuda.set_device(gpu)
            try:
                self.error = self._send()
            finally:
                self._ended.set()

        self._thread = threading.Thread(target=run, name="weightwire-slices-send", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the sends: the plan's comparison ends (CANCELLED), and ``wait`` waits for the
        sends only ``_STOP_GRACE_S``."""
        self._stop.set()
        self._ended.set()

    def wait(self, watch: Callable[[threading.Event], str | None] | None = None) -> WeightwireError | None:
        """The sends' error, once they ended (or why they never started). ``watch(ended)``: blocks
        until rank 0 calls the update off (its reason) or ``ended`` is set; watched meanwhile on a
        thread of its own, and a call-off stops the sends. Stopped sends are waited for
        ``_STOP_GRACE_S`` at most, then left to end at the group's timeout (CANCELLED)."""
        thread = self._thread
        if thread is None:
            return WeightwireError(
                Reason.TRANSFER_FAILED, "the update stopped before this rank's sends started"
            )
        if watch is not None:

            def watching() -> None:
                why = watch(self._ended)
                if why is not None:
                    self.called_off = why
                    self.stop()

            threading.Thread(target=watching, name="weightwire-call-off-watch", daemon=True).start()
        self._ended.wait()
        if self._stop.is_set():
            thread.join(_STOP_GRACE_S)
            if self.called_off is not None:
                return WeightwireError(
                    Reason.CANCELLED,
                    f"trainer rank 0 called the update off: {self.called_off}",
                    trainer_rank="0",
                )
            if thread.is_alive():
                return WeightwireError(
                    Reason.CANCELLED,
                    f"the update was called off, and this rank's sends did not end within {_STOP_GRACE_S:g} s "
                    "(they end at the group's timeout)",
                )
        thread.join()
        return self.error


def let_go(held: list[Any]) -> None:
    """Drop the references in ``held`` (a process group) on a thread of their own. A group torn
    down while an operation posted on it never ends (a plan comparison that workers which refused
    the update never join) is destroyed where its last reference goes, and its destructor waits for
    that operation, up to the group's timeout: never on the thread whose end the update waits for."""
    threading.Thread(target=held.clear, name="weightwire-group-release", daemon=True).start()
