"""The requests of one PushWeights stream, read with a deadline for each.

``WorkerService.push`` reads a stream through a ``StreamReader``: a thread (one of the kept
``READERS``, one per open stream) takes the requests from gRPC's iterator (whose ``next`` cannot
time out) and hands them over one at a time, so the worker waits for each with a deadline. A
client that opens a stream, or sends a header, and then goes quiet gets a status with a reason when
the deadline passes, instead of holding the worker's one update (and a thread) for as long as its
connection lives. At most one request waits between the two threads, so gRPC's flow control still
holds a fast sender back. No gRPC in here.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator
from typing import cast

from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.kept_threads import KeptThreads
from weightwire.server.transports.read_ahead import END, Handoff
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["DEFAULT_IDLE_TIMEOUT_S", "ListedRequests", "StreamReader"]

# How long a stream may go without a message before the worker ends it. Generous: between two
# messages a trainer may stage a large bucket, wait for a slow worker's ack (it commits only after
# every worker acked) or gather over its own ranks.
DEFAULT_IDLE_TIMEOUT_S = 300.0
# One thread per open stream, never fewer (a read must not wait for another stream's to end); kept
# between streams because starting one is a hand-off on every update's path.
READERS = KeptThreads(None, "ww-push-reader", idle_exit_s=60.0)


class StreamReader:
    """Iterates ``requests`` with ``timeout_s`` for each next request (``WeightwireError``
    DEADLINE_EXCEEDED when it passes; ``waiting_for`` names what was awaited in its message).
    ``close`` lets the reading thread go; it also ends by itself with the stream."""

    def __init__(self, requests: Iterator[pb.PushWeightsRequest], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.waiting_for = "a message"
        self.hint = ""
        self._done = False
        self._handoff = Handoff(1)
        READERS.submit(lambda: self._handoff.feed(requests))

    def __iter__(self) -> StreamReader:
        return self

    def __next__(self) -> pb.PushWeightsRequest:
        if self._done:
            raise StopIteration
        try:
            item = self._handoff.get(timeout=self.timeout_s)
        except queue.Empty:
            raise WeightwireError(
                Reason.DEADLINE_EXCEEDED,
                f"the stream sent nothing for {self.timeout_s:g} s while this worker waited for {self.waiting_for}; "
                f"the update was not applied{self.hint}",
                idle_timeout_s=f"{self.timeout_s:g}",
            ) from None
        except BaseException:
            self._done = True
            raise
        if item is END:
            self._done = True
            raise StopIteration
        return cast(pb.PushWeightsRequest, item)

    def close(self) -> None:
        self._handoff.close()


class ListedRequests:
    """The requests of one PushUpdate call, all there already: iterated like a ``StreamReader``
    (the same attributes, which ``WorkerService.push`` sets), with nothing to wait for."""

    def __init__(self, requests: Iterable[pb.PushWeightsRequest]) -> None:
        self._requests = iter(requests)
        self.timeout_s = 0.0
        self.waiting_for = "a message"
        self.hint = ""

    def __iter__(self) -> ListedRequests:
        return self

    def __next__(self) -> pb.PushWeightsRequest:
        return next(self._requests)

    def close(self) -> None:
        pass
