"""The receiving process a worker starts in advance (``isolated_gloo``), so that forming a group
never waits for one to start.

Starting one takes seconds (an interpreter importing torch), which would count against the group's
formation timeout. So a worker starts its first one with itself (``start_spare``), and whenever it
takes one for a group it starts the next (``take_receiving_process``): while a group is formed a
worker has two. One started in advance imports torch at the idle scheduling priority, so that it
takes no CPU from an update the worker is receiving meanwhile (``idle_priority``).
"""

from __future__ import annotations

import threading

from weightwire.core.transports.idle_priority import foreground
from weightwire.core.transports.isolated_gloo import ReceivingProcess

__all__ = ["discard_spare", "start_spare", "take_receiving_process"]

# How long a new receiving process may take to import torch and say it is ready.
_START_TIMEOUT_S = 60.0

_spare: ReceivingProcess | None = None
_spare_lock = threading.Lock()


def take_receiving_process(timeout_s: float, group_id: str) -> ReceivingProcess:
    """A started receiving process for group ``group_id``: the one started in advance when there is
    one; another is started in advance at once, for the next group (a trainer that forms a new
    group makes the worker leave this one and join that one in the same call)."""
    global _spare
    with _spare_lock:
        taken, _spare = _spare, None
        if taken is None or not taken.alive:
            taken = ReceivingProcess()
        _spare = ReceivingProcess()
    taken.group_id = group_id
    foreground(taken.pid)  # it may still be starting: from here on it is on the group's clock
    taken.wait_ready(min(max(timeout_s, 1.0), _START_TIMEOUT_S))
    return taken


def start_spare() -> None:
    """Start a receiving process in advance for the first group (the worker starts), so that
    joining it costs no start-up."""
    global _spare
    with _spare_lock:
        if _spare is None or not _spare.alive:
            _spare = ReceivingProcess()


def discard_spare() -> None:
    """The worker stops: end the process started in advance, if any."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None:
        spare.kill()
