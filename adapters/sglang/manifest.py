"""The shard manifest of one SGLang rank, read from its real model object.

SGLang's parameters are not checkpoint tensors: q/k/v projections live fused in one
``qkv_proj`` parameter, gate/up in ``gate_up_proj``, each holding only this rank's TP slice; layers
outside the pipeline stage are ``PPMissingLayer`` (no parameters); ``embed_tokens`` exists on the
first stage only, ``norm`` and ``lm_head`` on the last. This module turns the parameters that this
rank really holds into the checkpoint (Hugging Face) names it consumes, each with the full
checkpoint dtype and shape and the parameter/shard that SGLang's ``load_weights`` fills from it.

Full shapes come from the parallel layers' own records of their unsharded sizes (total heads, head
size, output sizes, input size, original vocabulary size), and each parameter's local shape is
checked against them, so a layout this module does not understand fails here, at engine start,
instead of publishing a wrong manifest. Quantized layers and pre-sharded checkpoints are refused
for the same reason.

Called by ``weightwire.adapters.sglang.adapter`` (inside the scheduler process, or a test process
that built an SGLang model under SGLang's parallel state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from weightwire.core import dtypes, layer_geometry
from weightwire.core.layer_geometry import GeometryError, union_of_pieces
from weightwire.core.manifest import TensorPiece

# Fused parameter -> checkpoint names, for models that declare neither packed_modules_mapping nor
# bitsandbytes_stacked_params_mapping. Same order as SGLang's loaders' stacked_params_mapping.
DEFAULT_PACKED_MODULES: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_QKV_SHARD_IDS = ("q", "k", "v")


class ManifestError(ValueError):
    """The model holds a parameter whose checkpoint name or full shape cannot be derived safely."""


@dataclasses.dataclass(frozen=True)
class LoadTarget:
    """One checkpoint tensor a rank consumes, and where SGLang's ``load_weights`` puts it."""

    name: str
    """Checkpoint (Hugging Face) name, e.g. ``model.layers.3.self_attn.k_proj.weight``."""
    param_name: str
    """The SGLang parameter it fills, e.g. ``model.layers.3.self_attn.qkv_proj.weight``."""
    shard_id: str | int | None
    """The shard id SGLang's weight loader is called with (``"k"``, ``1``), None if unfused."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    """Full checkpoint shape (not this rank's slice)."""
    pieces: tuple[TensorPiece, ...] = ()
    """What this parameter keeps of the checkpoint tensor (``layer_geometry``; empty: all of it)."""


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """What a rank's model consumes: checkpoint name -> the parameter(s) it fills, and its layers."""

    targets: Mapping[str, tuple[LoadTarget, ...]]
    layer_start: int
    layer_end: int
    num_layers: int
    tie_word_embeddings: bool

    def checkpoint_shape(self, name: str) -> tuple[int, ...]:
        return self.targets[name][0].shape

    def kept_pieces(self, name: str) -> tuple[TensorPiece, ...]:
        """What this rank keeps of checkpoint tensor ``name``: the union over the parameters it
        fills (a tied embedding and lm_head keep the same rows); empty when one keeps it whole."""
        return union_of_pieces(t.pieces for t in self.targets[name])


def packed_modules_mapping(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Fused module name -> the checkpoint module names it packs, in shard order.

    Taken from the model's ``packed_modules_mapping`` when it declares one, else from its
    ``bitsandbytes_stacked_params_mapping`` (``{"q_proj": ("qkv_proj", 0), ...}``, the mapping
    SGLang's Qwen2 and Llama classes carry), else ``DEFAULT_PACKED_MODULES``.
    """
    declared = getattr(model, "packed_modules_mapping", None)
    if isinstance(declared, Mapping) and declared:
        return {str(k): tuple(v) for k, v in declared.items()}
    stacked = getattr(model, "bitsandbytes_stacked_params_mapping", None)
    if isinstance(stacked, Mapping) and stacked:
        grouped: dict[str, list[tuple[int, str]]] = {}
        for shard_name, (fused_name, index) in stacked.items():
            grouped.setdefault(fused_name.strip("."), []).append((int(index), shard_name.strip(".")))
        return {fused: tuple(name for _, name in sorted(items)) for fused, items in grouped.items()}
    return dict(DEFAULT_PACKED_MODULES)


def model_layout(model: torch.nn.Module, hf_config: Any) -> ModelLayout:  # noqa: C901 - known; split when next changed
    """Every checkpoint tensor this rank's ``model`` consumes (see module docstring)."""
    from sglang.srt.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod, UnquantizedLinearMethod
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = packed_modules_mapping(model)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    num_layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    inner = getattr(model, "model", model)
    layer_start = int(getattr(inner, "start_layer", 0))
    layer_end = int(getattr(inner, "end_layer", num_layers))

    targets: dict[str, list[LoadTarget]] = {}

    def add(
        name: str,
        param_name: str,
        shard_id: str | int | None,
        param: torch.Tensor,
        shape: tuple[int, ...],
        pieces: tuple[TensorPiece, ...] = (),
    ) -> None:
        try:
            dtypes.from_torch(param.dtype)
        except ValueError as e:
            raise ManifestError(f"{param_name}: {e}") from None
        targets.setdefault(name, []).append(
            LoadTarget(name, param_name, shard_id, param.dtype, shape, pieces)
        )

    def add_feeds(
        param_name: str, param: torch.Tensor, names: tuple[str, ...], feeds: layer_geometry.LayerFeeds
    ) -> None:
        _check_local(param_name, local, feeds.local)
        for feed in feeds.feeds:
            add(names[feed.component], param_name, feed.shard_id, param, feed.shape, feed.pieces)

    for param_name, param in model.named_parameters():
        module_name, _, leaf = param_name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        attr = module_name.rpartition(".")[2]
        parent = module_name.rpartition(".")[0]
        local = tuple(param.shape)

        if leaf not in ("weight", "bias"):
            if isinstance(module, (LinearBase, VocabParallelEmbedding)):
                raise ManifestError(
                    f"{param_name}: parallel layers with parameter {leaf!r} (quantization scales?) are not "
                    "supported; weightwire's SGLang adapter handles unquantized models"
                )
        if isinstance(module, LinearBase) and not isinstance(module.quant_method, UnquantizedLinearMethod):
            raise ManifestError(
                f"{param_name}: layer is quantized ({type(module.quant_method).__name__}); weightwire's "
                "SGLang adapter handles unquantized models only"
            )
        if getattr(module, "use_presharded_weights", False):
            raise ManifestError(f"{param_name}: pre-sharded checkpoints are not supported")

        if isinstance(module, QKVParallelLinear):
            names = _fused_names(packed, attr, param_name, expected=3)
            tp_rank, kv_tp_rank = _tp_ranks(module)
            add_feeds(
                param_name,
                param,
                tuple(_join(parent, n, leaf) for n in names),
                _geometry(param_name, layer_geometry.qkv, module, leaf, tp_rank, kv_tp_rank),
            )
        elif isinstance(module, MergedColumnParallelLinear):
            names = _fused_names(packed, attr, param_name, expected=len(module.output_sizes))
            add_feeds(
                param_name,
                param,
                tuple(_join(parent, n, leaf) for n in names),
                _geometry(param_name, layer_geometry.merged_column, module, leaf, _tp_ranks(module)[0]),
            )
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
            if attr in packed:
                raise ManifestError(
                    f"{param_name}: {attr} is listed as fused but is a {type(module).__name__}"
                )
            if isinstance(module, ColumnParallelLinear):
                feeds = _geometry(param_name, layer_geometry.column, module, leaf, _tp_ranks(module)[0])
            elif isinstance(module, RowParallelLinear):
                feeds = _geometry(param_name, layer_geometry.row, module, leaf, _tp_ranks(module)[0])
            else:
                feeds = _geometry(param_name, layer_geometry.replicated, module, leaf)
            add_feeds(param_name, param, (param_name,), feeds)
        elif isinstance(module, LinearBase):
            raise ManifestError(f"{param_name}: unsupported parallel layer {type(module).__name__}")
        elif isinstance(module, VocabParallelEmbedding):
            if not isinstance(module.quant_method, UnquantizedEmbeddingMethod):
                raise ManifestError(
                    f"{param_name}: embedding is quantized; only unquantized models are supported"
                )
            if local[-1:] != (module.embedding_dim,) or local[0] != module.num_embeddings_per_partition:
                raise ManifestError(
                    f"{param_name}: holds {local}, expected ({module.num_embeddings_per_partition}, "
                    f"{module.embedding_dim}) for vocabulary {module.org_vocab_size}"
                )
            feed = _geometry(param_name, layer_geometry.vocab, module, leaf).feeds[0]
            name = param_name
            if tied and param_name.startswith("lm_head."):
                # A tied model with its own lm_head parameter (the last pipeline stage of a tied
                # Qwen2): SGLang fills it from the embedding; lm_head.weight is not a checkpoint name.
                name = "model.embed_tokens." + leaf
            add(name, param_name, None, param, feed.shape, feed.pieces)
        else:
            if hasattr(param, "output_dim") or hasattr(param, "input_dim"):
                raise ManifestError(
                    f"{param_name}: sharded parameter of {type(module).__name__}, a layer whose full "
                    "checkpoint shape this adapter cannot derive"
                )
            add(param_name, param_name, None, param, local)

    frozen: dict[str, tuple[LoadTarget, ...]] = {}
    for name, found in targets.items():
        if len({(t.dtype, t.shape) for t in found}) != 1:
            raise ManifestError(f"{name} feeds parameters of different dtype/shape: {found}")
        frozen[name] = tuple(found)
    return ModelLayout(frozen, layer_start, layer_end, num_layers, tied)


def _fused_names(
    packed: Mapping[str, tuple[str, ...]], attr: str, param_name: str, *, expected: int
) -> tuple[str, ...]:
    names = packed.get(attr)
    if names is None:
        raise ManifestError(
            f"{param_name}: fused layer {attr!r} has no entry in the model's packed_modules_mapping, so the "
            "checkpoint names it consumes are unknown"
        )
    if len(names) != expected:
        raise ManifestError(
            f"{param_name}: {attr!r} packs {expected} outputs but the mapping lists {list(names)}"
        )
    return names


def _join(parent: str, module: str, leaf: str) -> str:
    return f"{parent}.{module}.{leaf}" if parent else f"{module}.{leaf}"


def _geometry(
    param_name: str, rule: Callable[..., layer_geometry.LayerFeeds], *args: Any
) -> layer_geometry.LayerFeeds:
    try:
        return rule(*args)
    except GeometryError as e:
        raise ManifestError(f"{param_name}: {e}") from None


def _tp_ranks(layer: Any) -> tuple[int, int]:
    """(tensor-parallel rank, k/v rank) a linear layer's weight loader slices by: SGLang 0.5.23 keeps
    the layer's groups (``tp_group``, ``kv_tp_group``; None: unsharded), 0.5.17 its ``tp_rank``."""
    if hasattr(layer, "tp_group"):

        def rank(group: Any) -> int:
            return 0 if group is None else int(group.rank_in_group)

        tp = rank(layer.tp_group)
        return tp, rank(layer.kv_tp_group) if hasattr(layer, "kv_tp_group") else tp
    if hasattr(layer, "tp_rank"):
        return int(layer.tp_rank), int(layer.tp_rank)
    raise ManifestError(f"{type(layer).__name__} records no tensor-parallel rank; cannot state its slice")


def _check_local(param_name: str, local: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if local != expected:
        raise ManifestError(
            f"{param_name}: this rank holds shape {local} but the layer's sizes imply {expected}; "
            "refusing to guess the checkpoint layout"
        )
