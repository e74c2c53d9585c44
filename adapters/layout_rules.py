"""What reading a rank's checkpoint layout from an engine's model shares across engines.

``weightwire.adapters.sglang.manifest`` and ``weightwire.adapters.vllm.manifest`` each walk their
engine's module tree (its own layer classes, weight loaders and repacking); what they decide the
same way lives here: the pipeline stage a model holds, the checkpoint names of a fused layer, the
check of a parameter's local shape against the layer's recorded sizes, and the per-expert pieces
of a mixture-of-experts parameter. Pure torch: no engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from weightwire.core import fp8_geometry, layer_geometry
from weightwire.core.layer_geometry import GeometryError
from weightwire.core.manifest import TensorPiece

# Parallel linear layers by class name, most specific first (QKV and merged layers are column-
# parallel layers too): SGLang and vLLM name theirs alike and record the same sizes, so one table
# says which ``layer_geometry`` rule states a layer's slices.
_LINEAR_RULES: tuple[tuple[str, Callable[..., layer_geometry.LayerFeeds]], ...] = (
    ("QKVParallelLinear", layer_geometry.qkv),
    ("MergedColumnParallelLinear", layer_geometry.merged_column),
    ("ColumnParallelLinear", layer_geometry.column),
    ("RowParallelLinear", layer_geometry.row),
    ("ReplicatedLinear", layer_geometry.replicated),
)
_FUSED_RULES = (layer_geometry.qkv, layer_geometry.merged_column)

# A fused expert parameter's checkpoint tensors: (shard id, checkpoint module name, full shape, pieces).
ExpertShard = tuple[str, str, tuple[int, int], tuple[TensorPiece, ...]]


# The fused expert parameters a manifest states, unquantized (False) and block-FP8 (True).
EXPERT_LEAVES: Mapping[bool, tuple[str, ...]] = {
    False: ("w13_weight", "w2_weight"),
    True: ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"),
}


class ManifestError(ValueError):
    """The model holds a parameter whose checkpoint name or full shape cannot be derived safely."""


@dataclasses.dataclass(frozen=True)
class CheckpointTarget:
    """One checkpoint tensor a rank consumes, and the engine parameter it fills."""

    name: str
    """Checkpoint (Hugging Face) name, e.g. ``model.layers.3.self_attn.k_proj.weight``."""
    param_name: str
    """The engine parameter it fills, e.g. ``model.layers.3.self_attn.qkv_proj.weight``."""
    shard_id: str | int | None
    """The shard id the engine's weight loader is called with (``"k"``, ``1``, ``"w1"``), None if unfused."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    """Full checkpoint shape (not this rank's slice)."""
    pieces: tuple[TensorPiece, ...] = ()
    """What this rank keeps of the checkpoint tensor (``layer_geometry``; empty: all of it)."""


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """The pipeline stage a rank's model holds: layers ``[layer_start, layer_end)`` of ``num_layers``."""

    layer_start: int
    layer_end: int
    num_layers: int
    tie_word_embeddings: bool


