"""Slices from every trainer rank into a vLLM worker: the staged write through vLLM's reload.

An update whose every trainer rank is a source (``TRANSFER_MODE_SLICES``) sends each worker only
what its manifest keeps of each checkpoint tensor (its TP rows of q/k/v and gate/up, its columns
of a row-parallel weight, its vocabulary rows), never the whole tensor. A vLLM worker has no
tensor those bytes could land in directly: on CPU every linear and embedding weight is repacked
into a kernel layout, quantized kernels repack on a GPU too, and a fused layer is reloaded only
whole. So the adapter is ``StagesSlices``: the worker receives the bucket into staging of the kept
shapes (``kept_tensors`` says those shapes without holding the bytes) and hands it to
``write_kept`` once it arrived whole and was checked; a failure before then leaves the model as it
was.

``write_kept`` goes through the same path as every other load (``VLLMAdapter.load``: the update
window, the forward gate, vLLM's layerwise reload, which re-runs the kernels' repacking, or the
direct copy of a layer proven to be a plain copy, ``direct.py``), one vLLM layer at a time: each
layer's checkpoint tensors are rebuilt at their full checkpoint shape with this worker's pieces
in place, so vLLM's weight loaders take the same rows they take from a checkpoint (the other rows
are never read). Memory beyond the worker's staging of the bucket: one layer's full checkpoint
tensors at a time (a TP rank's share times TP), freed when the layer is loaded; a tensor this
worker keeps whole is loaded from the staging itself.

Built by ``weightwire.adapters.vllm.backend`` in every vLLM worker.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from weightwire.adapters.vllm.adapter import VLLMAdapter
from weightwire.adapters.vllm.manifest import LoadTarget
from weightwire.core.errors import Reason, WeightwireError
from weightwire.server.transports.transfer_group_slices import kept_shape

__all__ = ["SlicesVLLMAdapter", "full_tensor"]


class SlicesVLLMAdapter(VLLMAdapter):
    """A ``VLLMAdapter`` that receives slices from every trainer rank: ``KeepsTensors`` (the kept
    shapes) and ``StagesSlices`` (the staged write through ``load``); see the module docstring."""

    def kept_tensors(self) -> Mapping[str, torch.Tensor]:
        """Per owned tensor, a tensor of its kept shape, dtype and device that holds no bytes of its
        own (one element, expanded): the worker stages into new tensors of these shapes, and only
        ``write_kept`` writes the model."""
        manifest = self.manifest()
        return {
            name: torch.empty((), dtype=target.dtype, device=self.device).expand(
                kept_shape(manifest.tensors[name])
            )
            for name, target in self.layout.targets.items()
        }

    def refuse_slices(self, names: frozenset[str]) -> None:
        """ENGINE_NOT_PAUSED when vLLM's update window is not open here (the bytes could not be
        written when they arrive); called before a byte of the bucket moves."""
        if not self.window_open:
            raise WeightwireError(
                Reason.ENGINE_NOT_PAUSED,
                f"{self.worker_id}: vLLM has no weight update open on this worker; call start_weight_update() "
                "before pushing slices",
            )

    def write_kept(self, staged: Mapping[str, torch.Tensor]) -> None:
        """Load a whole, checked bucket's staged tensors (kept shapes) through ``load``, one vLLM
        layer at a time, each tensor at its full checkpoint shape (module docstring)."""
        by_layer: dict[str, list[str]] = {}
        for name in staged:
            by_layer.setdefault(self.layout.targets[name].layer_name, []).append(name)
        for names in by_layer.values():
            self.load([(n, full_tensor(self.layout.targets[n], staged[n])) for n in names])


def full_tensor(target: LoadTarget, kept: torch.Tensor) -> torch.Tensor:
    """The checkpoint tensor of ``target`` at its full shape with ``kept`` (its pieces concatenated
    along their dimension, in manifest order) in place; ``kept`` itself when it is the whole tensor.
    The rows outside the pieces are left unset: vLLM's weight loaders of this rank never read them."""
    if not target.pieces:
        return kept
    full = torch.empty(target.shape, dtype=kept.dtype, device=kept.device)
    at = 0
    for piece in target.pieces:
        full.narrow(piece.dim, piece.offset, piece.length).copy_(kept.narrow(piece.dim, at, piece.length))
        at += piece.length
    return full
