"""The one exception type of weightwire and the table from error reason to gRPC status code.

Server and client code raise ``WeightwireError(Reason.X, message, **metadata)``; the servicer turns
it into a status with one ``google.rpc.ErrorInfo`` (domain ``weightwire``), and the client turns such
a status back into a ``WeightwireError`` (a status without an ErrorInfo gets the reason named after
its code, ``Reason.for_code``). Every error has a reason. Status codes are carried as their names
(``"FAILED_PRECONDITION"``) so this module does not import grpc.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

ERROR_DOMAIN = "weightwire"


class Reason(enum.Enum):
    """ErrorInfo reasons; the value is the gRPC status code name each maps to.

    The names equal the proto's ``ErrorReason`` values without the ``ERROR_REASON_`` prefix
    (a test checks the two lists agree).
    """

    MALFORMED_STREAM = "INVALID_ARGUMENT"
    SCOPE_UNSPECIFIED = "INVALID_ARGUMENT"
    INVALID_VERSION = "INVALID_ARGUMENT"
    DTYPE_UNSPECIFIED = "INVALID_ARGUMENT"
    DEVICE_KIND_UNSPECIFIED = "INVALID_ARGUMENT"
    INVALID_SHAPE = "INVALID_ARGUMENT"
    INVALID_OFFSET = "INVALID_ARGUMENT"
    INVALID_SIZE = "INVALID_ARGUMENT"
    TENSOR_OUT_OF_BOUNDS = "INVALID_ARGUMENT"
    PAYLOAD_COUNT_MISMATCH = "INVALID_ARGUMENT"
    PAYLOAD_LABEL_MISSING = "INVALID_ARGUMENT"
    DUPLICATE_PAYLOAD_LABEL = "INVALID_ARGUMENT"
    HANDLE_MISSING = "INVALID_ARGUMENT"
    INVALID_SHM_NAME = "INVALID_ARGUMENT"
    DUPLICATE_TENSOR = "INVALID_ARGUMENT"
    DUPLICATE_BUCKET = "INVALID_ARGUMENT"
    INVALID_CHECKSUM = "INVALID_ARGUMENT"
    INVALID_GROUP_SPEC = "INVALID_ARGUMENT"
    NO_PAYLOAD_FOR_DEVICE = "FAILED_PRECONDITION"
    PEER_DEVICE_UNAVAILABLE = "FAILED_PRECONDITION"
    SHAPE_MISMATCH = "FAILED_PRECONDITION"
    DTYPE_MISMATCH = "FAILED_PRECONDITION"
    STALE_VERSION = "FAILED_PRECONDITION"
    MANIFEST_CHANGED = "FAILED_PRECONDITION"
    INCOMPLETE_UPDATE = "FAILED_PRECONDITION"
    BUCKET_COUNT_MISMATCH = "FAILED_PRECONDITION"
    TRANSPORT_UNAVAILABLE = "FAILED_PRECONDITION"
    HANDLE_OPEN_FAILED = "FAILED_PRECONDITION"
    ENGINE_NOT_PAUSED = "FAILED_PRECONDITION"
    # The engine released its weights' memory (SGLang release_memory_occupation, vLLM sleep): a
    # write would fault or be lost; wake the weights first (the engine adapters refuse at begin).
    ENGINE_ASLEEP = "FAILED_PRECONDITION"
    # Bucket.layout_id names tensor specs this worker does not hold (a restart, an eviction, another
    # manifest) or payloads other than they were accepted with: send the bucket with its tensors.
    LAYOUT_UNKNOWN = "FAILED_PRECONDITION"
    # CudaIpcHandle.storage_set_id names a set of CUDA storages this worker does not keep (a restart,
    # a set dropped for newer ones): send the payload with its storages.
    STORAGE_SET_UNKNOWN = "FAILED_PRECONDITION"
    GROUP_UNKNOWN_MEMBER = "FAILED_PRECONDITION"
    GROUP_DUPLICATE_RANK = "FAILED_PRECONDITION"
    GROUP_WRONG_WORLD_SIZE = "FAILED_PRECONDITION"
    GROUP_PLAN_MISMATCH = "FAILED_PRECONDITION"
    GROUP_NOT_JOINED = "FAILED_PRECONDITION"
    UPDATE_IN_PROGRESS = "ABORTED"
    CHECKSUM_MISMATCH = "DATA_LOSS"
    MESSAGE_TRUNCATED = "DATA_LOSS"
    MESSAGE_TOO_LONG = "DATA_LOSS"
    LOAD_FAILED = "INTERNAL"
    MISSING_TOKEN = "UNAUTHENTICATED"
    INVALID_TOKEN = "UNAUTHENTICATED"
    GROUP_STORE_UNREACHABLE = "UNAVAILABLE"
    TRANSFER_FAILED = "UNAVAILABLE"
    GROUP_TIMEOUT = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"
    # What a client sees without a worker's ErrorInfo (CANCELLED also in a worker's last_error).
    UNKNOWN_TENSOR = "INVALID_ARGUMENT"
    BUFFER_NOT_CONTIGUOUS = "INVALID_ARGUMENT"
    SHARDED_BUFFER = "INVALID_ARGUMENT"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAVAILABLE = "UNAVAILABLE"
    RPC_FAILED = "UNKNOWN"
    # A multi-rank (FSDP2) push: the ranks' updates differ, another rank failed, a rank was lost.
    TRAINER_RANKS_DISAGREE = "FAILED_PRECONDITION"
    TRAINER_RANK_FAILED = "ABORTED"
    TRAINER_RANK_LOST = "UNAVAILABLE"
    # Delta updates: an encoding that does not fit, a base the worker does not hold, a result that
    # differs from the trainer's (weightwire.core.delta raises them).
    INVALID_DELTA = "INVALID_ARGUMENT"
    DELTA_BASE_MISMATCH = "FAILED_PRECONDITION"
    DELTA_RESULT_MISMATCH = "DATA_LOSS"

    # Several members share a value; keep them distinct members (Enum would alias them).
    def __new__(cls, code: str) -> Reason:
        obj = object.__new__(cls)
        obj._value_ = (len(cls.__members__), code)
        return obj

    @property
    def code(self) -> str:
        """gRPC status code name, e.g. ``"FAILED_PRECONDITION"``."""
        return self.value[1]

    @classmethod
    def for_code(cls, code: str) -> Reason:
        """The reason of a status that carried none (raised by gRPC itself, or an older worker's
        cancellation): the one named after its code, else ``RPC_FAILED``."""
        return _BY_CODE_NAME.get(code, Reason.RPC_FAILED)


def _restored(cls: type[BaseException], args: tuple[object, ...], state: dict[str, object]) -> BaseException:
    """An error of ``cls`` as ``__reduce__`` described it, without calling its ``__init__`` (whose
    signature differs between the error classes)."""
    err = cls.__new__(cls)
    BaseException.__init__(err, *args)
    err.__dict__.update(state)
    return err


class _Picklable:
    """Errors that survive pickling with every attribute (Ray, multiprocessing and
    concurrent.futures pickle what a worker raises; the default rebuilds from ``args`` alone,
    which these classes' constructors do not take)."""

    def __reduce__(self) -> tuple[object, ...]:
        assert isinstance(self, BaseException)
        return (_restored, (type(self), self.args, dict(self.__dict__)))


class WeightwireError(_Picklable, Exception):
    """An error with a reason, a message a person can act on, and machine-readable metadata.

    ``code`` is the gRPC status code name (the reason's own code unless given, as when a status
    is decoded). ``worker`` is set by the client when the error came from a named worker. A reason
    given by name is the ``Reason`` member of that name; a name this version does not know (a newer
    worker's) is kept as is with ``kind`` None; no name at all is the reason of ``code``.
    """

    def __init__(
        self,
        reason: Reason | str,
        message: str,
        *,
        code: str | None = None,
        worker: str | None = None,
        **metadata: str,
    ) -> None:
        if not isinstance(reason, Reason):
            reason = Reason.__members__.get(reason) or (
                Reason.for_code(code or "UNKNOWN") if not reason else reason
            )
        self.kind: Reason | None = reason if isinstance(reason, Reason) else None
        self.reason_name = reason.name if isinstance(reason, Reason) else reason
        self.code = code or (self.kind.code if self.kind is not None else "UNKNOWN")
        self.message = message
        self.worker = worker
        self.metadata = {k: str(v) for k, v in metadata.items()}
        super().__init__(self.__str__())

    @property
    def reason(self) -> str:
        return self.reason_name

    def __str__(self) -> str:
        where = f"{self.worker}: " if self.worker else ""
        return f"{where}{self.code}/{self.reason_name}: {self.message}"


def without_frames(err: WeightwireError) -> WeightwireError:
    """``err`` without its traceback and context, for an error kept or raised past the frames of
    a transfer: those frames hold the process group and its posted operations (an operation holds
    its group's connections), and a group still referenced is not destroyed when it is closed, so
    its sockets stay open and every peer waiting on this member waits out the group's timeout."""
    err.__traceback__ = None
    err.__context__ = None
    err.__cause__ = None
    return err


def raises_without_frames(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn``, whose ``WeightwireError`` leaves without its frames (``without_frames``)."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except WeightwireError as err:
            raise without_frames(err) from None

    return call


_BY_CODE_NAME = {
    r.name: r for r in (Reason.CANCELLED, Reason.DEADLINE_EXCEEDED, Reason.UNAVAILABLE, Reason.INTERNAL)
}

# The gRPC status code names (``google.rpc.Code``), spelled here so that this module imports no grpc.
GRPC_CODES = frozenset(
    "OK CANCELLED UNKNOWN INVALID_ARGUMENT DEADLINE_EXCEEDED NOT_FOUND ALREADY_EXISTS PERMISSION_DENIED "
    "RESOURCE_EXHAUSTED FAILED_PRECONDITION ABORTED OUT_OF_RANGE UNIMPLEMENTED INTERNAL UNAVAILABLE "
    "DATA_LOSS UNAUTHENTICATED".split()
)


def reason_label(reason: str) -> str:
    """``reason`` as a metric label: one of weightwire's reasons or a gRPC code name as it is (``""``
    too: no reason), anything else ``OTHER``. An engine adapter may raise with a reason of its own,
    or a newer worker send one this version does not know, and a label must take a bounded set of
    values (worker and trainer metrics)."""
    if not reason or reason in Reason.__members__ or reason in GRPC_CODES:
        return reason
    return "OTHER"


class PushError(_Picklable, Exception):
    """Raised by the client when an update failed on one or more workers.

    ``failures`` maps a worker's name (its address) to the error it reported; ``results`` holds
    the workers that did commit (their result objects), so a caller can see the whole picture.
    """

    def __init__(
        self, failures: Mapping[str, WeightwireError], results: Mapping[str, object] | None = None
    ) -> None:
        self.failures = dict(failures)
        self.results = dict(results or {})
        lines = [f"weight update failed on {len(failures)} worker(s):"]
        for worker, err in failures.items():
            lines.append(f"  - {worker}: {err.code}/{err.reason}: {err.message}")
        if self.results:
            lines.append(f"  ({len(self.results)} worker(s) committed: {', '.join(self.results)})")
        super().__init__("\n".join(lines))
