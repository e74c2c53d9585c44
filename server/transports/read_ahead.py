"""Reading an update stream one message ahead, for transports that can start a bucket's transfer
before the worker is ready to load it.

``WorkerService.push`` iterates ``read_ahead(requests, importers)`` instead of ``requests``. Nothing
changes until a bucket arrives whose payload's importer ``ReadsAhead`` (transfer groups,
``weightwire.server.transports.transfer_group``): from then on a thread reads the following messages as they come
and hands each such payload to ``ahead`` at once, so the receive of bucket k+1 runs while bucket k
loads. The messages still reach the caller one at a time, in order, with every rule applied to
them there; at most ``MAX_AHEAD`` wait in between (the trainer's own pipeline sends fewer).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, cast, runtime_checkable

from weightwire.core.capabilities import has_capability
from weightwire.v1 import weight_transfer_pb2 as pb


@runtime_checkable
class ReadsAhead(Protocol):
    """An importer that can start receiving a bucket's bytes as soon as the bucket is read, before
    the worker loads the one before it."""

    def ahead(self, payload: pb.Payload) -> None:
        """Start the transfer of ``payload``'s bytes; its import later finds them under way."""
        ...


__all__ = ["END", "MAX_AHEAD", "Handoff", "ReadsAhead", "read_ahead"]

MAX_AHEAD = 4
# What ``Handoff.get`` returns once the iterator it was fed is exhausted.
END = object()
_PUT_POLL_S = 0.2


class Handoff:
    """One iterator's items handed from a thread that reads it (``feed``) to one that uses them
    (``get``), in order, at most ``size`` waiting in between; the iterator's end (``END``) and an
    exception it raised (the stream broke: the client went away) arrive in order too. Used here and
    by ``weightwire.server.worker.streams.StreamReader``."""

    def __init__(self, size: int) -> None:
        self._waiting: queue.Queue[object] = queue.Queue(size)
        self.closed = threading.Event()

    def _put(self, item: object) -> bool:
        # Never block for good: the user may have stopped taking (the update ended): ``close``.
        while not self.closed.is_set():
            try:
                self._waiting.put(item, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def feed(self, items: Iterator[Any], each: Callable[[Any], None] | None = None) -> None:
        """Read ``items`` to their end (or until ``close``), calling ``each`` on every one first."""
        try:
            for item in items:
                if each is not None:
                    each(item)
                if not self._put(item):
                    return
            self._put(END)
        except BaseException as e:  # raised in order, where the user takes it
            self._put(e)

    def get(self, timeout: float | None = None) -> object:
        """The next item, or ``END``; raises what the iterator raised, or ``queue.Empty`` once
        ``timeout`` passed."""
        item = self._waiting.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.closed.set()


def _announce(bucket: pb.Bucket, importers: Mapping[str, Any]) -> bool:
    """Hand the bucket's first payload that an importer can receive ahead to it; True if any."""
    for payload in bucket.payloads:
        importer = importers.get(payload.WhichOneof("handle") or "")
        if has_capability(importer, ReadsAhead):
            cast(ReadsAhead, importer).ahead(payload)
            return True
    return False


def _wants_ahead(req: pb.PushWeightsRequest, importers: Mapping[str, Any]) -> bool:
    return req.WhichOneof("message") == "bucket" and any(
        has_capability(importers.get(p.WhichOneof("handle") or ""), ReadsAhead) for p in req.bucket.payloads
    )


def read_ahead(
    requests: Iterator[pb.PushWeightsRequest], importers: Mapping[str, Any]
) -> Iterator[pb.PushWeightsRequest]:
    """``requests``, read one thread ahead once a bucket needs it (see the module docstring)."""
    for req in requests:
        if not _wants_ahead(req, importers):
            yield req
            continue
        # From here on, read on a thread. This bucket is announced first, here, so that the
        # transport sees every bucket in stream order; the caller then opens it right away.
        _announce(req.bucket, importers)
        yield from _ahead(req, requests, importers)
        return


def _ahead(
    first: pb.PushWeightsRequest, requests: Iterator[pb.PushWeightsRequest], importers: Mapping[str, Any]
) -> Iterator[pb.PushWeightsRequest]:
    """``first``, then the rest of ``requests`` as a thread reads them, each bucket announced."""

    def announce(later: pb.PushWeightsRequest) -> None:
        if later.WhichOneof("message") == "bucket":
            _announce(later.bucket, importers)

    handoff = Handoff(MAX_AHEAD)
    threading.Thread(
        target=handoff.feed, args=(requests, announce), name="ww-read-ahead", daemon=True
    ).start()
    try:
        yield first
        while (item := handoff.get()) is not END:
            yield cast(pb.PushWeightsRequest, item)
    finally:
        handoff.close()
