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
instead of publishing a wrong manifest. Pre-sharded checkpoints and quantized layers are refused
for the same reason, except block-quantised FP8 linear layers (the DeepSeek / Kimi checkpoint
layout): their ``weight`` (float8_e4m3fn) and ``weight_scale_inv`` (float32 per block) are two
checkpoint tensors of their own, sliced on whole blocks (``core.fp8_geometry``).

Mixture-of-experts layers (``FusedMoE``) hold every local expert's gate and up projections stacked
in one ``w13_weight`` ``[local_experts, 2 * I / moe_tp, hidden]`` and the down projections in
``w2_weight`` ``[local_experts, hidden, I / moe_tp]``. Each is expanded to the checkpoint's
per-expert names (``mlp.experts.{e}.gate_proj.weight`` and so on, as the model's loader names them
through ``FusedMoE.make_expert_params_mapping``) for the experts of this rank's expert-parallel
rank only, each with this rank's MoE-TP slice: rows of gate/up, columns of down. Block-FP8
experts (``Fp8MoEMethod`` with ``weight_block_size``) add ``w13_weight_scale_inv`` /
``w2_weight_scale_inv``, expanded the same way to each expert's ``weight_scale_inv`` (the blocks of
its weight's slice, which must keep whole blocks). Layouts the loader would transform
(Triton-kernel transposes, up-before-gate, padded intermediate sizes, redundant or fused shared
experts, biases) and other quantized experts are refused.