def read_stage(model: torch.nn.Module, config: Any) -> StageLayout:
    """The stage from the model's ``start_layer`` / ``end_layer`` (what SGLang's and vLLM's
    ``make_layers`` record on the inner model; the whole model when absent) and the text config."""
    num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    inner = getattr(model, "model", model)
    return StageLayout(
        layer_start=int(getattr(inner, "start_layer", 0)),
        layer_end=int(getattr(inner, "end_layer", num_layers)),
        num_layers=num_layers,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def fused_names(
    packed: Mapping[str, Sequence[str]], attr: str, where: str, *, expected: int
) -> tuple[str, ...]:
    """The checkpoint module names fused layer ``attr`` packs, in shard order (``expected`` of them)."""
    names = packed.get(attr)
    if names is None:
        raise ManifestError(
            f"{where}: fused layer {attr!r} has no entry in the model's packed_modules_mapping, so the "
            "checkpoint names it consumes are unknown"
        )
    if len(names) != expected:
        raise ManifestError(f"{where}: {attr!r} packs {expected} outputs but the mapping lists {list(names)}")
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class LinearFeeds:
    """How one parameter of a parallel linear layer is fed: the checkpoint names (a fused layer's
    in shard order) and the ``layer_geometry`` rule, with its arguments, that states the slices."""

    names: tuple[str, ...]
    rule: Callable[..., layer_geometry.LayerFeeds]
    args: tuple[Any, ...]


def linear_feeds(
    module: Any,
    layer_name: str,
    leaf: str,
    packed: Mapping[str, Sequence[str]],
    tp_ranks: Callable[[Any, str], tuple[int, int]],
) -> LinearFeeds | None:
    """The feeds of parameter ``leaf`` of parallel linear layer ``layer_name``; None when its class
    is none of the table's (the caller refuses it). ``tp_ranks(module, where)``: the (tensor, k/v)
    ranks its weight loader slices by, asked only of a layer that is sharded."""
    where = f"{layer_name}.{leaf}" if layer_name else leaf
    parent, _, attr = layer_name.rpartition(".")
    classes = {c.__name__ for c in type(module).__mro__}
    rule = next((r for name, r in _LINEAR_RULES if name in classes), None)
    if rule is None:
        return None
    if rule in _FUSED_RULES:
        expected = 3 if rule is layer_geometry.qkv else len(module.output_sizes)
        prefix = f"{parent}." if parent else ""
        names = tuple(f"{prefix}{n}.{leaf}" for n in fused_names(packed, attr, where, expected=expected))
    elif attr in packed:
        raise ManifestError(f"{where}: {attr} is listed as fused but is a {type(module).__name__}")
    else:
        names = (where,)
    if rule is layer_geometry.replicated:
        return LinearFeeds(names, rule, (module, leaf))
    tp_rank, kv_tp_rank = tp_ranks(module, where)
    args = (module, leaf, tp_rank, kv_tp_rank) if rule is layer_geometry.qkv else (module, leaf, tp_rank)
    return LinearFeeds(names, rule, args)


def check_local(
    where: str, local: tuple[int, ...], expected: tuple[int, ...], *, held: str = "shape"
) -> None:
    """Refuse a parameter whose local ``held`` shape is not what the layer's recorded sizes imply."""
    if local != expected:
        raise ManifestError(
            f"{where}: this rank holds {held} {local} but the layer's sizes imply {expected}; "
            "refusing to guess the checkpoint layout"
        )


def check_expert_param(where: str, leaf: str, method: str, block: tuple[int, int] | None = None) -> None:
    """Refuse an expert parameter other than ``w13_weight`` / ``w2_weight`` (and, for experts in
    block-quantised FP8, their ``_scale_inv``), and experts quantized otherwise than unquantized
    or block FP8 (``method``: the quant method's class name; ``block``: the FP8 block size the
    engine adapter read from it, None when unquantized)."""
    if block is None and method != "UnquantizedFusedMoEMethod":
        raise ManifestError(
            f"{where}: experts are quantized ({method}); only unquantized and block-quantised FP8 experts "
            "are supported"
        )
    if leaf not in EXPERT_LEAVES[block is not None]:
        raise ManifestError(f"{where}: expert parameter {leaf!r} (bias or other scale) is not supported")


def refuse_layouts(where: str, refusals: Mapping[str, bool]) -> None:
    """Refuse the first layout in ``refusals`` (what it is -> whether the layer has it)."""
    for what, found in refusals.items():
        if found:
            raise ManifestError(f"{where}: {what} are not supported")


def expert_shards(
    where: str,
    leaf: str,
    local: tuple[int, ...],
    *,
    experts: int,
    hidden: int,
    per_rank: int,
    rows: tuple[int, int, int],
    names: tuple[str, str, str],
    block: tuple[int, int] | None = None,
) -> tuple[ExpertShard, ...]:
    """The checkpoint tensors of one expert in fused parameter ``leaf`` (``w13_weight``: gate
    ``w1`` and up ``w3``; ``w2_weight``: down ``w2``), after checking the parameter's local shape
    ``[experts, 2 * per_rank, hidden]`` / ``[experts, hidden, per_rank]``. ``rows``: ``(start,
    kept, full)``, this rank keeps intermediate rows ``[start, start + kept)`` of ``full`` (rows of
    gate/up, columns of down); ``names``: the checkpoint module names of gate, up and down.

    Block-quantised FP8 experts (``block``): the weight's slice must keep whole blocks (a split
    block is refused, naming ``where``), and ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``
    (local ``[experts, 2 * per_rank / bn, hidden / bk]`` / ``[experts, hidden / bn, per_rank / bk]``,
    rounded up) are fed from each expert's ``weight_scale_inv``, the blocks of its weight's slice."""
    start, kept, full = rows
    base = leaf.removesuffix("_scale_inv")
    if base == "w13_weight":
        gate_up = () if kept == full else (TensorPiece(0, start, kept),)
        weights: tuple[ExpertShard, ...] = (
            ("w1", names[0], (full, hidden), gate_up),
            ("w3", names[1], (full, hidden), gate_up),
        )
        local_weight = (experts, 2 * per_rank, hidden)
    else:
        down = () if kept == full else (TensorPiece(1, start, kept),)
        weights = (("w2", names[2], (hidden, full), down),)
        local_weight = (experts, hidden, per_rank)
    if block is None:
        check_local(where, local, local_weight)
        return weights
    try:
        for _, _, shape, pieces in weights:
            fp8_geometry.check_block_aligned(where, shape, pieces, block)
        if base == "w13_weight" and per_rank % block[0]:
            # Gate and up stack in one parameter: gate's last block would share its scale with up's first.
            raise GeometryError(
                f"{where}: {per_rank} gate/up rows per rank do not fill whole {block[0]}-row FP8 blocks"
            )
        if leaf == base:
            check_local(where, local, local_weight)
            return weights
        b_rows, b_cols = (
            fp8_geometry.blocks(local_weight[1], block[0]),
            fp8_geometry.blocks(local_weight[2], block[1]),
        )
        check_local(where, local, (experts, b_rows, b_cols))
        return tuple(
            (
                sid,
                ckpt,
                fp8_geometry.scale_shape(shape, block),
                fp8_geometry.scale_pieces(where, shape, pieces, block),
            )
            for sid, ckpt, shape, pieces in weights
        )
    except GeometryError as e:
        raise ManifestError(str(e)) from None


def expert_leaf(leaf: str) -> str:
    """The checkpoint leaf an expert parameter is filled from: ``weight_scale_inv`` for
    ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``, else ``weight``."""
    return fp8_geometry.SCALE_LEAF if leaf.endswith("_scale_inv") else fp8_geometry.WEIGHT_LEAF
