"""The worker service core: identity, weights version and state, status, and the update stream.

``WorkerService`` is what an engine worker runs; the gRPC servicer (``weightwire.server.rpc.servicer``)
only converts messages and maps ``WeightwireError`` to a status. The service accepts one update at a
time (``begin_update``, the header's rules in ``accepted.check_header``) and runs its stream
(``push``); the bucket rules, in the order they apply, live in ``weightwire.server.worker.update.Update``;
payload choice in ``selection.select_own_payload``; spec checks in ``validation``; layouts in
``layout``; handle import in ``transports``. No gRPC in here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import cast

import torch
from weightwire.core.capabilities import has_capability
from weightwire.core.delta import VERIFIED_ALGORITHMS
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.core.text import MAX_MESSAGE_BYTES, clip_utf8
from weightwire.core.transports.transfer_group_plan import MemberIdentity
from weightwire.server.observe.update_events import UpdateEvents, UpdateObserver
from weightwire.server.observe.update_log import UpdateLog
from weightwire.server.rules.layout import LayoutCache
from weightwire.server.transports.importer import JoinsGroups, PayloadImporter, make_importers
from weightwire.server.transports.read_ahead import read_ahead
from weightwire.server.transports.transfer_group_membership import GroupMembership
from weightwire.server.worker.accepted import check_header
from weightwire.server.worker.adapter import AppliesDeltas, EngineAdapter, KeepsTensors
from weightwire.server.worker.streams import DEFAULT_IDLE_TIMEOUT_S, ListedRequests, StreamReader
from weightwire.server.worker.update import Update, UpdateContext, cancelled_error, now_timestamp
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["CommitHook", "Update", "WorkerService"]

log = logging.getLogger(__name__)

CommitHook = Callable[[pb.UpdateResult], None]
# How long a new update waits for one whose client cancelled it to end (its engine call returns).
ABANDONED_WAIT_S = 30.0
# How long a join or leave waits for an update that has ended (its outcome recorded, so the status
# no longer says UPDATING) to let go of the worker (its mappings, its observers) before refusing.
ENDING_WAIT_S = 5.0
# How long after the commit the stream may take to end (the client closes its side right after it).
END_AFTER_COMMIT_S = 30.0


class WorkerService:
    """One engine worker: its adapter, its identity, its weights version and state."""

    def __init__(
        self,
        adapter: EngineAdapter,
        *,
        own_device: DeviceRef,
        host_device: DeviceRef | None = None,
        target_device: torch.device | None = None,
        importers: dict[str, PayloadImporter] | None = None,
        on_commit: CommitHook | None = None,
        is_local_cuda: Callable[[DeviceRef], bool] | None = None,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        self.adapter = adapter
        # A stream that sends nothing for this long ends with DEADLINE_EXCEEDED (streams.StreamReader).
        self.idle_timeout_s = idle_timeout_s
        self.own_device = own_device
        self.host_device = host_device if host_device is not None else DeviceRef.host()
        self.target_device = (
            target_device
            if target_device is not None
            else torch.device("cuda" if own_device.is_cuda else "cpu")
        )
        self.importers = importers if importers is not None else make_importers()
        # This worker's transfer-group membership (joins, leaves, status), owned here; the importer
        # that receives through it (``JoinsGroups``) brings it. None when no importer does.
        self.transfer_group: GroupMembership | None = next(
            (
                cast(JoinsGroups, imp).membership
                for imp in self.importers.values()
                if has_capability(imp, JoinsGroups)
            ),
            None,
        )
        self.on_commit = on_commit
        self._manifest: ShardManifest = adapter.manifest()
        self.layouts = LayoutCache()
        self._update_context = UpdateContext(
            adapter=adapter,
            manifest=self._manifest,
            own_device=own_device,
            host_device=self.host_device,
            target_device=self.target_device,
            importers=self.importers,
            is_local_cuda=is_local_cuda,
            layouts=self.layouts,
        )
        self._mu = threading.Lock()
        # Notified when the active update is let go (a new header may be waiting for that).
        self._released = threading.Condition(self._mu)
        self._version = 0
        self._state: pb.WorkerState = pb.WORKER_STATE_CONSISTENT
        self._active: Update | None = None
        self._last_result: pb.UpdateResult | None = None
        self._last_error: pb.ErrorDetail | None = None
        self._succeeded = 0
        self._failed = 0
        self._listeners: list[Callable[[bool], None]] = []
        self._told_serving: bool | None = None
        # Metrics and the structured log line per update (weightwire.server.observe.update_events).
        self._events = UpdateEvents()
        self._events.add(UpdateLog())

    # --- identity and status -------------------------------------------------------------------

    @property
    def manifest(self) -> ShardManifest:
        return self._manifest

    @property
    def weights_version(self) -> int:
        return self._version

    @property
    def state(self) -> pb.WorkerState:
        return self._state

    @property
    def serving(self) -> bool:
        """False while the model mixes versions (INCONSISTENT): health says NOT_SERVING."""
        return self._state != pb.WORKER_STATE_INCONSISTENT

    def add_state_listener(self, listener: Callable[[bool], None]) -> None:
        """``listener(serving)`` is called now and whenever ``serving`` changes (the health service uses it)."""
        self._listeners.append(listener)
        listener(self.serving)

    def add_observer(self, observer: UpdateObserver) -> None:
        """Tell ``observer`` about every update from now on (e.g. ``weightwire.server.observe.metrics.WorkerMetrics``)."""
        self._events.add(observer)

    def _notify(self) -> None:
        # Only a change is news (UPDATING and back serve as before); every update passes here twice.
        serving = self.serving
        if serving == self._told_serving:
            return
        self._told_serving = serving
        for listener in self._listeners:
            listener(serving)

    def open_mappings(self) -> int:
        active = self._active
        held = sum(imp.held_mappings() for imp in self.importers.values())
        return held + (active.open_mapping_count() if active is not None else 0)

    def get_manifest(self) -> pb.GetManifestResponse:
        manifest = self._manifest.to_proto()
        # How this worker imports is its importers' business, not the engine adapter's.
        keeps_tensors = has_capability(self.adapter, KeepsTensors)
        for importer in self.importers.values():
            importer.announce(manifest, keeps_tensors=keeps_tensors)
        if has_capability(self.adapter, AppliesDeltas):
            manifest.delta_checksum_algorithms[:] = VERIFIED_ALGORITHMS
        return pb.GetManifestResponse(manifest=manifest)

    def get_status(self) -> pb.GetStatusResponse:
        with self._mu:
            resp = pb.GetStatusResponse(
                weights_version=self._version,
                state=self._state,
                device=self._manifest.device.to_proto(),
                rank=self._manifest.rank.to_proto(),
                manifest_fingerprint=self._manifest.fingerprint,
                worker_id=self._manifest.worker_id,
                updates_succeeded=self._succeeded,
                updates_failed=self._failed,
                instance_id=self._manifest.instance_id,
            )
            if self._last_result is not None:
                resp.last_result.CopyFrom(self._last_result)
            if self._last_error is not None:
                resp.last_error.CopyFrom(self._last_error)
        resp.open_mappings = self.open_mappings()
        group = self.transfer_group
        if group is not None:
            resp.transfer_group.CopyFrom(group.status())
        return resp

    # --- transfer groups (weightwire.server.transports.transfer_group) ---------------------------------------

    def _group_or_refuse(self) -> GroupMembership:
        group = self.transfer_group
        if group is None:
            raise WeightwireError(Reason.TRANSPORT_UNAVAILABLE, "this worker has no transfer-group importer")
        with self._mu:
            deadline = time.monotonic() + ENDING_WAIT_S
            while self._active is not None and self._active.finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._released.wait(left)  # woken by _release
            if self._active is not None:
                raise WeightwireError(
                    Reason.UPDATE_IN_PROGRESS,
                    f"an update (version {self._active.version}) is running on this worker; join or leave after it ended",
                    active_version=str(self._active.version),
                )
        return group

    def join_transfer_group(self, request: pb.JoinTransferGroupRequest) -> pb.JoinTransferGroupResponse:
        """Form the group of ``request.spec`` as this worker (its manifest's identity); blocks until
        every member has joined and checked it, or raises with the reason."""
        return self._group_or_refuse().join(
            request.spec, MemberIdentity.of_worker(self._manifest), self.target_device
        )

    def leave_transfer_group(self, request: pb.LeaveTransferGroupRequest) -> pb.LeaveTransferGroupResponse:
        return pb.LeaveTransferGroupResponse(left=self._group_or_refuse().leave(request.group_id))

    def close(self) -> None:
        """Release every mapping (worker shutdown). An update still running is failed first."""
        active = self._active
        if active is not None:
            active.fail(WeightwireError(Reason.CANCELLED, "the worker is shutting down"))
        for imp in self.importers.values():
            imp.release()
        group = self.transfer_group
        if group is not None:
            # Its process groups are destroyed on a thread; let that finish before the process exits.
            group.shutdown()

    # --- updates -------------------------------------------------------------------------------

    def _record_failure(self, err: WeightwireError, version: int) -> None:
        # Bounded: the message may quote what a client sent (names, labels), and every later
        # GetStatus carries it.
        message = clip_utf8(err.message, MAX_MESSAGE_BYTES)
        detail = pb.ErrorDetail(
            code=err.code, reason=err.reason, message=message, time=now_timestamp(), version=version
        )
        self._last_error = detail
        self._failed += 1

    def begin_update(self, header: pb.UpdateHeader, *, rpc_ended: threading.Event | None = None) -> Update:
        """Accept a header (or raise): one update at a time, version newer, manifest unchanged.

        An update whose client has already gone (its stream cancelled or past its deadline) but
        that is still ending (the engine has not returned from a load yet) is waited for, up to
        ``ABANDONED_WAIT_S`` or until this stream ends (``rpc_ended``): a trainer that retries after
        a failed push is not refused because of its own previous update.
        """
        refused: WeightwireError | None = None
        with self._mu:
            self._wait_for_abandoned(header.version, rpc_ended)
            try:
                if self._active is not None:
                    active = self._active
                    raise WeightwireError(
                        Reason.UPDATE_IN_PROGRESS,
                        f"another update (version {active.version}) is running on this worker; retry after it finished"
                        if not active.abandoned
                        else f"the previous update (version {active.version}) was cancelled by its client but has not "
                        f"ended after {ABANDONED_WAIT_S:g} s (the engine is still in a load); retry when it has",
                        active_version=str(active.version),
                    )
                if rpc_ended is not None and rpc_ended.is_set():
                    # It waited for an abandoned update and its own call ended meanwhile.
                    raise cancelled_error()
                check_header(
                    header,
                    weights_version=self._version,
                    fingerprint=self._manifest.fingerprint,
                    consistent=self._state == pb.WORKER_STATE_CONSISTENT,
                    applies_deltas=has_capability(self.adapter, AppliesDeltas),
                )
            except WeightwireError as err:
                self._record_failure(err, header.version)
                refused = err
            else:
                update = Update(
                    self._update_context,
                    self,
                    header,
                    prior_state=self._state,
                    previous_version=self._version,
                    rpc_ended=rpc_ended,
                )
                self._active = update
                self._state = pb.WORKER_STATE_UPDATING
        if refused is not None:
            # Observers run outside the lock (one may ask for the status).
            self._tell_refused(header, refused)
            raise refused
        self._events.started(header.version)
        self._notify()
        try:
            self.adapter.begin_update(header.version)
        except Exception as e:
            # An adapter's own WeightwireError already names its reason (e.g. ENGINE_NOT_PAUSED).
            refused = (
                e
                if isinstance(e, WeightwireError)
                else WeightwireError(
                    Reason.LOAD_FAILED, f"the engine refused to begin update {header.version}: {e!r}"
                )
            )
            update.fail(refused)
            raise refused from e
        update.begun = True
        return update

    def _tell_refused(self, header: pb.UpdateHeader | None, err: WeightwireError) -> None:
        """Tell the observers of an update refused before it began (nothing changed)."""
        self._events.failed(
            self._manifest.worker_id,
            header,
            err,
            tally=None,
            prior_state=self._state,
            new_state=self._state,
            weights_version=self._version,
        )

    def _wait_for_abandoned(self, version: int, rpc_ended: threading.Event | None) -> None:
        """With ``_mu`` held: wait while the active update is one whose client is gone."""
        active = self._active
        if active is None or not active.abandoned:
            return
        log.info("update %d waits for update %d, cancelled by its client, to end", version, active.version)
        deadline = time.monotonic() + ABANDONED_WAIT_S
        while self._active is not None and self._active.abandoned:
            left = deadline - time.monotonic()
            if left <= 0 or (rpc_ended is not None and rpc_ended.is_set()):
                return
            # Woken by _release; polled as well, so that this stream's own end is noticed.
            self._released.wait(min(left, 0.05))

    # UpdateOwner: the two ways an update ends, each reported once by the update itself.

    def update_committed(self, update: Update, result: pb.UpdateResult) -> None:
        with self._mu:
            self._state = result.state
            self._version = result.version
            self._last_result = result
            self._succeeded += 1
        self._notify()
        self._events.committed(self._manifest.worker_id, result, weights_version=result.version)
        try:
            if self.on_commit is not None:
                # Still the active update: no other push can change the model while this runs.
                self.on_commit(result)
        except Exception:
            log.exception("on_commit hook failed after update %d", update.version)
        finally:
            self._release(update)

    def update_failed(self, update: Update, err: WeightwireError, new_state: pb.WorkerState) -> None:
        with self._mu:
            self._state = new_state
            self._record_failure(err, update.version)
        # Mappings cached for reuse (CUDA IPC) pin the sender's memory. After a failed or cancelled
        # update the sender may be gone for good, so let them go; a live trainer's next update
        # simply reopens its handles (about a millisecond each).
        for importer in self.importers.values():
            if importer.reusable:
                importer.release()
        self._notify()
        self._events.failed(
            self._manifest.worker_id,
            update.header,
            err,
            tally=update.tally,
            prior_state=update.prior_state,
            new_state=new_state,
            weights_version=self._version,
        )
        self._release(update)

    def _release(self, update: Update) -> None:
        with self._mu:
            if self._active is update:
                self._active = None
                self._released.notify_all()

    def push(
        self,
        requests: Iterator[pb.PushWeightsRequest],
        *,
        client_gone: Callable[[], bool] | None = None,
        rpc_ended: threading.Event | None = None,
    ) -> Iterator[pb.PushWeightsResponse]:
        """The PushWeights stream: header, buckets, commit, then the end of the stream. Raises
        WeightwireError on any failure.

        Each request is awaited for at most ``idle_timeout_s`` (DEADLINE_EXCEEDED after that). The
        commit happens only once the stream ends right after the commit message: a message after
        it is MALFORMED_STREAM and nothing is committed. If the caller stops iterating (client gone)
        or ``requests`` raises, the update fails and, when something was already loaded, the worker
        becomes INCONSISTENT. ``client_gone`` tells a cancelled stream (recorded as CANCELLED) from
        one the client closed without a commit; ``rpc_ended`` is set by the transport once the RPC
        is over (cancelled, timed out or finished), so a new update knows this one is unwinding.
        """
        yield from self._run(StreamReader(requests, self.idle_timeout_s), client_gone, rpc_ended)

    def push_update(
        self,
        requests: Iterable[pb.PushWeightsRequest],
        *,
        client_gone: Callable[[], bool] | None = None,
        rpc_ended: threading.Event | None = None,
    ) -> list[pb.PushWeightsResponse]:
        """The PushUpdate call: ``requests`` are a whole PushWeights stream, already received; the
        same rules in the same order, and the responses the stream would have sent. Raises
        WeightwireError on any failure (nothing committed)."""
        return list(self._run(ListedRequests(requests), client_gone, rpc_ended))

    def _run(
        self,
        reader: StreamReader | ListedRequests,
        client_gone: Callable[[], bool] | None,
        rpc_ended: threading.Event | None,
    ) -> Iterator[pb.PushWeightsResponse]:
        update: Update | None = None
        requests: Iterator[pb.PushWeightsRequest] = reader
        commit: pb.UpdateCommit | None = None
        try:
            reader.waiting_for = "the header"
            try:
                first = next(requests, None)
                if first is None and client_gone is not None and client_gone():
                    # Cancelled before it sent anything (a trainer opens its streams while it plans
                    # and cancels them when the plan is refused): no update began, nothing to record.
                    return
                if first is None or first.WhichOneof("message") != "header":
                    what = "nothing" if first is None else (first.WhichOneof("message") or "an empty message")
                    raise WeightwireError(
                        Reason.MALFORMED_STREAM, f"an update must start with a header; received {what}"
                    )
            except WeightwireError as err:
                # Refused before any update began: no header, or none in time.
                with self._mu:
                    self._record_failure(err, 0)
                self._tell_refused(None, err)
                raise
            update = self.begin_update(first.header, rpc_ended=rpc_ended)
            reader.waiting_for = "the next bucket or the commit"
            # A transport that receives ahead (transfer groups) sees the next bucket while this one loads.
            for req in read_ahead(requests, self.importers):
                kind = req.WhichOneof("message")
                if commit is not None:
                    what = f"a {kind}" if kind else "an empty message"
                    raise update.fail(
                        WeightwireError(
                            Reason.MALFORMED_STREAM,
                            f"{what} arrived after the commit; the commit must be the last message of an update "
                            "(nothing was committed)",
                        )
                    )
                if kind == "bucket":
                    ack = update.bucket(req.bucket)
                    self._events.bucket_acked(ack)
                    yield pb.PushWeightsResponse(ack=ack)
                elif kind == "commit":
                    # Committed once the stream ends right after it (the loop ends), never earlier.
                    commit = req.commit
                    reader.timeout_s = min(END_AFTER_COMMIT_S, self.idle_timeout_s)
                    reader.waiting_for = "the end of the stream after the commit"
                    reader.hint = "; close the stream (half-close) right after sending the commit"
                else:
                    what = "a second header" if kind == "header" else "an empty message"
                    raise update.fail(
                        WeightwireError(Reason.MALFORMED_STREAM, f"received {what} inside an update")
                    )
            if commit is not None:
                yield pb.PushWeightsResponse(result=update.commit(commit))
                return
            if client_gone is not None and client_gone():
                raise update.fail(cancelled_error())
            raise update.fail(
                WeightwireError(
                    Reason.MALFORMED_STREAM, "the stream ended before a commit; the update was not applied"
                )
            )
        except WeightwireError as refused:
            # Raised by the reader too (an idle stream): the update ends with that reason.
            if update is not None:
                update.fail(refused)
            raise
        except Exception as e:
            # The request stream broke (client gone) or a bug: never leave the update half-open.
            if update is not None and not update.finished:
                gone = client_gone is not None and client_gone()
                failure = (
                    cancelled_error()
                    if gone
                    else WeightwireError(Reason.INTERNAL, f"internal error in the worker: {e!r}")
                )
                update.fail(failure)
            raise
        finally:
            reader.close()
            if update is not None and not update.finished:
                update.fail(cancelled_error())
