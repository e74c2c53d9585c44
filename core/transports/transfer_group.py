"""Transfer groups on the network: the rendezvous store, the process-group backends, forming a
group with its checks, and the send/receive/broadcast calls with deadlines. No gRPC in here.

Who calls what: the trainer (``weightwire.client``) serves the store with ``StoreServer`` and forms
its side with ``TransferGroup.form`` while every worker does the same on its side
(``weightwire.server``), all from one plan (``weightwire.core.transports.transfer_group_plan``).

Forming never touches the process's default process group: every group is a ``ProcessGroupGloo``
(or ``ProcessGroupNCCL``) object built on a ``PrefixStore`` over the store of
``transfer_group_store`` (whose every read from the network is bounded). Before any weight byte
moves, every member checks the group through the store (``transfer_group_rendezvous``: each rank
claimed once, by the member the plan names, with the same world size and the same plan), then over
the group itself (an all-gather of member identities), and refuses with a reason otherwise. Every send, receive and wait has a
deadline; a peer that dies makes the operations on it fail at once (its sockets close), one that
hangs makes them fail at the deadline.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports.isolated_gloo import ReceivingProcess
from weightwire.core.transports.isolated_gloo_spare import take_receiving_process
from weightwire.core.transports.transfer_group_plan import (
    MemberIdentity,
    check_spec,
    clip,
    own_rank,
)
from weightwire.core.transports.transfer_group_rendezvous import Rendezvous, member_record
from weightwire.core.transports.transfer_group_store import (
    StoreServer,
    as_timedelta,
    connect_store,
    shut_down_sockets,
    store_sockets,
)
from weightwire.v1 import weight_transfer_pb2 as pb

# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------


def _gloo(
    store: Any, rank: int, size: int, timeout: datetime.timedelta, listen_host: str, device: torch.device
) -> Any:
    opts = torch.distributed.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    # The device decides the address gloo's own sockets bind to (ephemeral ports on that address).
    opts._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=listen_host, lazy_init=False)]
    return torch.distributed.ProcessGroupGloo(store, rank, size, opts)


def nccl_available() -> bool:
    return torch.cuda.is_available() and hasattr(torch.distributed, "ProcessGroupNCCL")


def check_backend(backend: int, device: torch.device) -> None:
    """TRANSPORT_UNAVAILABLE when this process cannot be a member on ``backend`` with ``device``."""
    if backend == pb.TRANSFER_BACKEND_NCCL:
        if not nccl_available():
            raise WeightwireError(
                Reason.TRANSPORT_UNAVAILABLE,
                "the NCCL backend needs a CUDA build of torch and a visible GPU in this process; use TRANSFER_BACKEND_GLOO",
                backend="nccl",
            )
        if torch.device(device).type != "cuda":
            raise WeightwireError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"the NCCL backend stages on a GPU, but this member's device is {device}; use TRANSFER_BACKEND_GLOO",
                backend="nccl",
            )
    elif not torch.distributed.is_gloo_available():
        raise WeightwireError(
            Reason.TRANSPORT_UNAVAILABLE, "this build of torch has no gloo backend", backend="gloo"
        )


def _nccl(
    store: Any, rank: int, size: int, timeout: datetime.timedelta, listen_host: str, device: torch.device
) -> Any:
    # NCCL picks its own interfaces (NCCL_SOCKET_IFNAME); listen_host does not apply.
    check_backend(pb.TRANSFER_BACKEND_NCCL, device)
    opts = torch.distributed.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg = torch.distributed.ProcessGroupNCCL(store, rank, size, opts)
    # Connect now, so that an unreachable peer fails the formation and not the first bucket.
    pg.eager_connect_single_device(_indexed(device))
    return pg


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current device>`` (NCCL needs the index)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


BackendFactory = Callable[[Any, int, int, datetime.timedelta, str, torch.device], Any]
BACKENDS: dict[int, tuple[str, BackendFactory]] = {
    pb.TRANSFER_BACKEND_GLOO: ("gloo", _gloo),
    pb.TRANSFER_BACKEND_NCCL: ("nccl", _nccl),
}


def backend_name(backend: int) -> str:
    entry = BACKENDS.get(backend)
    return entry[0] if entry else f"backend {backend}"


def staging_device(backend: int, device: torch.device) -> torch.device:
    """Where a member's transfer buffers live: host memory for gloo, the member's GPU for NCCL."""
    return _indexed(device) if backend == pb.TRANSFER_BACKEND_NCCL else torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Formation
# ---------------------------------------------------------------------------------------------


def _identity_digest(identity: MemberIdentity, rank: int) -> torch.Tensor:
    return torch.frombuffer(
        bytearray(hashlib.sha256(member_record(identity, rank)).digest()), dtype=torch.uint8
    )


def backend_message(e: BaseException) -> str:
    """The first line of a torch.distributed error, without gloo's leading source path."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)
    # gloo appends generic advice ("This is typically caused by ...") that names no cause.
    return first.split(" This is typically caused by")[0]


