"""Delta updates into an SGLang rank: each change written in place into the regions its direct copy
proved, and those regions read back as the parts the trainer's result checksums cover.

A delta addresses the full checkpoint tensor's row-major elements. What an SGLang rank keeps of a
checkpoint tensor lies in its parameters as the regions ``direct_copy.destinations`` states (this
rank's piece at its shard's rows of a fused q/k/v or gate/up parameter, an embedding's rows without
its vocabulary padding, both the embedding and lm_head of a tied model with its own lm_head).
A region holds the checkpoint-layout bytes of its piece only once a load through ``load_weights``
found it so (``SGLangAdapter.proven``): only then may a delta be applied there, and only then is
the region's checksum the one the trainer computes over the same piece of its checkpoint tensor.

``delta_layout`` decides at start whether a rank applies deltas at all: every owned tensor needs a
region per target (the rank takes slices: ``slices.kept_regions``) and each target must keep exactly
the manifest's piece (or the whole tensor), so that the region is that part, element for element.
Per call, ``refuse_unproven`` refuses a delta to a tensor whose regions were not proven since start
or since a wake that dropped the bytes (DELTA_BASE_MISMATCH, before any delta of the call is written):
the worker does not hold a base it can apply to, and the trainer's automatic FULL brings it back
(its load through ``load_weights`` proves the regions again).

Used by ``slices.DeltasSGLangAdapter``, on the engine thread through the adapter's pause gate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from weightwire.adapters.sglang.manifest import ModelLayout
from weightwire.adapters.torch.delta_pieces import apply_to_piece
from weightwire.core.delta import DELTA_BASE_MISMATCH, Delta, apply_delta
from weightwire.core.delta.errors import delta_error
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import ShardManifest, TensorPiece

__all__ = ["KeptPart", "apply_to_parts", "delta_layout", "refuse_unproven"]

Piece = tuple[int, int, int]
KeptPart = tuple[Piece | None, torch.Tensor]


def _as_tuple(p: TensorPiece) -> Piece:
    return (p.dim, p.offset, p.length)


def _kept_pieces(pieces: Iterable[TensorPiece], shape: Sequence[int]) -> tuple[Piece, ...]:
    """The pieces that narrow something (one covering its whole dimension keeps all of it)."""
    return tuple(_as_tuple(p) for p in pieces if not (p.offset == 0 and p.length == shape[p.dim]))


def delta_layout(
    manifest: ShardManifest, layout: ModelLayout, regions: Mapping[str, tuple[torch.Tensor, ...]]
) -> tuple[dict[str, list[KeptPart]], str | None]:
    """Every owned tensor's kept parts (manifest piece or None for the whole, and the region that
    holds it; one per target, so a tied embedding and lm_head are both verified), or why this
    rank cannot apply deltas: the first tensor whose target keeps another part than its manifest says."""
    out: dict[str, list[KeptPart]] = {}
    for name, targets in layout.targets.items():
        owned = manifest.tensors[name]
        want = _kept_pieces(owned.pieces, owned.shape)
        if len(want) > 1:
            return {}, f"{name}: this rank keeps {len(want)} pieces of it, not one region per target"
        parts: list[KeptPart] = []
        for target, region in zip(targets, regions[name], strict=True):
            if _kept_pieces(target.pieces, target.shape) != want:
                return {}, f"{name} -> {target.param_name}: it keeps another part than the manifest's"
            parts.append((want[0] if want else None, region))
        out[name] = parts
    return out, None


def refuse_unproven(worker_id: str, names: Iterable[str], proven: set[str]) -> None:
    """DELTA_BASE_MISMATCH unless every one of ``names`` was loaded through ``load_weights`` and
    found where its regions say (module docstring); raised before any delta of the call is written."""
    unproven = sorted(set(names) - proven)
    if unproven:
        raise _unproven(worker_id, unproven)


def _unproven(worker_id: str, unproven: list[str]) -> WeightwireError:
    return delta_error(
        DELTA_BASE_MISMATCH,
        f"{worker_id}: {len(unproven)} tensor(s), first {unproven[0]!r}, were not loaded through SGLang's "
        "load_weights and checked since the engine started or released its weights, so no region of them is "
        "known to hold the base; send the update whole",
        tensor=unproven[0],
        unproven_count=str(len(unproven)),
    )


def apply_to_parts(parts: Sequence[KeptPart], delta: Delta, full_shape: tuple[int, ...]) -> None:
    """Write ``delta`` (checked against ``full_shape``) into every kept part, in place: all of it
    into a whole tensor's region, the changes inside the piece into a piece's."""
    for piece, region in parts:
        if piece is None:
            apply_delta(region, delta, checked=True)
        else:
            apply_to_piece(region, delta, full_shape, *piece)
