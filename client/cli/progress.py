"""A progress bar for long pushes, drawn by ``rich`` on stderr, and silent when stderr is not a terminal.

``PushProgressBar`` is a ``progress`` callback for ``WeightPusher.push`` / ``push_flat`` /
``push_gathered`` (``weightwire push`` uses it). Use it as a context manager so the bar is finished
(or removed) whatever happens::

    with WeightPusher(addresses) as pusher, PushProgressBar() as bar:
        pusher.push(model.state_dict(), version=step, progress=bar)

The pusher calls it from its stream-reader threads, once per bucket acked by every recipient;
``rich.progress.Progress`` takes its own lock. In a log file, a pipe or CI (stderr not a terminal)
it draws nothing: ``enabled`` is False and every call returns at once.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from weightwire.client.inputs.types import PushProgress


class PushProgressBar:
    """Bytes acked by every recipient out of the update's bytes, buckets, speed and elapsed time."""

    def __init__(self, description: str = "push", *, stream: TextIO | None = None) -> None:
        out = stream if stream is not None else sys.stderr
        self.enabled = _is_terminal(out)
        self._description = description
        self._lock = threading.Lock()
        self._task: TaskID | None = None
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[buckets]} buckets"),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            # Decided above, not by rich (which would also believe FORCE_COLOR in a CI log).
            console=Console(file=out, force_terminal=self.enabled),
            disable=not self.enabled,
        )
        self._started = False

    def __enter__(self) -> PushProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, p: PushProgress) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self._task is None:
                self._progress.start()
                self._started = True
                self._task = self._progress.add_task(
                    self._description,
                    total=max(p.bytes_total, 1),
                    completed=p.bytes_done,
                    buckets=f"{p.buckets_done}/{p.buckets_total}",
                )
        self._progress.update(
            self._task, completed=p.bytes_done, buckets=f"{p.buckets_done}/{p.buckets_total}"
        )

    def close(self) -> None:
        """Draw the last state and stop (idempotent)."""
        with self._lock:
            if self._started:
                self._progress.stop()
                self._started = False


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
