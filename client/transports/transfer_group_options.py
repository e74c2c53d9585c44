"""``TransferGroupOptions``: how a pusher forms its transfer group. Re-exported by
``weightwire.client.transports.transfer_group`` (its public path) and read by the group links.
"""

from __future__ import annotations

import dataclasses

import torch
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["TransferGroupOptions"]

_BACKENDS = {"gloo": pb.TRANSFER_BACKEND_GLOO, "nccl": pb.TRANSFER_BACKEND_NCCL}


@dataclasses.dataclass(frozen=True)
class TransferGroupOptions:
    """How a pusher forms its transfer group.

    ``host``: this trainer's address on the network the workers reach; the rendezvous store and the
    group's sockets listen only there. ``port``: the store's port (0 picks a free one). ``backend``:
    ``"gloo"`` (CPU staging) or ``"nccl"`` (tensors and staging on GPUs). ``broadcast``: workers that
    own the same tensors share one broadcast instead of receiving the same bytes one by one.
    ``timeout_s``: deadline of forming and of every send and receive (default: the pusher's timeout).
    ``trainer_rank``: this process's rank among the trainer's processes (only names it).
    """

    host: str
    port: int = 0
    backend: str = "gloo"
    broadcast: bool = True
    timeout_s: float | None = None
    trainer_rank: int = 0

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, not {self.backend!r}")
        if not self.host:
            raise ValueError("TransferGroupOptions needs the host address the workers can reach")

    @property
    def backend_value(self) -> int:
        return _BACKENDS[self.backend]

    @property
    def device(self) -> torch.device:
        """Where the backend sends from: the current GPU for NCCL (asked at each use: a trainer may
        select its GPU after building the pusher), the host for gloo."""
        if self.backend_value == pb.TRANSFER_BACKEND_NCCL:
            return (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cuda")
            )
        return torch.device("cpu")
