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
from collections.abc import Iterator, Mapping
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


__all__ = ["MAX_AHEAD", "ReadsAhead", "read_ahead"]

MAX_AHEAD = 4
_END = object()


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
        yield from _Pump(requests, importers).run(req)
        return


class _Pump:
    """The thread that reads the rest of one stream ahead of its caller."""

    def __init__(self, requests: Iterator[pb.PushWeightsRequest], importers: Mapping[str, Any]) -> None:
        self._requests = requests
        self._importers = importers
        self._waiting: queue.Queue[object] = queue.Queue(MAX_AHEAD)
        self._stop = threading.Event()

    def _put(self, item: object) -> bool:
        # Never block for good: the caller may have stopped reading (the update ended).
        while not self._stop.is_set():
            try:
                self._waiting.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _pump(self) -> None:
        try:
            for later in self._requests:
                if later.WhichOneof("message") == "bucket":
                    _announce(later.bucket, self._importers)
                if not self._put(later):
                    return
            self._put(_END)
        except BaseException as e:  # the stream broke (client gone): the caller sees it in order
            self._put(e)

    def run(self, first: pb.PushWeightsRequest) -> Iterator[pb.PushWeightsRequest]:
        threading.Thread(target=self._pump, name="ww-read-ahead", daemon=True).start()
        try:
            yield first
            while True:
                item = self._waiting.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item  # type: ignore[misc]
        finally:
            self._stop.set()
