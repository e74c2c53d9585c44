"""Quantized layers in a vLLM worker's manifest: block-quantised FP8 taken, the rest refused.

A checkpoint in the DeepSeek-V3 / Kimi-K2 layout (``quantization_config`` with ``quant_method: fp8``
and ``weight_block_size``) is served by vLLM's ``Fp8LinearMethod`` with ``block_quant``: each linear
layer registers ``weight`` (float8_e4m3fn, the model-format ``[out, in]`` of this rank) and
``weight_scale_inv`` (float32, one per block), and its weight loaders fill both from the
checkpoint's ``<module>.weight`` and ``<module>.weight_scale_inv`` (fused q/k/v and gate/up: each
component's rows one after another, its scale rows at ``offset / block``; vLLM 0.26-0.32
``layers/linear.py``, ``BlockQuantScaleParameter``). So the manifest lists both as checkpoint
tensors of their own, with the slices ``core.fp8_geometry`` derives from the dense rule (whole
blocks only).

After loading, ``process_weights_after_loading`` hands both to the GEMM kernel, which may re-register
or repack them (the CPU AMX kernel prepacks the weight; the GPU kernels re-register the same
tensors). vLLM's layerwise reload reruns it once all of a layer's names (weights and scales) have
arrived, which is why a quantized layer always loads through the reload and never by a direct copy
(``ModelLayout.reload_only``).

Refused, each with what it does: FP8 quantized at load from a 16-bit checkpoint (online), per-tensor
or per-channel FP8 (one ``weight_scale`` per fused shard, requantized to a single scale after
loading: a scale the trainer pushes is not the one the kernel reads), UE8M0 (power-of-two) scales,
static activation scales, and every other quantization method.
"""

from __future__ import annotations

from typing import Any

from weightwire.adapters.layout_rules import ManifestError
from weightwire.core import fp8_geometry

# What vLLM's ``Fp8KVCacheMethod`` gives an attention layer of an FP8 model: KV-cache and
# attention quantization scales (1.0 unless the checkpoint brought its own), not weights a
# trainer changes; they stay as loaded at start.
KV_CACHE_SCALES = frozenset({"q_scale", "k_scale", "v_scale", "prob_scale"})


def block_size(where: str, layer: Any) -> tuple[int, int] | None:
    """None for an unquantized linear layer; the block size of a block-quantised FP8 one. Every
    other quantization is refused (ManifestError), naming what it does."""
    method: Any = getattr(layer, "quant_method", None)
    name = type(method).__name__
    if name == "UnquantizedLinearMethod":
        return None
    if "Online" in name or (
        name == "Fp8LinearMethod" and not method.quant_config.is_checkpoint_fp8_serialized
    ):
        raise ManifestError(
            f"{where}: FP8 quantized at load from a 16-bit checkpoint ({name}, online quantization): vLLM "
            "rebuilds these parameters after loading, so a push has nothing stable to write into; serve a "
            "block-quantised FP8 checkpoint (weight_block_size) instead"
        )
    if name != "Fp8LinearMethod":
        raise ManifestError(
            f"{where}: layer is quantized ({name}); weightwire's vLLM adapter handles unquantized and "
            "block-quantised FP8 layers (Fp8LinearMethod with weight_block_size) only"
        )
    if not getattr(method, "block_quant", False):
        raise ManifestError(
            f"{where}: per-tensor / per-channel FP8 (weight_scale) is not supported: vLLM's post-load "
            "processing requantizes a fused layer's shards to one scale, so the kernel would not read the "
            "scales a trainer pushes; block-quantised FP8 (weight_block_size) is"
        )
    if getattr(method, "is_scale_e8m0", False):
        raise ManifestError(f"{where}: FP8 with UE8M0 (power-of-two) block scales is not supported")
    if getattr(method, "act_q_static", False):
        raise ManifestError(f"{where}: FP8 with static activation scales (input_scale) is not supported")
    block = tuple(int(b) for b in method.weight_block_size)
    if len(block) != 2:
        raise ManifestError(f"{where}: FP8 block size {block} is not two-dimensional")
    return block[0], block[1]


def expert_block_size(where: str, layer: Any) -> tuple[int, int] | None:
    """None for unquantized experts; the block size of block-quantised FP8 ones (vLLM's
    ``Fp8MoEMethod`` with ``weight_block_size``: ``w13_weight`` / ``w2_weight`` float8_e4m3fn and
    ``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` float32 per block, each loaded per expert
    from the checkpoint's ``weight`` and ``weight_scale_inv``). Other FP8 expert layouts are
    refused here, naming what they do; other quant methods by ``layout_rules.check_expert_param``."""
    method: Any = getattr(layer, "quant_method", None)
    if type(method).__name__ != "Fp8MoEMethod":
        return None
    config = method.quant_config
    if not config.is_checkpoint_fp8_serialized:
        raise ManifestError(
            f"{where}: FP8 experts quantized at load from a 16-bit checkpoint (online quantization) are not "
            "supported; serve a block-quantised FP8 checkpoint (weight_block_size) instead"
        )
    if not method.block_quant:
        raise ManifestError(
            f"{where}: per-tensor FP8 experts (weight_scale, requantized to one scale per expert after "
            "loading) are not supported; block-quantised FP8 experts (weight_block_size) are"
        )
    if getattr(method, "weight_scale_refine", None) is not None:
        raise ManifestError(
            f"{where}: FP8 expert block scales refined to {list(method.moe_block_shape)} to fit the TP shard "
            f"(the loader upsamples the checkpoint's {list(method.weight_block_size)} scales) are not supported"
        )
    if getattr(config, "activation_scheme", "dynamic") != "dynamic":
        raise ManifestError(f"{where}: FP8 experts with static activation scales are not supported")
    block = tuple(int(b) for b in method.weight_block_size)
    if len(block) != 2:
        raise ManifestError(f"{where}: FP8 block size {block} is not two-dimensional")
    return block[0], block[1]


def is_kv_cache_scale(layer: Any, leaf: str) -> bool:
    """Whether ``layer.<leaf>`` is an attention layer's KV-cache quantization scale (left out)."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    return leaf in KV_CACHE_SCALES and isinstance(getattr(layer, "quant_method", None), BaseKVCacheMethod)


def leaves(block: tuple[int, int] | None) -> tuple[str, ...]:
    """The parameters of a linear layer the manifest lists (its scale when block-quantised)."""
    return ("weight", "bias") if block is None else ("weight", "bias", fp8_geometry.SCALE_LEAF)
