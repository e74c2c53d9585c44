"""Test-only shims that let SGLang's real engine import and run on a machine without a GPU.

Installed by ``make install-sglang`` into the test environments (never shipped in weightwire's
wheel). Both shims must be in place in every process SGLang starts (engine driver, each
scheduler, detokenizer) before the code that needs them runs; a ``sglang.srt.plugins`` plugin
runs too late (a spawned scheduler imports torchvision while unpickling its target, before
``load_plugins()``). So:

- torch calls ``define_torchvision_ops_quietly`` through its ``torch.backends`` entry point group
  at the end of ``import torch``, in every process, before torchvision can be imported (SGLang
  0.5.17 imports torchvision before it resolves its platform, so SGLang's own hooks are too late);
- SGLang calls ``activate()`` through its ``sglang.srt.platforms`` group when it resolves
  ``current_platform`` (on import of ``sglang.srt.utils.common``), before any model is built: the
  vllm stub goes in there, in SGLang's processes only.

Two stand-ins, each for something only GPU code would use:

- The torchvision on the package index is built for a CUDA torch; with the CPU torch its
  ``torchvision::nms``/``qnms`` operators are missing and ``import torchvision`` fails, while SGLang
  imports torchvision unconditionally. Defining the two operator schemas first lets it import; no
  detection model runs in these tests, so they are never called.
- On a host without CUDA, ``RotaryEmbedding.__init__`` imports ``vllm._custom_ops`` for a fused
  kernel that its CPU path (``forward_native``) never calls; ``FakeVllmCustomOps`` provides the name
  and raises if anything ever calls it. Installing the real vllm here would pull a CUDA stack.
"""

from __future__ import annotations

import sys
import types
from typing import Any

_KEEP_ALIVE: list[Any] = []


def activate() -> None:
    """SGLang platform-plugin entry point: apply the shims, then decline to be a platform."""
    apply()
    return None


def apply() -> None:
    """Make SGLang importable with the CPU torch (see module docstring). Idempotent."""
    define_torchvision_ops()
    if "vllm._custom_ops" not in sys.modules:
        vllm = types.ModuleType("vllm")
        ops = types.ModuleType("vllm._custom_ops")

        def rotary_embedding(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(
                "FakeVllmCustomOps.rotary_embedding: the CPU path uses forward_native, not this kernel"
            )

        ops.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
        vllm._custom_ops = ops  # type: ignore[attr-defined]
        sys.modules["vllm"] = vllm
        sys.modules["vllm._custom_ops"] = ops


def define_torchvision_ops_quietly() -> None:
    """torch's ``torch.backends`` entry point: never let a shim failure break ``import torch``."""
    try:
        define_torchvision_ops()
    except Exception as e:  # a torch without torch.library, an API change: say so, go on
        print(f"sglang_cpu_shims: could not define the torchvision operator schemas: {e!r}", file=sys.stderr)


def define_torchvision_ops() -> None:
    """The ``torchvision::nms``/``qnms`` schemas, so that ``import torchvision`` (and transformers'
    model classes, which import it) work with the CPU torch. Idempotent."""
    import torch

    if not _op_defined(torch, "nms"):
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define(
            "qnms(Tensor dets, Tensor scores, float iou_threshold, float? score_threshold=None) -> Tensor"
        )
        _KEEP_ALIVE.append(lib)


def _op_defined(torch: Any, name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True
