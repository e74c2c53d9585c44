"""Blame for a finished update: which workers committed, which failed and why, which were only
cancelled because of another, and which hung at the deadline.

A worker this client cancelled because another failed may have refused the update on its own
already; its stream then carries that refusal (``WorkerStream.settle``) and it is blamed for it,
not reported CANCELLED. A worker that was really cancelled is, with the state it says it was left in.

``collect_results`` reads the streams of one update (``weightwire.client.update.session``) once they have
all ended and returns one ``PushResult`` per worker, or raises one ``PushError`` naming each worker
that did not commit with its reason.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from weightwire.client.inputs.types import PushResult
from weightwire.client.rpc.stream import WorkerStream
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import PushError, Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports import table as transport_names
from weightwire.v1 import weight_transfer_pb2 as pb


def collect_results(
    streams: Mapping[str, WorkerStream],
    manifests: Mapping[str, ShardManifest],
    *,
    timeout_s: float,
    committed: bool,
    deadline_hit: bool,
    first_failure: str | None,
    cancelled_because: str | None = None,
) -> dict[str, PushResult]:
    """One result per worker when every worker committed; otherwise a ``PushError`` whose failures
    put the workers at fault first and the ones cancelled because of them after.
    ``cancelled_because`` says why the update was called off when no worker of this session failed
    (another trainer rank's update did, in a multi-rank push)."""
    results: dict[str, PushResult] = {}
    root: dict[str, WeightwireError] = {}
    cancelled: dict[str, WeightwireError] = {}

    ids = collections.Counter(manifests[a].worker_id for a in streams)

    def name(a: str) -> str:
        # Engines started apart (one per replica, one per machine) may give their workers the same
        # id; the address then tells the user which one.
        wid = manifests[a].worker_id
        if not wid:
            return a
        return f"{wid} at {a}" if ids[wid] > 1 else wid

    # Every stream of an update has the same deadline, so when one worker hangs, the healthy
    # ones (idle, waiting for the commit that waits for the hung one) expire at the same moment
    # and may be noticed first. Blame the workers that still owed acks, not the ones that waited.
    laggards = [a for a, s in streams.items() if s.result is None and len(s.acks) < len(s.sent_jobs)]
    deadline_hit = deadline_hit or any(
        s.error is not None and s.error.code == "DEADLINE_EXCEEDED" for s in streams.values()
    )
    blame_laggards = deadline_hit and not committed and bool(laggards)

    for a, s in streams.items():
        wid = manifests[a].worker_id
        err = s.error
        ours = err is not None and s.cancelled_by_us and err.code == "CANCELLED"
        if s.result is not None and err is None:
            results[a] = _result(a, wid, s)
        elif blame_laggards and a in laggards and (ours or err is None or err.code == "DEADLINE_EXCEEDED"):
            owed = len(s.sent_jobs) - len(s.acks)
            root[a] = WeightwireError(
                Reason.DEADLINE_EXCEEDED,
                f"worker {name(a)}: did not answer within the deadline ({timeout_s:g} s): "
                f"{owed} bucket(s) not acked (hung, stopped or overloaded); not committed",
                worker=a,
            )
        elif blame_laggards and (ours or err is None or err.code == "DEADLINE_EXCEEDED"):
            cancelled[a] = WeightwireError(
                Reason.CANCELLED,
                f"worker {name(a)}: update cancelled at the deadline while waiting for "
                f"{', '.join(name(w) for w in laggards)}; not committed here {_state_after(s)}",
                worker=a,
            )
        elif ours:
            culprit = first_failure
            if culprit:
                why = f"because {name(culprit)} failed"
            elif cancelled_because:
                why = f"because {cancelled_because}"
            else:
                why = f"at the {timeout_s:g} s deadline"
            cancelled[a] = WeightwireError(
                Reason.CANCELLED,
                f"worker {name(a)}: update cancelled {why}; not committed here {_state_after(s)}",
                worker=a,
            )
        elif err is not None:
            root[a] = _named(err, name(a) if wid else "")
        else:
            root[a] = WeightwireError(
                Reason.DEADLINE_EXCEEDED,
                f"worker {name(a)}: no result within {timeout_s:g} s (not committed)",
                worker=a,
            )
    if root or cancelled:
        raise PushError({**root, **cancelled}, results)
    return results


def _state_after(s: WorkerStream) -> str:
    """How a cancelled worker was left, when it said so after the update."""
    status = s.settled_status
    if status is None:
        return "(INCONSISTENT if it had loaded tensors)"
    return f"(its state: {pb.WorkerState.Name(status.state).removeprefix('WORKER_STATE_')})"


def _named(err: WeightwireError, worker_id: str) -> WeightwireError:
    """The same error with the worker's readable id in front of its message."""
    if not worker_id:
        return err
    return WeightwireError(
        err.reason, f"worker {worker_id}: {err.message}", code=err.code, worker=err.worker, **err.metadata
    )


def _result(address: str, worker_id: str, s: WorkerStream) -> PushResult:
    r = s.result
    if r is None:
        raise RuntimeError(f"no UpdateResult from {address}")
    transports = [a.transport for a in s.acks if a.handle_opened or a.HasField("source_device")]
    transport = transport_names.kind_name(transports[-1]) if transports else "none"
    return PushResult(
        worker=address,
        worker_id=worker_id,
        version=r.version,
        previous_version=r.previous_version,
        tensors_loaded=r.tensors_loaded,
        bytes_loaded=r.bytes_loaded,
        buckets=len(s.sent_jobs),
        handles_opened=r.handles_opened,
        duration_s=max(s.finished - s.started, 1e-9),
        server_duration_s=r.duration_ns / 1e9,
        transport=transport,
        state=pb.WorkerState.Name(r.state).removeprefix("WORKER_STATE_"),
        peer_device_imports=sum(1 for a in s.acks if a.peer_device_import),
        source_devices=tuple(
            sorted(
                {
                    str(DeviceRef(a.source_device.kind, a.source_device.uuid))
                    for a in s.acks
                    if a.HasField("source_device")
                }
            )
        ),
        bytes_received=r.bytes_received,
    )
