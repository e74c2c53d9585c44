"""Waiting for a transfer group's posted operations: every wait within the group's timeout, and,
for a worker's update whose call may end (cancelled, past its deadline), a wait that ends with
CANCELLED as soon as it does. Used by ``transfer_group_slices`` (every trainer rank a source).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from weightwire.core.errors import Reason, WeightwireError, without_frames
from weightwire.core.transports.transfer_group import transfer_error

__all__ = ["post", "until", "wait", "watch_receives"]

# How often a wait that watches for its call's end looks: at first often (most operations end
# within microseconds of each other), then at most this rarely.
_FIRST_POLL_S = 0.0002
_LAST_POLL_S = 0.05


def post(op: Any, what: str) -> Any:
    """Post a send or receive; one the backend refuses at once (a peer already gone) is
    TRANSFER_FAILED, as a failed wait is."""
    try:
        return op()
    except RuntimeError as e:
        raise transfer_error(e, what) from None


def wait(
    work: Any,
    timeout_s: float,
    what: str,
    stopped: Callable[[], bool] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Wait for a posted operation within the group's timeout: a peer that died or never sends
    ends it with TRANSFER_FAILED (gloo fails a pending receive at once when its peer's sockets
    close, and at the timeout otherwise), never a hang. With ``stopped`` (a worker's update whose
    call may end: cancelled, past its deadline) the wait also ends with CANCELLED as soon as
    ``stopped()``: the operation is watched (``is_completed``) rather than waited on, since a wait
    that times out finishes it. Only for collectives: gloo marks a point-to-point receive completed
    only inside its wait, and nothing but the peer's sockets closing or the timeout ends that wait
    (``watch_receives`` watches such waits on a thread of their own). ``metadata`` goes into the
    error (the peer's rank, so that whoever reads it can tell which member went away)."""
    if stopped is not None:
        deadline = time.monotonic() + timeout_s
        until(work.is_completed, deadline, what, stopped, getattr(work, "completed", None))
        timeout_s = max(deadline - time.monotonic(), 0.001)
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise transfer_error(e, what, **(metadata or {})) from None


def until(
    done: Callable[[], bool],
    deadline: float,
    what: str,
    stopped: Callable[[], bool],
    wake: threading.Event | None = None,
) -> None:
    """Poll ``done()`` until it is true or ``deadline`` passes; CANCELLED as soon as ``stopped()``.
    With ``wake`` (an event set when ``done()`` becomes true) the wait ends as soon as it is set, not
    up to a pause later, and looks at ``stopped()`` only every ``_LAST_POLL_S``: polling often
    instead cost a worker's waiting thread 5-10 ms of CPU per 42 receives on two busy cores."""
    pause = _FIRST_POLL_S if wake is None else _LAST_POLL_S
    while not done():
        if stopped():
            raise WeightwireError(
                Reason.CANCELLED,
                f"the update's call ended (cancelled, or past its deadline) during {what}; nothing was committed",
            )
        left = deadline - time.monotonic()
        if left <= 0:
            return
        if wake is not None:
            wake.wait(min(pause, left))
        else:
            time.sleep(min(pause, left))
        pause = min(pause * 2, _LAST_POLL_S)


def watch_receives(
    works: Sequence[Any],
    timeout_s: float,
    whats: Sequence[tuple[str, Mapping[str, str]]],
    stopped: Callable[[], bool] | None,
) -> None:
    """``wait`` for each of ``works`` (point-to-point receives); with ``stopped``, on a thread of
    their own, so that the caller stops waiting (CANCELLED) as soon as ``stopped()``. Only for receives into
    buffers of this update alone (the announcements): one given up on may still complete later,
    when its sender sends after all, and its bytes must land nowhere that counts. A receive into
    the model's kept tensors is never given up on this way."""
    if stopped is None:
        for work, (what, meta) in zip(works, whats, strict=True):
            wait(work, timeout_s, what, metadata=meta)
        return
    if not works:
        return
    finished = threading.Event()
    failed: list[WeightwireError] = []

    def run() -> None:
        try:
            for work, (what, meta) in zip(works, whats, strict=True):
                wait(work, timeout_s, what, metadata=meta)
        except WeightwireError as err:
            failed.append(without_frames(err))
        finally:
            finished.set()

    threading.Thread(target=run, name="ww-slices-watch", daemon=True).start()
    # The thread's own waits end at the timeout; this one a little later, so theirs is the error.
    until(finished.is_set, time.monotonic() + timeout_s + 1.0, whats[0][0], stopped, finished)
    if failed:
        raise failed[0]
    if not finished.is_set():
        raise WeightwireError(Reason.TRANSFER_FAILED, f"{whats[0][0]} did not end within {timeout_s:g} s")
