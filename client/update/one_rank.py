"""One trainer rank's DTensors as plain local tensors, at the cost of an attribute read per tensor.

An FSDP2 trainer with one rank pushes ``model.state_dict()``: DTensors on a one-device mesh, each
holding its whole value locally. ``weightwire.client.inputs.dtensor_gather.single_rank_items`` turns
them into plain tensors with ``to_local()`` (an autograd function) after checking each one's mesh,
placements and shape: about 7 ms for Qwen3-8B's 399 DTensors on one H200's host, half the plain
push's own time. A DTensor's mesh, placements and global shape never change (its spec is fixed), so
``OneRankItems`` checks each DTensor object once, keeps the verdict by weak reference, and reads its
local tensor (``_local_tensor``, what ``to_local()`` returns a view of) at every push: a local
tensor replaced since (FSDP resharding anew) is read anew, never served from the push before.
Anything else (a group given, a mesh of several devices, a shard that is not the whole value) goes
to ``single_rank_items`` as before. Used by ``WeightPusher.push``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from weightwire.client.inputs.dtensor_gather import is_dtensor, single_rank_items

# DTensor objects whose verdict is kept; a model has a few thousand at most.
_MAX_KEPT = 1 << 16


def _whole_locally(t: Any) -> bool:
    """A DTensor on a one-device mesh whose local tensor is its whole value (no padding, no
    Partial placement): what ``single_rank_items`` sends as ``to_local()``."""
    local = t._local_tensor
    return (
        t.device_mesh.size() == 1
        and tuple(local.shape) == tuple(t.shape)
        and not any(type(p).__name__ == "Partial" for p in t.placements)
    )


class OneRankItems:
    """``single_rank_items`` with each DTensor's check made once (see the module docstring)."""

    def __init__(self) -> None:
        self._whole: dict[int, weakref.ref[torch.Tensor]] = {}

    def items(
        self, items: list[tuple[str, torch.Tensor]], group: object
    ) -> list[tuple[str, torch.Tensor]] | None:
        if group is not None:
            return single_rank_items(items, group)
        whole = self._whole
        out: list[tuple[str, torch.Tensor]] = []
        for name, t in items:
            ref = whole.get(id(t))
            if ref is None or ref() is not t:
                if not is_dtensor(t):
                    out.append((name, t))
                    continue
                if not _whole_locally(t):
                    return single_rank_items(items, group)
                if len(whole) >= _MAX_KEPT:
                    whole.clear()
                whole[id(t)] = weakref.ref(t)
            local = t._local_tensor  # type: ignore[attr-defined]
            out.append((name, local.detach() if local.requires_grad else local))
        return out
