"""What a worker tells its observers about each update: it began, a bucket was acked, it ended.

``WorkerService`` owns one ``UpdateEvents`` and calls it at those three points; observers are added
with ``WorkerService.add_observer``. Two ship with weightwire: ``weightwire.server.observe.metrics.WorkerMetrics``
(Prometheus) and ``weightwire.server.observe.update_log.UpdateLog`` (one structured log line per update, on
by default). An observer that raises is logged and skipped: observing never fails an update.

Observers run on the thread that handles the update, before the trainer gets the bucket's ack or
the update's result, so what a trainer has been told is already counted; they must be quick (no
I/O beyond a log line).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Literal, Protocol

from weightwire.core.errors import WeightwireError
from weightwire.core.text import clip
from weightwire.v1 import weight_transfer_pb2 as pb

log = logging.getLogger(__name__)

Outcome = Literal["committed", "refused", "failed", "cancelled"]
OUTCOMES: tuple[Outcome, ...] = ("committed", "refused", "failed", "cancelled")

# Values that come from the trainer are cut to these lengths before anyone stores or prints them.
MAX_UPDATE_ID_CHARS = 64
MAX_MESSAGE_CHARS = 300


@dataclasses.dataclass(frozen=True)
class UpdateOutcome:
    """How one update ended on one worker.

    ``outcome``: ``committed``; ``refused`` (failed before anything was loaded: version and state
    unchanged); ``failed`` (failed after tensors were loaded: the worker is INCONSISTENT);
    ``cancelled`` (the trainer went away, or the worker shut down).
    """

    worker_id: str
    version: int  # the version the update carried (0: the stream had no header)
    outcome: Outcome
    reason: str  # the ErrorInfo reason, else the status code (CANCELLED, INTERNAL); "" when committed
    code: str  # the gRPC status code name; "OK" when committed
    scope: str  # "full", "partial" or "unspecified"
    update_id: str  # as the trainer sent it, cut to MAX_UPDATE_ID_CHARS
    duration_s: float | None  # None: refused at its header, before the update began
    buckets: int
    tensors_loaded: int
    bytes_loaded: int
    handles_opened: int
    weights_version: int  # after the update
    state: str  # after the update: CONSISTENT or INCONSISTENT
    message: str  # the error message cut to MAX_MESSAGE_CHARS; "" when committed


class UpdateObserver(Protocol):
    """Something that watches a worker's updates (metrics, logs)."""

    def update_started(self, version: int) -> None: ...

    def bucket_acked(self, ack: pb.BucketAck) -> None: ...

    def update_finished(self, outcome: UpdateOutcome) -> None: ...


def scope_name(scope: int) -> str:
    if scope == pb.UPDATE_SCOPE_FULL:
        return "full"
    if scope == pb.UPDATE_SCOPE_PARTIAL:
        return "partial"
    return "unspecified"


def state_name(state: int) -> str:
    try:
        return pb.WorkerState.Name(state).removeprefix("WORKER_STATE_")  # type: ignore[arg-type]
    except ValueError:
        return "UNSPECIFIED"


@dataclasses.dataclass
class UpdateTally:
    """What one update loaded so far, bucket by bucket: kept by the update itself (its result and
    its commit check read it) and handed to the observers when it fails."""

    buckets: int = 0
    tensors_loaded: int = 0
    bytes_loaded: int = 0
    bytes_received: int = 0
    handles_opened: int = 0

    def add(self, ack: pb.BucketAck) -> None:
        self.buckets += 1
        self.tensors_loaded += ack.tensors_loaded
        self.bytes_loaded += ack.bytes_loaded
        self.bytes_received += ack.bytes_received
        self.handles_opened += int(ack.handle_opened)


class UpdateEvents:
    """The observers of one worker, called in the order they were added."""

    def __init__(self) -> None:
        self._observers: tuple[UpdateObserver, ...] = ()
        self._lock = threading.Lock()
        self._started_ns = 0

    def add(self, observer: UpdateObserver) -> None:
        with self._lock:
            self._observers = (*self._observers, observer)

    def remove(self, observer: UpdateObserver) -> None:
        with self._lock:
            self._observers = tuple(o for o in self._observers if o is not observer)

    # --- what the service reports ------------------------------------------------------------------

    def started(self, version: int) -> None:
        """An update's header was accepted."""
        self._started_ns = time.perf_counter_ns()
        self._each("update_started", version)

    def bucket_acked(self, ack: pb.BucketAck) -> None:
        """A bucket was loaded (or skipped) and its ack is about to go out."""
        self._each("bucket_acked", ack)

    def committed(self, worker_id: str, result: pb.UpdateResult, *, weights_version: int) -> None:
        """An update committed; ``result`` is the ``UpdateResult`` the trainer gets."""
        self._each(
            "update_finished",
            UpdateOutcome(
                worker_id=worker_id,
                version=result.version,
                outcome="committed",
                reason="",
                code="OK",
                scope=scope_name(result.scope),
                update_id=clip(result.update_id, MAX_UPDATE_ID_CHARS),
                duration_s=result.duration_ns / 1e9,
                buckets=result.bucket_count,
                tensors_loaded=result.tensors_loaded,
                bytes_loaded=result.bytes_loaded,
                handles_opened=result.handles_opened,
                weights_version=weights_version,
                state=state_name(result.state),
                message="",
            ),
        )

    def failed(
        self,
        worker_id: str,
        header: pb.UpdateHeader | None,
        err: WeightwireError,
        *,
        tally: UpdateTally | None,
        prior_state: int,
        new_state: int,
        weights_version: int,
    ) -> None:
        """An update failed: refused at its header (``tally`` None; ``header`` None when the stream had
        none) or after it began (then the update's ``tally`` of its acked buckets goes into the outcome)."""
        began = tally is not None
        # Loaded: an acked bucket carried tensors, or the failure made a consistent worker INCONSISTENT
        # (a bucket that failed while loading).
        loaded = tally is not None and (
            tally.tensors_loaded > 0 or (new_state == pb.WORKER_STATE_INCONSISTENT != prior_state)
        )
        if err.code == "CANCELLED":
            outcome: Outcome = "cancelled"
        else:
            outcome = "failed" if loaded else "refused"
        self._each(
            "update_finished",
            UpdateOutcome(
                worker_id=worker_id,
                version=header.version if header is not None else 0,
                outcome=outcome,
                reason=err.reason or err.code,
                code=err.code,
                scope=scope_name(header.scope) if header is not None else "unspecified",
                update_id=clip(header.update_id, MAX_UPDATE_ID_CHARS) if header is not None else "",
                duration_s=(time.perf_counter_ns() - self._started_ns) / 1e9 if began else None,
                buckets=tally.buckets if tally is not None else 0,
                tensors_loaded=tally.tensors_loaded if tally is not None else 0,
                bytes_loaded=tally.bytes_loaded if tally is not None else 0,
                handles_opened=tally.handles_opened if tally is not None else 0,
                weights_version=weights_version,
                state=state_name(new_state),
                message=clip(err.message, MAX_MESSAGE_CHARS),
            ),
        )

    def _each(self, method: str, arg: object) -> None:
        for observer in self._observers:
            try:
                getattr(observer, method)(arg)
            except Exception:
                log.exception("update observer %r failed in %s", observer, method)
