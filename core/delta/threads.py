"""How many threads the host side of a delta runs: the trainer's passes over its tensors
(``BaseKeeper.update_all``) and a worker's verification of a batch's result checksums.

Their inner steps (cast, compare, gather, CRC) release the GIL, yet more than two threads did not
pay on the hosts measured. The default is the cores this process may run on (its affinity, which a
job scheduler or ``taskset`` sets, not the host's count), at most ``MAX_DELTA_THREADS``;
``WEIGHTWIRE_DELTA_THREADS`` sets the count instead (1 keeps a delta to the calling thread, for a
trainer whose other threads must keep the other cores). A value that is not a whole number of 1 or
more is logged once and the default used, so that it never fails an update half-way on a worker."""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger(__name__)
DELTA_THREADS_ENV = "WEIGHTWIRE_DELTA_THREADS"
# Two were faster than one on a 2-core host; eight were slower than two on a 16-core one
# (BENCHMARKS.md, "Deltas on a 16-core host").
MAX_DELTA_THREADS = 2
# What the environment may ask for at most.
_MAX_ASKED_THREADS = 64


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def delta_threads() -> int:
    """Threads for a delta's host work: ``WEIGHTWIRE_DELTA_THREADS`` when set, else the usable cores
    up to ``MAX_DELTA_THREADS``."""
    raw = os.environ.get(DELTA_THREADS_ENV, "").strip()
    if raw:
        threads = int(raw) if raw.isdigit() else 0
        if threads >= 1:
            return min(threads, _MAX_ASKED_THREADS)
        _ignored(raw)
    return max(1, min(MAX_DELTA_THREADS, usable_cores()))


@functools.cache
def _ignored(raw: str) -> None:
    log.warning("%s=%r is not a whole number of 1 or more; using the default", DELTA_THREADS_ENV, raw[:40])
