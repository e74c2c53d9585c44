"""What a transfer group's bucket sends: its segments (runs of a packed buffer, or tensors sent
straight from where they live) and the thread that waits for posted sends and reports the first
failure. Used by ``GroupLink`` (``transfer_group_link``).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from weightwire.client.inputs.plan import TensorSpec
from weightwire.core.errors import WeightwireError
from weightwire.core.transports.transfer_group import TransferGroup
from weightwire.core.transports.whole_messages import announce, last_byte

log = logging.getLogger(__name__)


class Sends:
    """Waits, on one thread and in order, for each bucket's posted sends; a bucket whose sends all
    completed has left this process, so its buffer may be reused (``on_done``) before the workers
    acked it. A failure is reported to ``on_failure`` (the bucket's buffer then stays with the
    session, which discards it when the update fails)."""

    def __init__(self, on_failure: Callable[[WeightwireError], None]) -> None:
        self._queue: queue.SimpleQueue[tuple[TransferGroup, list[Any], str, Callable[[], None]] | None] = (
            queue.SimpleQueue()
        )
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name="ww-group-sends", daemon=True)
        self._thread.start()

    def add(self, group: TransferGroup, works: list[Any], what: str, on_done: Callable[[], None]) -> None:
        self._queue.put((group, works, what, on_done))

    def stop(self, wait_s: float) -> None:
        """End the thread and wait for it: a thread that still drops a torch.distributed Work while
        the interpreter exits aborts the process (the Work's destructor releases the GIL)."""
        self._queue.put(None)
        self._thread.join(wait_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._wait(*item)
            del item  # no Work outlives its wait here (see ``stop``)

    def _wait(self, group: TransferGroup, works: list[Any], what: str, on_done: Callable[[], None]) -> None:
        if group.closed:
            return
        try:
            for work in works:
                group.wait(work, what)
        except WeightwireError as err:
            self._on_failure(err)
            return
        on_done()


# A tensor at least this large is sent straight from its own memory; smaller adjacent ones are
# packed into one message (a message costs more than copying a few hundred KiB).
DIRECT_MIN_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class Segment:
    """One message of a bucket: bytes [offset, offset + size) of the layout, the tensors they hold,
    and where the sender reads them (exactly ``size`` bytes)."""

    offset: int
    size: int
    names: tuple[str, ...]
    source: torch.Tensor


def announce_segments(segments: Sequence[Segment]) -> torch.Tensor:
    """The announcement of ``segments``' messages, sent before them."""
    return announce([(g.size, last_byte(g.source)) for g in segments], segments[0].source.device)


def packed_segments(specs: Sequence[TensorSpec], data: torch.Tensor, base: int) -> list[Segment]:
    """Messages over a packed bucket: runs of exactly adjacent tensors (gaps are never sent)."""
    out: list[Segment] = []
    for spec in sorted((s for s in specs if s.nbytes > 0), key=lambda s: s.offset_bytes):
        offset = base + spec.offset_bytes
        last = out[-1] if out else None
        if last is not None and last.offset + last.size == offset:
            size = last.size + spec.nbytes
            out[-1] = Segment(
                last.offset, size, (*last.names, spec.name), data[last.offset : last.offset + size]
            )
        else:
            out.append(Segment(offset, spec.nbytes, (spec.name,), data[offset : offset + spec.nbytes]))
    return out


def direct_segments(specs: Sequence[TensorSpec], flats: Sequence[torch.Tensor]) -> list[Segment]:
    """Messages straight from the tensors: each large one alone, runs of exactly adjacent small ones
    copied into one small buffer (a few per bucket; freed when their send completes)."""
    order = sorted((i for i, s in enumerate(specs) if s.nbytes > 0), key=lambda i: specs[i].offset_bytes)
    out: list[Segment] = []
    run: list[int] = []

    def close_run() -> None:
        if not run:
            return
        first, last = specs[run[0]], specs[run[-1]]
        start, end = first.offset_bytes, last.offset_bytes + last.nbytes
        buf = torch.empty(end - start, dtype=torch.uint8, device=flats[run[0]].device)
        for i in run:
            buf[specs[i].offset_bytes - start : specs[i].offset_bytes - start + specs[i].nbytes].copy_(
                flats[i]
            )
        out.append(Segment(start, end - start, tuple(specs[i].name for i in run), buf))
        run.clear()

    for i in order:
        spec = specs[i]
        if spec.nbytes >= DIRECT_MIN_BYTES:
            close_run()
            out.append(Segment(spec.offset_bytes, spec.nbytes, (spec.name,), flats[i]))
            continue
        if run and specs[run[-1]].offset_bytes + specs[run[-1]].nbytes != spec.offset_bytes:
            close_run()
        run.append(i)
    close_run()
    return out
