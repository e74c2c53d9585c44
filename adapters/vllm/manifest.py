"""The checkpoint tensors one vLLM worker consumes, read from its real model object.

A vLLM model's parameters are not checkpoint tensors. q/k/v projections live fused in one
``qkv_proj`` layer and gate/up in ``gate_up_proj``, each holding this rank's TP slice; layers
outside the pipeline stage are ``PPMissingLayer`` (no parameters); ``embed_tokens`` exists on the
first stage (and on the last one of a model with tied embeddings, where ``lm_head`` shares its
weight), ``norm`` and ``lm_head`` on the last. And after loading, vLLM may repack a weight into a
kernel layout: on CPU every unquantized Linear weight becomes a ``[0]``-shaped placeholder next to a
packed copy, so ``named_parameters()`` shows no checkpoint shape at all.

So the layout is built from what does not change: the module tree (checkpoint names, with fused
layers expanded through the model's ``packed_modules_mapping``), each parallel layer's own record
of its unsharded sizes (total heads, head size, output sizes, input size, original vocabulary), and
the model-format shapes vLLM records for its layerwise reload before any repacking (checked against
those sizes, so a layout this module does not understand fails at engine start instead of
publishing a wrong manifest). Quantized layers are refused for the same reason, except
block-quantised FP8 linear layers (the DeepSeek / Kimi checkpoint layout, ``fp8.py``): their
``weight`` (float8_e4m3fn) and ``weight_scale_inv`` (float32 per block) are checkpoint tensors of
their own, sliced on whole blocks, and the layer always loads through vLLM's reload
(``reload_only``); attention layers' KV-cache scales are left out.

Mixture-of-experts layers (``RoutedExperts``, inside a ``MoERunner`` named ``...mlp.experts``)
hold every local expert's gate and up projections stacked in ``w13_weight``
``[local_experts, 2 * I / moe_tp, hidden]`` and the down projections in ``w2_weight``
``[local_experts, hidden, I / moe_tp]``. Each is expanded to the checkpoint's per-expert names
(``mlp.experts.{e}.{gate,up,down}_proj.weight``, with the checkpoint module names the layer
records for its loader), for the experts of this worker's expert-parallel rank only
(``expert_map_manager``), each with this worker's MoE-TP slice: rows of gate/up, columns of down.
Block-FP8 experts (``Fp8MoEMethod`` with ``weight_block_size``, ``fp8.expert_block_size``) add
``w13_weight_scale_inv`` / ``w2_weight_scale_inv``, expanded the same way to each expert's
``weight_scale_inv`` (the blocks of its weight's slice, which must keep whole blocks); such a layer
is ``reload_only``. Layouts vLLM's loader would transform (padded sizes, transposed or fused
checkpoints, biases, fused shared or redundant experts, other quantized experts) are refused.

Each checkpoint name maps to the vLLM layer (module) whose parameters it fills. vLLM's layerwise
reload processes a layer once every tensor feeding it has arrived, so the adapter uses
``ModelLayout.names_by_layer`` to know when a layer is complete, and ``tied_layers`` to know which
other layers read a reloaded parameter too (a tied ``lm_head``, whose CPU kernel packs its own copy
of the embedding at start-up).

Called by ``weightwire.adapters.vllm.adapter`` inside each vLLM worker process.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from weightwire.adapters.layout_rules import (
    CheckpointTarget,
    ManifestError,
    StageLayout,
    check_expert_param,
    check_local,
    expert_leaf,
    expert_shards,
    linear_feeds,
    read_stage,
    refuse_layouts,
)
from weightwire.adapters.vllm import fp8
from weightwire.core import dtypes, fp8_geometry, layer_geometry
from weightwire.core.layer_geometry import GeometryError
from weightwire.core.manifest import TensorPiece

# What ``check_local`` compares: the shape vLLM's weight loaders fill, recorded before repacking.
_HELD = "model-format shape"


@dataclasses.dataclass(frozen=True)
class LoadTarget(CheckpointTarget):
    """One checkpoint tensor a worker consumes, and the vLLM layer and parameter it fills."""

    layer_name: str = dataclasses.field(kw_only=True)
    """The vLLM module whose parameter it fills, e.g. ``model.layers.3.self_attn.qkv_proj``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelLayout(StageLayout):
    """What a worker's model consumes, by checkpoint name, and its pipeline stage's layers."""

    targets: Mapping[str, LoadTarget]
    names_by_layer: Mapping[str, frozenset[str]]
    """vLLM layer name -> every checkpoint name that feeds it (a fused layer has several)."""
    tied_layers: Mapping[str, tuple[str, ...]]
    """vLLM layer name -> the other layers that share one of its parameters (a tied ``lm_head``).
    vLLM's reload re-processes only the layer it loads; these must be re-processed after it."""
    reload_only: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """vLLM layer name -> why it must always load through vLLM's reload, never by a direct copy (a
    quantized layer: its ``process_weights_after_loading`` may repack what was pushed)."""


