"""A worker's membership of a transfer group: forming one within its timeout, the receive thread
and bounded staging buffers of the member, leaving and tearing down, and the status. No gRPC.

``GroupMembership`` is owned by the worker service (JoinTransferGroup / LeaveTransferGroup, GetStatus,
shutdown); the transport's importer (``weightwire.server.transports.transfer_group.GroupImporter``)
receives each bucket's bytes through its current member. Receives run on one thread per group,
strictly in stream order, each with the group's timeout. Any failed receive, any failed update, a new
join and a leave tear the group down: its process groups are destroyed (so the sender's pending
operations on it fail at once), its staging buffers are freed, and the next update over it is refused
with GROUP_NOT_JOINED until the trainer forms a new one.
"""

from __future__ import annotations

import logging
import socket
import threading

import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports.isolated_gloo import isolation_enabled
from weightwire.core.transports.isolated_gloo_spare import discard_spare, start_spare
from weightwire.core.transports.transfer_group import TransferGroup, backend_name, check_backend, close_groups
from weightwire.core.transports.transfer_group_plan import (
    MemberIdentity,
    check_spec,
    clip,
    own_rank,
)
from weightwire.core.transports.transfer_group_store import shut_down_sockets, store_sockets
from weightwire.server.transports.transfer_group_member import (
    DEFAULT_MAX_STAGING_BYTES,
    MAX_STAGING_BUFFERS,
    JoinedGroup,
)
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["DEFAULT_MAX_STAGING_BYTES", "MAX_STAGING_BUFFERS", "GroupMembership", "default_group_host"]

log = logging.getLogger(__name__)

# How long past the group's timeout a join waits for its formation before giving up on it.
_FORM_GRACE_S = 5.0


class _Formation:
    """One ``TransferGroup.form`` running on its own thread, for a join that waits for it with a bound."""

    def __init__(
        self, spec: pb.TransferGroupSpec, me: MemberIdentity, listen_host: str, device: torch.device
    ) -> None:
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._group: TransferGroup | None = None
        self._error: BaseException | None = None
        args = (spec, me, listen_host, device)
        threading.Thread(
            target=self._run, args=args, name=f"ww-group-form-{spec.group_id[:16]}", daemon=True
        ).start()

    def _run(
        self, spec: pb.TransferGroupSpec, me: MemberIdentity, listen_host: str, device: torch.device
    ) -> None:
        try:
            group = TransferGroup.form(
                spec, me, listen_host=listen_host, device=device, isolate=isolation_enabled()
            )
        except BaseException as e:  # handed to the join
            with self._lock:
                self._error = e
            self.done.set()
            return
        with self._lock:
            abandoned = self._abandoned
            self._group = group
        if abandoned:
            group.close()  # its join already gave up: nobody will use it
        self.done.set()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            group = self._group
        if group is not None:
            group.close()

    def result(self) -> TransferGroup:
        with self._lock:
            group, error = self._group, self._error
        if error is not None:
            raise error
        assert group is not None
        return group


