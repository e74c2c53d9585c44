"""Forming a transfer group with the workers, for both of a pusher's links: the single-source
``GroupLink`` (``transfer_group_link``) and the every-rank ``SourcesLink``
(``weightwire.client.ranks.transfer_group_sources``).

What they share lives here: every worker asked to join at once (``Joining``: JoinTransferGroup
calls; each worker then waits in the rendezvous while this side joins), this side's own joining
(``join_here``), the identities a group was formed with (a restarted worker means a new group),
and every worker told to leave (``leave_all``) after a failed forming or a teardown. What differs
stays in each link: who plans the group (this process, or rank 0 for every rank), and how the
verdict is reached (here, or exchanged between the ranks first).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from weightwire.client.rpc.calls import Worker, error_from_rpc
from weightwire.client.transports.transfer_group_options import TransferGroupOptions
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.transfer_group import TransferGroup
from weightwire.core.transports.transfer_group_plan import MemberIdentity
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = [
    "JOIN_GRACE_S",
    "TRAINER_KEY",
    "Joining",
    "identities_of",
    "join_here",
    "largest_tensor_bytes",
    "leave_all",
]

# How much longer than the group's timeout a JoinTransferGroup call may take (the worker answers
# with its reason at the group's timeout; the RPC deadline only guards a hung worker).
JOIN_GRACE_S = 5.0
_LEAVE_TIMEOUT_S = 5.0
# Key of the trainer's own part in a PushError about forming (workers are keyed by address).
TRAINER_KEY = "trainer"


def identities_of(manifests: Mapping[str, ShardManifest]) -> dict[str, tuple[str, str]]:
    """Each worker's (worker id, instance id): what a formed group holds until one restarts."""
    return {a: (m.worker_id, m.instance_id) for a, m in manifests.items()}


def largest_tensor_bytes(manifests: Mapping[str, ShardManifest], default: int = 0) -> int:
    """The largest tensor any worker owns (a group's buckets must fit it)."""
    return max((t.nbytes for m in manifests.values() for t in m.tensors.values()), default=default)


class Joining:
    """The workers' JoinTransferGroup calls of one forming, all started when it is built."""

    def __init__(
        self,
        workers: Mapping[str, Worker],
        addresses: Iterable[str],
        spec: pb.TransferGroupSpec,
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...],
    ) -> None:
        request = pb.JoinTransferGroupRequest(spec=spec)
        self._futures = {
            a: workers[a].stub.JoinTransferGroup.future(
                request, timeout=timeout_s + JOIN_GRACE_S, metadata=metadata
            )
            for a in addresses
        }

    def failures(self) -> dict[str, WeightwireError]:
        """Every worker's answer, waited for: the errors of those that did not join, by address."""
        failures: dict[str, WeightwireError] = {}
        for a, fut in self._futures.items():
            try:
                fut.result()
            except grpc.RpcError as e:
                failures[a] = error_from_rpc(e, worker=a, context="JoinTransferGroup")
        return failures


def join_here(
    spec: pb.TransferGroupSpec, identity: MemberIdentity, options: TransferGroupOptions, store: Any | None
) -> tuple[TransferGroup | None, WeightwireError | None]:
    """This process joins ``spec`` as ``identity`` on its own host (``store``: the rendezvous store
    when this process serves it): the group, or why it could not."""
    try:
        group = TransferGroup.form(
            spec, identity, listen_host=options.host, device=options.device, store=store
        )
    except WeightwireError as err:
        return None, err
    return group, None


def leave_all(workers: Mapping[str, Worker], group_id: str, metadata: tuple[tuple[str, str], ...]) -> None:
    """Tell every worker to leave ``group_id`` (best effort, concurrently, each within a few seconds)."""
    request = pb.LeaveTransferGroupRequest(group_id=group_id)
    futures = [
        w.stub.LeaveTransferGroup.future(request, timeout=_LEAVE_TIMEOUT_S, metadata=metadata)
        for w in workers.values()
    ]
    for fut in futures:
        try:
            fut.result()
        except grpc.RpcError:
            pass  # a worker that is gone has left already
