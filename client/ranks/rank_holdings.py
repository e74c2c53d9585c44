"""What each trainer rank holds of each tensor it pushes with every rank a source: a DTensor's
``Shard`` / ``Replicate`` placements on its device mesh, or a plain tensor held whole by every rank;
this rank's own parts of them; and the key of what a plan of them depends on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from weightwire.client.inputs.dtensor_gather import CastTo, is_dtensor, target_dtype
from weightwire.client.inputs.plan import PlanError
from weightwire.core import dtypes
from weightwire.core.errors import Reason
from weightwire.core.transports.transfer_plan import Box, Placement, Replicate, Shard
from weightwire.core.transports.transfer_plan import TensorSpec as Holding

__all__ = ["Holding", "holdings_of", "layout_key", "local_parts"]


def _placements(name: str, t: Any) -> list[Placement]:
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    out: list[Placement] = []
    for p in t.placements:
        if type(p) is DShard:
            out.append(Shard(int(p.dim)))
        elif isinstance(p, DReplicate):
            out.append(Replicate())
        else:
            raise PlanError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"{name}: DTensor placement {p!r} is not one every rank can send its part of (Shard and Replicate "
                "are); push without transfer_group=, which gathers it",
                tensor=name,
            )
    return out


def holdings_of(
    items: Sequence[tuple[str, torch.Tensor]], group: Any, cast_to: CastTo = None
) -> list[Holding]:
    """What every rank of ``group`` holds of each tensor (in the dtype it is sent as)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    meshes: dict[int, list[int]] = {}
    specs: list[Holding] = []
    for name, t in items:
        code = dtypes.from_torch(target_dtype(t.dtype, cast_to))
        shape = tuple(int(d) for d in t.shape)
        if not is_dtensor(t):
            specs.append(Holding.whole_on(name, shape, code, range(size)))
            continue
        mesh = t.device_mesh  # type: ignore[attr-defined]
        ranks = meshes.get(id(mesh))
        if ranks is None:
            ranks = meshes[id(mesh)] = [
                dist.get_group_rank(group, int(g)) for g in mesh.mesh.flatten().tolist()
            ]
        if any(r < 0 for r in ranks):
            raise PlanError(
                Reason.TRANSPORT_UNAVAILABLE,
                f"{name}: its device mesh has ranks outside the group given as group=",
                tensor=name,
            )
        specs.append(Holding.dtensor(name, shape, code, tuple(mesh.shape), _placements(name, t), ranks))
    return specs


def local_parts(
    items: Sequence[tuple[str, torch.Tensor]],
    specs: Sequence[Holding],
    rank: int,
    cast_to: CastTo = None,
    device: torch.device | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """This rank's parts of ``items`` (the local shard of a DTensor; cast when asked, and on
    ``device``, the one the group's backend sends from, when given) and the boxes they are."""
    local: dict[str, torch.Tensor] = {}
    boxes: dict[str, Box] = {}
    for (name, t), spec in zip(items, specs, strict=True):
        box = spec.holdings.get(rank)
        if box is None:
            continue
        part = (t.to_local() if is_dtensor(t) else t).detach()  # type: ignore[attr-defined]
        dtype = target_dtype(t.dtype, cast_to)
        to = device if device is not None and part.device.type != device.type else part.device
        local[name] = part if (part.dtype, part.device) == (dtype, to) else part.to(device=to, dtype=dtype)
        boxes[name] = box
    return local, boxes


def layout_key(items: Sequence[tuple[str, torch.Tensor]]) -> tuple[object, ...]:
    """What the plan of ``items`` depends on, cheap to build every push: names, dtypes, shapes and,
    for a DTensor, its mesh's ranks and its placements (each distinct mesh read once)."""
    meshes: dict[int, tuple[object, ...]] = {}

    def mesh_of(t: Any) -> tuple[object, ...]:
        mesh = t.device_mesh
        key = meshes.get(id(mesh))
        if key is None:
            key = meshes[id(mesh)] = (tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist()))
        return key

    return tuple(
        (n, t.dtype, tuple(t.shape), (mesh_of(t), tuple(map(str, t.placements))) if is_dtensor(t) else None)  # type: ignore[attr-defined]
        for n, t in items
    )
