"""The client's public data types: what a push returns and reports, and the buffers it takes.

``PushResult`` (one per committed worker), ``PushProgress`` (the ``progress`` callback's argument),
``FlatBucket`` (``push_flat``'s already-flat buffers) and ``GatheredBucket`` (``push_gathered``'s
buckets with several labelled payloads). Re-exported by ``weightwire.client``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from weightwire.client.inputs.plan import TensorSpec
from weightwire.v1 import weight_transfer_pb2 as pb

Scope = Literal["full", "partial"]


@dataclasses.dataclass(frozen=True)
class PushResult:
    """What one worker reported for a committed update, plus the client's view of it."""

    worker: str
    worker_id: str
    version: int
    previous_version: int
    tensors_loaded: int
    bytes_loaded: int
    buckets: int
    handles_opened: int
    duration_s: float
    server_duration_s: float
    transport: str
    state: str
    # Buckets this worker took from another GPU of its host (only with allow_peer_device_import),
    # and every device it imported payloads from (normalised labels, e.g. "cuda:1a2b...").
    peer_device_imports: int = 0
    source_devices: tuple[str, ...] = ()
    # Bytes that reached this worker over the network (transfer groups; 0 for other transports).
    bytes_received: int = 0
    # A push with ``delta=True``: "DELTA" or "FULL", why it went whole ("NO_BASE", "BASE_MISMATCH",
    # "TRANSPORT"; "NONE" for a delta), how many workers refused a delta that was then sent again
    # whole, and the bytes of the buckets this worker was sent. A push without delta: "FULL", "", 0, 0.
    encoding: str = "FULL"
    delta_fallback: str = ""
    delta_refused: int = 0
    encoded_bytes: int = 0

    @property
    def gbps(self) -> float:
        """Bytes loaded per second of the whole update as the client saw it, in GB/s."""
        return self.bytes_loaded / self.duration_s / 1e9 if self.duration_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class PushProgress:
    buckets_done: int
    buckets_total: int
    bytes_done: int
    bytes_total: int


@dataclasses.dataclass
class FlatBucket:
    """An already-flat buffer (e.g. an all-gather output) and the tensors inside it.

    ``buffer`` is a contiguous tensor of any dtype; ``specs`` offsets are relative to its first
    byte. It is exported in place when the transport can (a CPU buffer from
    ``WeightPusher.host_buffer`` over host shared memory; a CUDA buffer over CUDA IPC), otherwise
    copied once into a staging buffer.
    """

    buffer: torch.Tensor
    specs: Sequence[TensorSpec]


@dataclasses.dataclass
class GatheredBucket:
    """One bucket layout with several labelled copies of its bytes.

    Each entry of ``payloads`` is either a ``weightwire.v1.Payload`` exported elsewhere (another
    trainer rank's CUDA IPC handle or shm segment, already labelled with its device) or a local
    flat tensor, exported here and labelled with this process's device for it. Every worker picks
    the payload labelled with its own device. ``size_bytes`` defaults to the end of the last spec.
    """

    specs: Sequence[TensorSpec]
    payloads: Sequence[pb.Payload | torch.Tensor]
    size_bytes: int | None = None


ProgressFn = Callable[[PushProgress], None]

__all__ = ["FlatBucket", "GatheredBucket", "ProgressFn", "PushProgress", "PushResult", "Scope"]