Called by ``weightwire.adapters.sglang.adapter`` (inside the scheduler process, or a test process
that built an SGLang model under SGLang's parallel state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

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
from weightwire.core import dtypes, fp8_geometry, layer_geometry
from weightwire.core.layer_geometry import GeometryError, union_of_pieces
from weightwire.core.manifest import TensorPiece

# Fused parameter -> checkpoint names, for models that declare neither packed_modules_mapping nor
# bitsandbytes_stacked_params_mapping. Same order as SGLang's loaders' stacked_params_mapping.
DEFAULT_PACKED_MODULES: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_QKV_SHARD_IDS = ("q", "k", "v")
_KV_CACHE_SCALES = ("k_scale", "v_scale")


@dataclasses.dataclass(frozen=True)
class LoadTarget(CheckpointTarget):
    """One checkpoint tensor a rank consumes, and where SGLang's ``load_weights`` puts it."""

    expert_id: int | None = None
    """A routed expert's global id (the ``expert_id`` its weight loader is called with), else None."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelLayout(StageLayout):
    """What a rank's model consumes: checkpoint name -> the parameter(s) it fills, and its layers."""

    targets: Mapping[str, tuple[LoadTarget, ...]]

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


# Model class -> the checkpoint module names of an expert's (gate, up, down) projections, as its
# ``load_weights`` passes them to ``FusedMoE.make_expert_params_mapping``. A MoE model not listed
# is refused: its loader may name or split its experts otherwise.
# The fourth entry is the config attribute of the experts' intermediate size: on CPU, SGLang pads
# it to a multiple of its MoE padding times TP (``adjust_config_with_unaligned_cpu_tp``) and keeps
# the checkpoint's size as ``original_<attr>``.
EXPERT_CHECKPOINT_NAMES: Mapping[str, tuple[str, str, str, str]] = {
    "Qwen2MoeForCausalLM": ("gate_proj", "up_proj", "down_proj", "moe_intermediate_size"),
    "Qwen3MoeForCausalLM": ("gate_proj", "up_proj", "down_proj", "moe_intermediate_size"),
    "MixtralForCausalLM": ("w1", "w3", "w2", "intermediate_size"),
}


def model_layout(model: torch.nn.Module, hf_config: Any) -> ModelLayout:  # noqa: C901 - known; split when next changed
    """Every checkpoint tensor this rank's ``model`` consumes (see module docstring)."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    try:
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    except ImportError:  # a release without it has no MoE layer this module could meet
        FusedMoE = ()  # type: ignore[assignment,misc]

    packed = packed_modules_mapping(model)
    stage = read_stage(model, hf_config)
    tied = stage.tie_word_embeddings

    targets: dict[str, list[LoadTarget]] = {}

    def add(
        name: str,
        param_name: str,
        shard_id: str | int | None,
        param: torch.Tensor,
        shape: tuple[int, ...],
        pieces: tuple[TensorPiece, ...] = (),
        expert_id: int | None = None,
    ) -> None:
        try:
            dtypes.from_torch(param.dtype)
        except ValueError as e:
            raise ManifestError(f"{param_name}: {e}") from None
        targets.setdefault(name, []).append(
            LoadTarget(name, param_name, shard_id, param.dtype, shape, pieces, expert_id)
        )

    def add_feeds(
        param_name: str, param: torch.Tensor, names: tuple[str, ...], feeds: layer_geometry.LayerFeeds
    ) -> None:
        check_local(param_name, local, feeds.local)
        for feed in feeds.feeds:
            add(names[feed.component], param_name, feed.shard_id, param, feed.shape, feed.pieces)

    for param_name, param in model.named_parameters():
        module_name, _, leaf = param_name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        local = tuple(param.shape)

        if FusedMoE and isinstance(module, FusedMoE):
            for target in _expert_targets(model, hf_config, module, module_name, leaf, param):
                add(
                    target.name,
                    param_name,
                    target.shard_id,
                    param,
                    target.shape,
                    target.pieces,
                    target.expert_id,
                )
            continue

        if leaf in _KV_CACHE_SCALES and type(module).__name__ == "RadixAttention":
            # KV-cache quantization scales (1.0 unless a checkpoint brought its own): not weights
            # a trainer changes; they stay as loaded at start.
            continue
        block = _fp8_block(param_name, module) if isinstance(module, LinearBase) else None
        if leaf not in ("weight", "bias") and not (block is not None and leaf == fp8_geometry.SCALE_LEAF):
            if isinstance(module, (LinearBase, VocabParallelEmbedding)):
                raise ManifestError(
                    f"{param_name}: parallel layers with parameter {leaf!r} (quantization scales?) are not "
                    "supported; weightwire's SGLang adapter handles unquantized and block-FP8 models"
                )
        if getattr(module, "use_presharded_weights", False):
            raise ManifestError(f"{param_name}: pre-sharded checkpoints are not supported")

        linear = (
            linear_feeds(module, module_name, leaf, packed, _tp_ranks)
            if isinstance(module, LinearBase)
            else None
        )
        if linear is not None:
            add_feeds(
                param_name, param, linear.names, _geometry(param_name, linear.rule, *linear.args, block=block)
            )
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
    return ModelLayout(targets=frozen, **dataclasses.asdict(stage))


def _expert_targets(
    model: torch.nn.Module, hf_config: Any, layer: Any, module_name: str, leaf: str, param: torch.Tensor
) -> list[LoadTarget]:
    """The checkpoint tensors one ``FusedMoE`` parameter (``w13_weight`` or ``w2_weight``) is
    filled from: per local expert, gate and up (``w1``, ``w3``) or down (``w2``), each with this
    rank's slice of the intermediate dimension. The arithmetic is ``FusedMoE.weight_loader``'s
    (SGLang 0.5.23 ``_map_global_expert_id_to_local_expert_id``, ``_load_w13``, ``_load_w2``,
    ``narrow_padded_param_and_loaded_weight``): rank ``r`` keeps checkpoint rows
    ``[r * per_rank, (r + 1) * per_rank)`` clipped to the checkpoint's size; where padding leaves a
    rank none of them, it consumes nothing of that tensor (its padded rows stay zero)."""
    where = f"{module_name}.{leaf}"
    arch = type(model).__name__
    names = EXPERT_CHECKPOINT_NAMES.get(arch)
    if names is None:
        raise ManifestError(
            f"{where}: mixture-of-experts layer of {arch}, whose checkpoint expert names this adapter does not "
            f"know (known: {sorted(EXPERT_CHECKPOINT_NAMES)})"
        )
    block = _fp8_expert_block(where, layer)
    check_expert_param(where, leaf, type(getattr(layer, "quant_method", None)).__name__, block)
    refuse_layouts(
        where,
        {
            "pre-sharded checkpoints": bool(getattr(layer, "use_presharded_weights", False)),
            "fused shared experts": int(getattr(layer, "num_fused_shared_experts", 0) or 0) > 0,
            "the triton-kernels MoE backend (transposed experts)": bool(
                getattr(layer, "use_triton_kernels", False)
            ),
            "non-gated experts": not bool(layer.moe_runner_config.is_gated),
            "up before gate in w13 (FlashInfer layouts)": bool(
                getattr(getattr(layer, "quant_method", None), "load_up_proj_weight_first", False)
            ),
        },
    )
    tp_rank, tp_size = int(layer.moe_tp_rank), int(layer.moe_tp_size)
    per_rank = int(layer.intermediate_size_per_partition)
    hidden = int(layer.hidden_size)
    num_local = int(layer.num_local_experts)
    ep_rank = int(layer.moe_ep_rank)
    if int(getattr(layer, "_expert_storage_rank", ep_rank)) != ep_rank:
        raise ManifestError(f"{where}: elastic expert parallelism (storage rank != EP rank) is not supported")
    first = ep_rank * num_local
    if num_local * int(layer.moe_ep_size) != int(layer.num_experts):
        raise ManifestError(f"{where}: {num_local} local experts do not tile {layer.num_experts} experts")
    _check_trivial_placement(where, layer)
    for local_id in range(num_local):
        if layer._map_global_expert_id_to_local_expert_id(first + local_id) != local_id:
            raise ManifestError(f"{where}: expert {first + local_id} is not local slot {local_id}")
    padded = per_rank * tp_size
    config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    full = int(getattr(config, f"original_{names[3]}", None) or getattr(config, names[3], padded) or padded)
    if not 0 < full <= padded or (full != padded and not getattr(layer, "use_padded_loading", False)):
        raise ManifestError(
            f"{where}: {tp_size} x {per_rank} intermediate rows per expert for a checkpoint size of {full}"
        )
    start = tp_rank * per_rank
    kept = min(per_rank, full - start)
    if kept <= 0:
        return []
    shards = expert_shards(
        where,
        leaf,
        tuple(param.shape),
        experts=num_local,
        hidden=hidden,
        per_rank=per_rank,
        rows=(start, kept, full),
        names=names[:3],
        block=block,
    )
    ckpt_leaf = expert_leaf(leaf)
    return [
        LoadTarget(f"{module_name}.{e}.{ckpt}.{ckpt_leaf}", where, sid, param.dtype, shape, pieces, e)
        for e in range(first, first + num_local)
        for sid, ckpt, shape, pieces in shards
    ]


def _fp8_expert_block(where: str, layer: Any) -> tuple[int, int] | None:
    """None for unquantized experts; the block size of block-quantised FP8 ones (SGLang's
    ``Fp8MoEMethod`` with ``weight_block_size``: ``w13_weight`` / ``w2_weight`` float8_e4m3fn and
    ``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` float32 per block, each loaded per expert
    from the checkpoint's ``weight`` and ``weight_scale_inv``). Other FP8 expert layouts are
    refused here, naming what they do; other quant methods by ``check_expert_param``."""
    method: Any = getattr(layer, "quant_method", None)
    if type(method).__name__ != "Fp8MoEMethod":
        return None
    config = method.quant_config
    refuse_layouts(
        where,
        {
            "FP8 experts quantized at load from a 16-bit checkpoint (online quantization)": not getattr(
                config, "is_checkpoint_fp8_serialized", False
            ),
            "per-tensor FP8 experts (weight_scale, requantized after loading)": not getattr(
                method, "block_quant", False
            ),
            "MXFP8 (UE8M0 scales) experts": bool(getattr(method, "use_mxfp8", False)),
            "FP4 experts": bool(getattr(method, "is_fp4_expert", False)),
            "FP8 experts with static activation scales": getattr(config, "activation_scheme", "dynamic")
            != "dynamic",
        },
    )
    block = tuple(int(b) for b in method.weight_block_size)
    if len(block) != 2:
        raise ManifestError(f"{where}: FP8 block size {block} is not two-dimensional")
    return block[0], block[1]


def _check_trivial_placement(where: str, layer: Any) -> None:
    """SGLang's expert-location metadata (EPLB) may place a logical expert in several physical
    slots; the manifest states one slot per expert, so only the identity placement is accepted."""
    if not getattr(layer, "uses_expert_location", False):
        return
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    meta = get_global_expert_location_metadata()
    if meta is None:
        return
    if meta.num_physical_experts != meta.num_logical_experts:
        raise ManifestError(f"{where}: redundant experts (EPLB) are not supported")
    layer_id = int(layer.layer_id)
    for e in range(int(meta.num_logical_experts)):
        if list(meta.logical_to_all_physical(layer_id, e)) != [e]:
            raise ManifestError(
                f"{where}: expert {e} is placed at {meta.logical_to_all_physical(layer_id, e)}"
            )


def _geometry(
    param_name: str,
    rule: Callable[..., layer_geometry.LayerFeeds],
    module: Any,
    leaf: str,
    *args: Any,
    block: tuple[int, int] | None = None,
) -> layer_geometry.LayerFeeds:
    """``rule``'s feeds for ``module.<leaf>``; for a block-FP8 layer, its weight's slices checked
    to keep whole blocks and its ``weight_scale_inv`` derived from them (``core.fp8_geometry``)."""
    try:
        if block is None:
            return rule(module, leaf, *args)
        return fp8_geometry.layer_feeds(param_name, rule, module, leaf, *args, block=block)
    except GeometryError as e:
        raise ManifestError(f"{param_name}: {e}") from None


def _fp8_block(param_name: str, layer: Any) -> tuple[int, int] | None:
    """None for an unquantized linear layer; the block size of a block-quantised FP8 one (the
    DeepSeek / Kimi checkpoint layout: ``weight`` float8_e4m3fn, ``weight_scale_inv`` float32 per
    block, both loaded as they are). Every other quantization is refused, with what it does."""
    method: Any = getattr(layer, "quant_method", None)
    name = type(method).__name__
    if name == "UnquantizedLinearMethod":
        return None
    if name != "Fp8LinearMethod":
        raise ManifestError(
            f"{param_name}: layer is quantized ({name}); weightwire's SGLang adapter handles unquantized "
            "and block-quantised FP8 layers only"
        )
    if not getattr(method, "is_checkpoint_fp8_serialized", False):
        raise ManifestError(
            f"{param_name}: FP8 quantized at load from a 16-bit checkpoint (online quantization): the engine "
            "rebuilds these parameters after loading, so a push has nothing stable to write into; serve an "
            "FP8 checkpoint (weight_block_size) instead"
        )
    if getattr(method, "use_mxfp8", False) or not getattr(method, "block_quant", False):
        raise ManifestError(
            f"{param_name}: per-tensor / per-channel FP8 (weight_scale) is not supported: SGLang's post-load "
            "processing requantizes a fused layer's shards to one scale in place, which a later push of one "
            "shard cannot undo; block-quantised FP8 (weight_block_size) is"
        )
    activation = getattr(method.quant_config, "activation_scheme", "dynamic")
    if activation != "dynamic":
        raise ManifestError(f"{param_name}: FP8 with {activation} activation scales is not supported")
    block = tuple(int(b) for b in method.quant_config.weight_block_size)
    if len(block) != 2:
        raise ManifestError(f"{param_name}: FP8 block size {block} is not two-dimensional")
    return block[0], block[1]


def _tp_ranks(layer: Any, where: str) -> tuple[int, int]:
    """(tensor-parallel rank, k/v rank) a linear layer's weight loader slices by: SGLang 0.5.23 keeps
    the layer's groups (``tp_group``, ``kv_tp_group``; None: unsharded), 0.5.17 its ``tp_rank``."""
    if hasattr(layer, "tp_group"):

        def rank(group: Any) -> int:
            return 0 if group is None else int(group.rank_in_group)

        tp = rank(layer.tp_group)
        return tp, rank(layer.kv_tp_group) if hasattr(layer, "kv_tp_group") else tp
    if hasattr(layer, "tp_rank"):
        return int(layer.tp_rank), int(layer.tp_rank)
    raise ManifestError(
        f"{where}: {type(layer).__name__} records no tensor-parallel rank; cannot state its slice"
    )
