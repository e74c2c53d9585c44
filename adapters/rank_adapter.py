"""What the adapter of one engine rank shares across engines (SGLang, vLLM).

Both read a model layout from the engine's real model, publish it as the rank's manifest, check
every pushed tensor against it before anything is written, and time where an update goes. The
engine-specific parts (how a layout is read, how a tensor reaches the model) stay in
``weightwire.adapters.sglang`` and ``weightwire.adapters.vllm``; this module holds the rest once.
Pure torch: no engine, no gRPC.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable

import torch
from weightwire.adapters.layout_rules import StageLayout
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest, transports_for


def rank_manifest(
    own_device: DeviceRef,
    rank: ParallelRank,
    tensors: Iterable[OwnedTensor],
    stage: StageLayout,
    *,
    engine: str,
    worker_id: str,
) -> ShardManifest:
    """The manifest of one engine rank: its checkpoint tensors and stage, a fresh instance id (so a
    restarted engine never matches a plan made before the restart)."""
    return ShardManifest.build(
        own_device,
        rank,
        tensors,
        layer_start=stage.layer_start,
        layer_end=stage.layer_end,
        num_layers=stage.num_layers,
        engine=engine,
        worker_id=worker_id,
        transports=transports_for(own_device),
        instance_id=uuid.uuid4().hex,
    )


def check_pushed_tensor(
    worker_id: str,
    name: str,
    tensor: torch.Tensor,
    expected: tuple[torch.dtype, tuple[int, ...]] | None,
) -> None:
    """Refuse a pushed tensor whose dtype or full checkpoint shape is not the ``expected`` one of
    the layout (None: the name is not in this worker's layout)."""
    if expected is None:
        # The service filters by manifest already; anything else reaching here is a bug upstream.
        raise WeightwireError(
            Reason.LOAD_FAILED,
            f"{worker_id}: {name!r} is not in this worker's manifest; refusing to load it",
        )
    dtype, shape = expected
    if tensor.dtype != dtype:
        raise WeightwireError(
            Reason.DTYPE_MISMATCH, f"{name}: got {tensor.dtype}, this worker expects {dtype}", tensor=name
        )
    if tuple(tensor.shape) != shape:
        raise WeightwireError(
            Reason.SHAPE_MISMATCH,
            f"{name}: got shape {tuple(tensor.shape)}, this worker expects the full checkpoint shape {shape}",
            tensor=name,
        )


@dataclasses.dataclass
class UpdatePhaseTimes:
    """Where one update's time went on one engine rank (nanoseconds): ``loads`` calls of ``load``
    taking ``load_ns``, of them ``sync_ns`` device synchronizes, and ``total_ns`` from
    ``begin_update`` until ``end_update`` returned. Each engine's adapter adds its own phases."""

    version: int
    loads: int = 0
    load_ns: int = 0
    sync_ns: int = 0
    total_ns: int = 0

    def as_ms(self) -> dict[str, float | int]:
        """Every field, the ``*_ns`` ones as ``*_ms`` in milliseconds (a phase log line, a benchmark)."""
        return {
            k.removesuffix("_ns") + "_ms" if k.endswith("_ns") else k: (v / 1e6 if k.endswith("_ns") else v)
            for k, v in dataclasses.asdict(self).items()
        }