def model_layout(model: torch.nn.Module, hf_config: Any) -> ModelLayout:  # noqa: C901 - known; split when next changed
    """Every checkpoint tensor this worker's ``model`` consumes (see the module docstring)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:  # a release without it: its MoE layers are refused below, as before
        RoutedExperts = ()  # type: ignore[assignment,misc]

    stage = read_stage(
        model, hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    )
    tied = stage.tie_word_embeddings
    packed = _packed_modules(model)
    model_format = _model_format()

    targets: dict[str, LoadTarget] = {}
    owner_of_param: dict[int, str] = {}
    tied_layers: dict[str, list[str]] = {}
    reload_only: dict[str, str] = {}

    def add(
        name: str,
        layer_name: str,
        leaf: str,
        shard_id: str | int | None,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        pieces: tuple[TensorPiece, ...] = (),
    ) -> None:
        try:
            dtypes.from_torch(dtype)
        except ValueError as e:
            raise ManifestError(f"{layer_name}.{leaf}: {e}") from None
        if name in targets:
            raise ManifestError(
                f"checkpoint name {name} would feed both {targets[name].param_name} and {layer_name}.{leaf}"
            )
        targets[name] = LoadTarget(
            name, _join(layer_name, leaf), shard_id, dtype, shape, pieces, layer_name=layer_name
        )

    def add_feeds(
        layer_name: str,
        leaf: str,
        where: str,
        local: tuple[int, ...],
        dtype: torch.dtype,
        names: tuple[str, ...],
        rule: Callable[..., layer_geometry.LayerFeeds],
        *args: Any,
    ) -> None:
        try:
            feeds = rule(*args)
        except GeometryError as e:
            raise ManifestError(f"{where}: {e}") from None
        check_local(where, local, feeds.local, held=_HELD)
        for feed in feeds.feeds:
            add(names[feed.component], layer_name, leaf, feed.shard_id, dtype, feed.shape, feed.pieces)

    for layer_name, module in model.named_modules():
        if getattr(module, "_fse_fuse_gate", False):
            # A MoERunner holding both the router and the shared-expert gate concatenates their
            # weights once, on its first forward pass, and reads only that copy; vLLM's reload
            # never refreshes it, so a pushed gate would be ignored.
            raise ManifestError(
                f"MoE layer {layer_name} fuses its router and shared-expert gates into a copy vLLM "
                "does not refresh on reload; not supported"
            )
        own = [(leaf, p) for leaf, p in module._parameters.items() if p is not None]
        if not own:
            continue
        for leaf, param in own:
            owner = owner_of_param.get(id(param))
            if owner is not None:
                # A tied parameter (lm_head sharing embed_tokens' weight): its first owner loads it.
                if layer_name not in tied_layers.setdefault(owner, []):
                    tied_layers[owner].append(layer_name)
                continue
            owner_of_param[id(param)] = layer_name
            where = _join(layer_name, leaf)
            if RoutedExperts and isinstance(module, RoutedExperts):
                if not type(module.quant_method).__name__.startswith("Unquantized"):
                    reload_only[layer_name] = (
                        f"quantized ({type(module.quant_method).__name__}): its process_weights_after_loading "
                        "may repack what was pushed"
                    )
                for t in _expert_targets(
                    module, layer_name, leaf, model_format(module, leaf, param)[0], param
                ):
                    add(t.name, layer_name, leaf, t.shard_id, t.dtype, t.shape, t.pieces)
                continue
            if fp8.is_kv_cache_scale(module, leaf):
                continue
            block = fp8.block_size(where, module) if isinstance(module, LinearBase) else None
            if isinstance(module, (LinearBase, VocabParallelEmbedding)) and leaf not in fp8.leaves(block):
                raise ManifestError(
                    f"{where}: parallel layer with parameter {leaf!r} (quantization scales?); weightwire's "
                    "vLLM adapter handles unquantized and block-quantised FP8 models"
                )
            if block is not None:
                reload_only[layer_name] = (
                    f"quantized ({type(module.quant_method).__name__}): its process_weights_after_loading "
                    "may repack what was pushed"
                )
            local, dtype = model_format(module, leaf, param)

            linear = (
                linear_feeds(module, layer_name, leaf, packed, _tp_ranks)
                if isinstance(module, LinearBase)
                else None
            )
            if linear is not None and block is not None:
                add_feeds(
                    layer_name,
                    leaf,
                    where,
                    local,
                    dtype,
                    linear.names,
                    functools.partial(fp8_geometry.layer_feeds, where, linear.rule, block=block),
                    *linear.args,
                )
            elif linear is not None:
                add_feeds(layer_name, leaf, where, local, dtype, linear.names, linear.rule, *linear.args)
            elif isinstance(module, LinearBase):
                raise ManifestError(f"{where}: unsupported parallel layer {type(module).__name__}")
            elif isinstance(module, VocabParallelEmbedding):
                if not isinstance(module.quant_method, UnquantizedEmbeddingMethod):
                    raise ManifestError(
                        f"{where}: embedding is quantized; only unquantized models are supported"
                    )
                if leaf != "weight":
                    raise ManifestError(f"{where}: embedding parameter {leaf!r} is not supported")
                check_local(
                    where, local, (module.num_embeddings_per_partition, module.embedding_dim), held=_HELD
                )
                if module.num_embeddings_padded - module.org_vocab_size_padded:
                    raise ManifestError(f"{where}: embeddings with added (LoRA) vocabulary are not supported")
                if tied and isinstance(module, ParallelLMHead):
                    raise ManifestError(
                        f"{where}: the config ties word embeddings but lm_head has a weight of its own"
                    )
                add_feeds(layer_name, leaf, where, local, dtype, (where,), layer_geometry.vocab, module, leaf)
            else:
                loader = getattr(param, "weight_loader", default_weight_loader)
                if (
                    hasattr(param, "output_dim")
                    or hasattr(param, "input_dim")
                    or loader is not default_weight_loader
                ):
                    # A layer that shards, stacks (mixture-of-experts) or converts what it loads.
                    raise ManifestError(
                        f"{where}: parameter of {type(module).__name__} with a weight loader of its own, a layer "
                        "whose checkpoint names and full shapes this adapter cannot derive"
                    )
                add(where, layer_name, leaf, None, dtype, local)

    by_layer: dict[str, set[str]] = {}
    for t in targets.values():
        by_layer.setdefault(t.layer_name, set()).add(t.name)
    return ModelLayout(
        targets=targets,
        names_by_layer={k: frozenset(v) for k, v in by_layer.items()},
        tied_layers={k: tuple(v) for k, v in tied_layers.items()},
        reload_only=reload_only,
        **dataclasses.asdict(stage),
    )


def _expert_targets(
    layer: Any, layer_name: str, leaf: str, local: tuple[int, ...], param: torch.Tensor
) -> list[LoadTarget]:
    """The checkpoint tensors one ``RoutedExperts`` parameter (``w13_weight``, ``w2_weight``) is
    filled from: per local expert, gate and up (``w1``, ``w3``) or down (``w2``), each with this
    worker's slice of the intermediate dimension, as ``RoutedExperts.load_weights`` /
    ``weight_loader`` / ``_load_w13`` / ``_load_w2`` (vLLM 0.32) slice them."""
    where = _join(layer_name, leaf)
    block = fp8.expert_block_size(where, layer)
    check_expert_param(where, leaf, type(layer.quant_method).__name__, block)
    config = layer.moe_config
    managers = layer.expert_map_manager
    refuse_layouts(
        where,
        {
            "non-gated experts": not config.is_act_and_mul,
            "expert biases": bool(config.has_bias),
            # tp_shard_with_padding: vLLM 0.32 (0.26 has no such field)
            "padded intermediate or hidden sizes": bool(getattr(config, "tp_shard_with_padding", False))
            or (config.intermediate_size_per_partition_unpadded or config.intermediate_size_per_partition)
            != config.intermediate_size_per_partition
            or (config.hidden_dim_unpadded or config.hidden_dim) != config.hidden_dim,
            "redundant experts (EPLB)": config.num_experts != config.num_logical_experts,
            "fused shared experts": int(getattr(managers, "num_fused_shared_experts", 0) or 0) > 0,
            "transposed fused checkpoints": bool(getattr(layer, "is_fused_checkpoint_transposed", False)),
            "transposed expert weights": bool(getattr(param, "is_transposed", False)),
            "a missing up projection name": layer.ckpt_up_proj_name is None,
        },
    )
    parallel = config.moe_parallel_config
    tp_rank, tp_size = int(parallel.tp_rank), int(parallel.tp_size)
    per_rank, hidden = int(config.intermediate_size_per_partition), int(config.hidden_dim)
    full = per_rank * tp_size
    experts = [int(e) for e in managers.get_local_expert_ids()]
    if [int(managers.map_global_to_local(e)) for e in experts] != list(range(len(experts))):
        raise ManifestError(f"{where}: local experts {experts} are not stored in their order")
    shards = expert_shards(
        where,
        leaf,
        local,
        experts=len(experts),
        hidden=hidden,
        per_rank=per_rank,
        rows=(tp_rank * per_rank, per_rank, full),
        names=(layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name),
        block=block,
    )
    ckpt_leaf = expert_leaf(leaf)
    # The loader qualifies a checkpoint name with the runner's prefix: layer.layer_name.
    return [
        LoadTarget(
            f"{layer.layer_name}.{e}.{ckpt}.{ckpt_leaf}",
            where,
            sid,
            param.dtype,
            shape,
            pieces,
            layer_name=layer_name,
        )
        for e in experts
        for sid, ckpt, shape, pieces in shards
    ]


def _model_format() -> Any:
    """``of(module, leaf, param)``: the parameter's model-format (pre-repacking) local shape and the
    dtype its weight loader takes (what a checkpoint holds for it).

    vLLM records a meta copy of every parameter right after building the model, before loading and
    kernel repacking (``record_metadata_for_reloading``), for its layerwise reload; that is what its
    weight loaders fill. ``bias`` is not recorded there (vLLM never moves it to meta): its shape is
    the live parameter's, and a linear layer's bias takes the layer's ``params_dtype`` (the CPU
    backend's small GEMMs turn a bf16 bias to float32 after loading; its loader still takes the
    model's dtype).
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    def of(module: torch.nn.Module, leaf: str, param: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        recorded = get_layerwise_info(module).restore_metadata[0].get(leaf)
        if recorded is not None:
            return tuple(recorded.shape), cast(torch.dtype, recorded.dtype)
        if leaf == "bias" and isinstance(module, LinearBase):
            return tuple(param.shape), cast(torch.dtype, module.params_dtype)
        return tuple(param.shape), param.dtype

    return of


def _packed_modules(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    declared = getattr(model, "packed_modules_mapping", None) or {}
    if not isinstance(declared, Mapping):
        raise ManifestError(f"{type(model).__name__}.packed_modules_mapping is not a mapping")
    return {str(k): tuple(v) for k, v in declared.items()}


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _tp_ranks(layer: Any, where: str) -> tuple[int, int]:
    """The tensor-parallel rank a vLLM linear layer's weight loader slices by (0 when the layer
    was built with ``disable_tp``), for its k/v heads too."""
    rank = getattr(layer, "tp_rank", None)
    if rank is None:
        raise ManifestError(
            f"{where}: {type(layer).__name__} records no tensor-parallel rank; cannot state its slice"
        )
    return int(rank), int(rank)