class GroupMembership:
    """This worker's transfer group, at most one at a time: joining (``join``, within the group's
    timeout), leaving, tearing down, its status. The worker service owns it; the transport's
    importer (``GroupImporter``) receives a bucket's bytes through the member it holds."""

    def __init__(self) -> None:
        self.listen_host = "127.0.0.1"
        self.max_staging_bytes = DEFAULT_MAX_STAGING_BYTES
        self._join_lock = threading.Lock()
        self._lock = threading.Lock()
        self._member: JoinedGroup | None = None
        self._forming: pb.TransferGroupSpec | None = None
        self._last_teardown = ""
        self._closing: list[TransferGroup] = []
        if isolation_enabled():
            # Ready long before a trainer joins: starting one (an interpreter importing torch) takes
            # seconds, which would otherwise count against the group's formation timeout. Each one
            # taken for a group starts the next (``take_receiving_process``).
            start_spare()

    def configure(self, *, listen_host: str | None = None, max_staging_bytes: int | None = None) -> None:
        """Where this worker's group sockets listen (an address of this machine the trainer can
        reach), and the largest bucket it stages."""
        if listen_host:
            try:
                socket.getaddrinfo(listen_host, None)
            except OSError as e:
                raise ValueError(f"transfer-group host {listen_host!r} does not resolve here: {e}") from None
            self.listen_host = listen_host
        if max_staging_bytes is not None:
            if max_staging_bytes <= 0:
                raise ValueError("max_staging_bytes must be positive")
            self.max_staging_bytes = int(max_staging_bytes)

    # --- joining and leaving -------------------------------------------------------------------

    def join(
        self, spec: pb.TransferGroupSpec, me: MemberIdentity, device: torch.device
    ) -> pb.JoinTransferGroupResponse:
        """Form ``spec`` as ``me`` (leaving the current group first); returns once formed and checked."""
        check_spec(spec)
        own_rank(spec, me)
        check_backend(spec.backend, device)
        if spec.max_bucket_bytes > self.max_staging_bytes:
            raise WeightwireError(
                Reason.INVALID_SIZE,
                f"the trainer will send buckets of up to {spec.max_bucket_bytes} bytes; this worker stages at most "
                f"{self.max_staging_bytes} per buffer (use a smaller bucket size, or raise the worker's limit)",
            )
        with self._join_lock:
            self.teardown(f"replaced by group {spec.group_id}")
            with self._lock:
                self._forming = spec
            try:
                group = self._form_within_timeout(spec, me, device)
            except WeightwireError as err:
                with self._lock:
                    self._forming = None
                    self._last_teardown = (
                        f"forming {spec.group_id} failed: {err.reason}: {clip(err.message, 200)}"
                    )
                raise
            member = JoinedGroup(group, device, min(spec.max_bucket_bytes, self.max_staging_bytes))
            with self._lock:
                self._forming = None
                self._member = member
        log.info(
            "joined transfer group %s (%s) as rank %d of %d",
            spec.group_id,
            backend_name(spec.backend),
            group.rank,
            spec.world_size,
        )
        return pb.JoinTransferGroupResponse(group_rank=group.rank, group=self.status())

    def _form_within_timeout(
        self, spec: pb.TransferGroupSpec, me: MemberIdentity, device: torch.device
    ) -> TransferGroup:
        """``TransferGroup.form`` on a thread of its own, given the group's timeout (and a grace).

        Every step of forming has a deadline of its own, but a step that does not return (a store
        that stops answering in the middle of the rendezvous) must not hold this join, nor the next
        one (joins run one after another): past the bound the join is refused with GROUP_TIMEOUT,
        the formation's connections to the store are shut down (which ends its wait), and a group it
        still forms afterwards is closed at once.
        """
        before = store_sockets(spec.store_address)
        formation = _Formation(spec, me, self.listen_host, device)
        if formation.done.wait(spec.timeout_ms / 1000 + _FORM_GRACE_S):
            return formation.result()
        shut_down_sockets(store_sockets(spec.store_address) - before)
        formation.abandon()
        raise WeightwireError(
            Reason.GROUP_TIMEOUT,
            f"group {spec.group_id}: forming did not end within its timeout of {spec.timeout_ms / 1000:g} s "
            f"(a step did not return; the store at {clip(spec.store_address, 80)} may have stopped answering); "
            "this worker gave up on it and can join again",
            group_id=spec.group_id,
        )

    def leave(self, group_id: str) -> bool:
        with self._lock:
            member = self._member
        if member is None or member.group.group_id != group_id:
            return False
        self.teardown("left on request")
        return True

    def teardown(self, why: str, wait_s: float = 0.0) -> None:
        """Leave the current group (if any) because of ``why``."""
        with self._lock:
            member, self._member = self._member, None
            if member is not None:
                self._last_teardown = f"{member.group.group_id}: {why}"
                # Groups whose destructors may still run (see ``shutdown``); finished ones are dropped.
                self._closing = [g for g in self._closing if not g.destroyed] + [member.group]
        if member is not None:
            member.close(wait_s)
            log.info("left transfer group %s: %s", member.group.group_id, why)

    def current(self) -> JoinedGroup:
        """The group an arriving bucket travels over, or GROUP_NOT_JOINED saying why there is none."""
        with self._lock:
            member, forming = self._member, self._forming
        if member is None:
            state = (
                f"group {forming.group_id} is still forming"
                if forming is not None
                else "this worker is in no transfer group"
            )
            raise WeightwireError(
                Reason.GROUP_NOT_JOINED,
                f"a bucket arrived over a transfer group, but {state}"
                f"{f' (the last one ended: {self._last_teardown})' if self._last_teardown else ''}; form the group first",
            )
        return member

    def shutdown(self, wait_s: float = 10.0) -> None:
        """The worker stops: leave the group, and give every process group torn down so far up to
        ``wait_s`` to be destroyed (a process that exits during a destructor aborts)."""
        self.teardown("the worker stopped")
        discard_spare()
        with self._lock:
            closing, self._closing = self._closing, []
        close_groups(closing, wait_s)

    # --- status --------------------------------------------------------------------------------

    def status(self) -> pb.TransferGroupStatus:
        with self._lock:
            member, forming, last = self._member, self._forming, self._last_teardown
        out = pb.TransferGroupStatus(
            state=pb.TRANSFER_GROUP_STATE_NONE, max_staging_buffers=MAX_STAGING_BUFFERS, last_teardown=last
        )
        if member is not None:
            spec = member.group.spec
            with member.cond:
                (buffers, nbytes), received = member.staging.held(), member.bytes_received
            out.group_id = spec.group_id
            out.state = pb.TRANSFER_GROUP_STATE_READY
            out.backend = spec.backend
            out.group_rank = member.group.rank
            out.world_size = spec.world_size
            out.staging_buffers = buffers
            out.staging_bytes = nbytes
            out.bytes_received = received
        elif forming is not None:
            out.group_id = forming.group_id
            out.state = pb.TRANSFER_GROUP_STATE_FORMING
            out.backend = forming.backend
            out.world_size = forming.world_size
        return out


def default_group_host(listen: str | None) -> str:
    """Where a worker's transfer-group sockets listen unless told: the host of its TCP listener,
    or loopback for a unix socket or a wildcard address (a trainer on another machine then needs
    ``group_host``, ``weightwire serve --group-host``)."""
    if not listen or listen.startswith("unix:"):
        return "127.0.0.1"
    host = listen.rpartition(":")[0].strip("[]")
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