def transfer_error(e: BaseException, what: str, **metadata: str) -> WeightwireError:
    """A failed torch.distributed operation as TRANSFER_FAILED, with the backend's first line."""
    if isinstance(e, WeightwireError):
        return e
    return WeightwireError(Reason.TRANSFER_FAILED, f"{what}: {clip(backend_message(e), 300)}", **metadata)


class TransferGroup:
    """This process's side of a formed group: the full process group (point-to-point) and the
    broadcast subgroups it is a member of. Build with ``form``; ``close`` destroys it."""

    def __init__(
        self,
        spec: pb.TransferGroupSpec,
        rank: int,
        pg: Any,
        subgroups: dict[int, tuple[Any, dict[int, int]]],
        store: Any,
        receiving: ReceivingProcess | None = None,
    ) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = spec.world_size
        self.timeout = as_timedelta(spec.timeout_ms / 1000)
        self._pg = pg
        # subgroup id -> (process group, group rank -> rank inside the subgroup)
        self._subgroups = subgroups
        self._store = store
        # The process holding this member's gloo groups, when they are isolated (``isolated_gloo``).
        self._receiving = receiving
        self._lock = threading.Lock()
        self.closed = False
        self._closer: threading.Thread | None = None

    @property
    def group_id(self) -> str:
        return self.spec.group_id

    @property
    def backend(self) -> int:
        return self.spec.backend

    @classmethod
    def form(
        cls,
        spec: pb.TransferGroupSpec,
        me: MemberIdentity,
        *,
        listen_host: str,
        device: torch.device | str = "cpu",
        store: Any | None = None,
        isolate: bool = False,
    ) -> TransferGroup:
        """Join ``spec`` as ``me``: rendezvous on the store (``store`` for the member that serves
        it, else a client of ``spec.store_address``), check the group, build the process groups,
        check identities over them and meet at a barrier. Within ``spec.timeout_ms`` or raises.
        With ``isolate`` (a worker), gloo process groups are held by a receiving process of their
        own (``isolated_gloo``), so that no member can end this process."""
        check_spec(spec)
        rank = own_rank(spec, me)
        device = torch.device(device)
        name, factory = BACKENDS[spec.backend]
        timeout_s = spec.timeout_ms / 1000
        deadline = time.monotonic() + timeout_s
        check_backend(spec.backend, device)
        base = store if store is not None else connect_store(spec.store_address, timeout_s)
        group_store = torch.distributed.PrefixStore(f"weightwire/{spec.group_id}", base)
        rendezvous = Rendezvous(group_store, spec, rank, me, deadline)
        try:
            rendezvous.run()
        except WeightwireError:
            raise
        except Exception as e:
            raise WeightwireError(
                Reason.GROUP_STORE_UNREACHABLE,
                f"group {spec.group_id}: the store at {spec.store_address} failed during the rendezvous: {clip(str(e), 200)}",
            ) from None

        def remaining() -> datetime.timedelta:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightwireError(
                    Reason.GROUP_TIMEOUT,
                    f"group {spec.group_id}: forming took longer than {timeout_s:g} s",
                    group_id=spec.group_id,
                )
            return as_timedelta(left)

        receiving: ReceivingProcess | None = None

        def make(sub: str, r: int, n: int) -> Any:
            if receiving is not None:
                prefixes = [f"weightwire/{spec.group_id}", sub]
                return receiving.process_group(spec.store_address, prefixes, r, n, remaining(), listen_host)
            return factory(
                torch.distributed.PrefixStore(sub, group_store), r, n, remaining(), listen_host, device
            )

        stage = "starting the receiving process"
        try:
            if isolate and spec.backend == pb.TRANSFER_BACKEND_GLOO and store is None:
                receiving = take_receiving_process(remaining().total_seconds(), spec.group_id)
            stage = "connecting the process group"
            pg = make("pg", rank, spec.world_size)
            stage = "checking member identities over the group"
            buf_device = staging_device(spec.backend, device)
            mine = _identity_digest(me, rank).to(buf_device)
            gathered = [torch.empty(32, dtype=torch.uint8, device=buf_device) for _ in range(spec.world_size)]
            pg.allgather([gathered], [mine]).wait(remaining())
            for r, got in enumerate(gathered):
                want = _identity_digest(MemberIdentity.from_proto(spec.members[r]), r)
                if not torch.equal(got.cpu(), want):
                    raise WeightwireError(
                        Reason.GROUP_UNKNOWN_MEMBER,
                        f"group {spec.group_id}: the process at group rank {r} of the {name} group is not "
                        f"{MemberIdentity.from_proto(spec.members[r]).describe()} (identity check over the group)",
                        group_rank=str(r),
                    )
            subgroups: dict[int, tuple[Any, dict[int, int]]] = {}
            for sg in sorted(spec.subgroups, key=lambda s: s.subgroup_id):
                if rank not in sg.member_ranks:
                    continue
                stage = f"connecting broadcast subgroup {sg.subgroup_id}"
                local = {r: i for i, r in enumerate(sg.member_ranks)}
                subgroups[sg.subgroup_id] = (
                    make(f"sub/{sg.subgroup_id}", local[rank], len(sg.member_ranks)),
                    local,
                )
            stage = "meeting at the group's barrier"
            opts = torch.distributed.BarrierOptions()
            opts.timeout = remaining()
            pg.barrier(opts).wait(remaining())
        except Exception as e:
            if receiving is not None:
                receiving.kill()
            if isinstance(e, WeightwireError):
                raise rendezvous.refuse(e) from None
            text = backend_message(e)
            timed_out = "timed out" in text.lower() or "timeout" in text.lower()
            raise rendezvous.refuse(
                WeightwireError(
                    Reason.GROUP_TIMEOUT if timed_out else Reason.TRANSFER_FAILED,
                    f"group {spec.group_id}: {stage} ({name}) failed: {clip(text, 240)}",
                    group_id=spec.group_id,
                )
            ) from None
        return cls(spec, rank, pg, subgroups, base, receiving)

    # --- data plane ----------------------------------------------------------------------------

    def _group(self) -> Any:
        pg = self._pg
        if pg is None:
            raise WeightwireError(
                Reason.GROUP_NOT_JOINED,
                f"transfer group {self.group_id} was torn down",
                group_id=self.group_id,
            )
        return pg

    def process_group(self) -> Any:
        """The group's full process group (GROUP_NOT_JOINED once torn down), for a data plane that
        posts its own operations (``transfer_group_slices``)."""
        return self._group()

    def subgroup_of(self, subgroup_id: int) -> tuple[Any, dict[int, int]]:
        entry = self._subgroups.get(subgroup_id)
        if entry is None:
            raise WeightwireError(
                Reason.GROUP_NOT_JOINED,
                f"this member is not in broadcast subgroup {subgroup_id} of transfer group {self.group_id}",
                group_id=self.group_id,
            )
        return entry

    def subgroup_spec(self, subgroup_id: int) -> pb.TransferSubgroup | None:
        return next((s for s in self.spec.subgroups if s.subgroup_id == subgroup_id), None)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Post a send (keep the returned work until ``wait``: dropping it cancels the send)."""
        group = self._group()
        return self._posted(lambda: group.send([tensor], dst, tag), f"posting a send to group rank {dst}")

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        group = self._group()
        return self._posted(
            lambda: group.recv([tensor], src, tag), f"posting a receive from group rank {src}"
        )

    def broadcast(self, tensor: torch.Tensor, subgroup_id: int) -> Any:
        """Post this member's part of a broadcast in ``subgroup_id`` from the subgroup's root."""
        pg, local = self.subgroup_of(subgroup_id)
        sg = self.subgroup_spec(subgroup_id)
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = local[sg.root_rank]  # type: ignore[union-attr]
        opts.rootTensor = 0
        opts.timeout = self.timeout
        return self._posted(
            lambda: pg.broadcast([tensor], opts), f"posting a broadcast in subgroup {subgroup_id}"
        )

    def _posted(self, post: Callable[[], Any], what: str) -> Any:
        """``post()``'s work; TRANSFER_FAILED when posting itself fails (a peer that is already gone
        can make the backend refuse the operation before any wait), as ``wait`` does later."""
        try:
            return post()
        except Exception as e:
            raise transfer_error(e, what, group_id=self.group_id) from None

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` up to the group's timeout; TRANSFER_FAILED when it fails or times out."""
        try:
            work.wait(self.timeout)
        except Exception as e:
            raise transfer_error(e, what, group_id=self.group_id) from None

    def close(self, wait_s: float = 0.0) -> None:
        """Destroy this side of the group: its sockets close, so operations of peers on it fail at
        once. Idempotent. A process group's destructor waits for the operations still running on
        its threads (until they fail or reach the timeout), so it runs on a thread of its own; this
        waits for it up to ``wait_s`` (a process about to exit should, so that the destructor is
        not cut off halfway)."""
        with self._lock:
            if self.closed:
                closer = self._closer
            else:
                self.closed = True
                if self._receiving is not None:
                    self._receiving.kill()  # its sockets close at once; nothing is left to destroy here
                # The store last: the process groups hold it from C++, but its Python half must
                # outlive them.
                doomed = [self._pg, *(p for p, _ in self._subgroups.values()), self._store]
                self._pg = None
                self._subgroups = {}
                self._store = None
                closer = self._closer = threading.Thread(
                    target=_destroy, args=(doomed, self.spec.backend), name="ww-group-close", daemon=True
                )
                closer.start()
                del doomed
        if closer is not None and wait_s > 0:
            closer.join(wait_s)

    @property
    def destroyed(self) -> bool:
        """Closed, and its process groups' destructors have finished."""
        closer = self._closer
        return self.closed and closer is not None and not closer.is_alive()


def close_groups(groups: Iterable[TransferGroup], wait_s: float) -> None:
    """Close ``groups`` (torn down already, or not) and wait for their destructors, all within one
    bound of ``wait_s``: a process that exits during a process group's destructor aborts."""
    deadline = time.monotonic() + wait_s
    for group in groups:
        group.close(max(0.0, deadline - time.monotonic()))


def _destroy(doomed: list[Any], backend: int) -> None:
    if backend == pb.TRANSFER_BACKEND_NCCL:
        for pg in doomed:
            try:
                pg.abort()  # NCCL communicators must be aborted, not only dropped
            except Exception:
                pass
    doomed.clear()  # the last references: the destructors run here


__all__ = [
    "BACKENDS",
    "StoreServer",
    "TransferGroup",
    "backend_message",
    "backend_name",
    "check_backend",
    "close_groups",
    "connect_store",
    "nccl_available",
    "shut_down_sockets",
    "staging_device",
    "store_sockets",
    "transfer_error",
]
