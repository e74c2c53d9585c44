"""What surrounds an SGLang rank's update: SGLang's own begin/end steps, and where its time went.

``WeightUpdateSession`` is the shape of ``ModelRunner.weight_updater`` (SGLang 0.5.23): its
``begin_weight_update`` undoes quantization packing (``restore_weights_before_loading``) and its
``end_weight_update`` runs every quantized layer's ``process_weights_after_loading`` again, so the
kernels read what was loaded. ``NoWeightSession`` is for releases whose own updates call
``load_weights`` with nothing around it (0.5.17); ``LoaderWeightSession`` takes the same steps as
0.5.23's for a model that no ``ModelRunner`` holds (tests).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from weightwire.adapters.rank_adapter import UpdatePhaseTimes


class WeightUpdateSession(Protocol):
    """SGLang's per-runner update steps: ``ModelRunner.weight_updater`` has exactly these."""

    def begin_weight_update(self) -> None: ...

    def end_weight_update(self, *, run_post_load: bool) -> None: ...


class NoWeightSession:
    """For SGLang releases whose own updates call ``load_weights`` with nothing around it (0.5.17)."""

    def begin_weight_update(self) -> None:
        return None

    def end_weight_update(self, *, run_post_load: bool) -> None:
        return None


class LoaderWeightSession:
    """The steps of SGLang's ``WeightUpdater.begin/end_weight_update`` for a model that has no
    ``ModelRunner`` around it (tests): the same ``DefaultModelLoader`` calls."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device

    def begin_weight_update(self) -> None:
        from sglang.srt.model_loader.loader import DefaultModelLoader

        DefaultModelLoader.restore_weights_before_loading(self.model, self.device)

    def end_weight_update(self, *, run_post_load: bool) -> None:
        from sglang.srt.model_loader.loader import DefaultModelLoader, post_load_weights

        if run_post_load:
            post_load_weights(self.model)
        DefaultModelLoader.postprocess_weights(self.model, self.device)


@dataclasses.dataclass
class UpdatePhases(UpdatePhaseTimes):
    """Where one update's time went on this SGLang rank (nanoseconds, summed over its steps).

    ``*_wait_ns``: from handing a step to the scheduler thread until that thread started it (the
    hand-off); ``load_ns``: the load steps' work (synchronizes, copies or ``load_weights``);
    ``commit_ns``: ``on_committed`` (SGLang's version record and cache flush); ``between_ns``: from
    the end of one step to the hand-off of the next (the worker's gRPC thread receiving, opening
    and checking the next bucket, acking the last); ``total_ns``: from
    ``begin_update`` until ``end_update`` returned, the time between steps (the gRPC threads
    receiving and opening buckets) included."""

    begin_wait_ns: int = 0
    begin_ns: int = 0
    load_wait_ns: int = 0
    end_wait_ns: int = 0
    end_ns: int = 0
    commit_ns: int = 0
    between_ns: int = 0
    tensors: int = 0
    direct_loads: int = 0
    gate_refusals: int = 0
