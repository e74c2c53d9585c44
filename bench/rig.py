"""The trainer's side of the benchmarks: its copy of a model, and timing of its staging work.

``bench_gpu.py`` and ``bench_cpu.py`` (the trainer processes) build a ``Rig`` per model and call
``instrument_trainer`` once, so every push reports how long the trainer spent packing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models
from common import GiB, MiB, now
from weightwire.client.inputs import plan as ww_plan
from weightwire.client.inputs.plan import TensorSpec, layout_flat, pack_into
from weightwire.client.push.pusher import FlatBucket
from weightwire.client.transports import exporter as ww_exporters

# ---------------------------------------------------------------------------------------------
# Trainer-side instrumentation: time spent staging (packing copies and the wait for them)
# ---------------------------------------------------------------------------------------------

STAGE_NS = [0]
# Client-side work before the stream starts: manifest re-check (GetStatus on every worker) and
# planning (name/dtype/shape checks, bucket layout).
RECHECK_NS = [0]
PLAN_NS = [0]


def reset_counters() -> None:
    STAGE_NS[0] = RECHECK_NS[0] = PLAN_NS[0] = 0


def _timed(fn: Callable[..., Any], counter: list[int]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = now()
        try:
            return fn(*a, **k)
        finally:
            counter[0] += now() - t0

    return wrapper


def instrument_trainer() -> None:
    """Wrap the pusher's packing copy and the staging buffers' ``ready`` (where it waits for those
    copies) so each update reports its staging time. Only this benchmark process is affected."""
    orig_pack = ww_plan.pack_into

    def timed_pack(*a: Any, **k: Any) -> None:
        t0 = now()
        orig_pack(*a, **k)
        STAGE_NS[0] += now() - t0

    ww_plan.pack_into = timed_pack
    for name in ("check_update", "plan_buckets", "owners_by_name", "check_flat_specs"):
        setattr(ww_plan, name, _timed(getattr(ww_plan, name), PLAN_NS))
    from weightwire.client.push.pusher import WeightPusher

    WeightPusher._recheck = _timed(WeightPusher._recheck, RECHECK_NS)  # type: ignore[method-assign]
    classes: list[type] = [ww_exporters.StagingBuffer]
    with contextlib.suppress(Exception):
        from weightwire.client.transports.cuda_ipc import CudaStagingBuffer

        classes.append(CudaStagingBuffer)
    for cls in classes:
        orig_ready = cls.ready

        def timed_ready(self: Any, _orig: Callable[[Any], None] = orig_ready) -> None:
            t0 = now()
            _orig(self)
            STAGE_NS[0] += now() - t0

        cls.ready = timed_ready  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------
# The trainer's copy of one model
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Rig:
    """One model on the trainer side: separate tensors (as gathered parameters are), the same bytes
    in one flat buffer (as an all-gather output is), and on GPU 1 for the peer case."""

    preset: str
    device: torch.device
    shapes: list[models.TensorShape]
    tensors: list[torch.Tensor]
    specs: list[TensorSpec]
    size: int
    flat: torch.Tensor
    flat_peer: torch.Tensor | None
    digest: list[int] = dataclasses.field(default_factory=list)
    seed: int = 0

    @property
    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(t.name, x) for t, x in zip(self.shapes, self.tensors, strict=True)]

    @property
    def model_bytes(self) -> int:
        return sum(t.nbytes for t in self.shapes)

    def sync(self) -> None:
        if self.device.type == "cuda":
            for i in range(torch.cuda.device_count()):
                torch.cuda.synchronize(i)

    def release(self) -> None:
        """Drop the GPU buffers (the next model needs the memory)."""
        self.tensors = []
        self.flat = torch.empty(0, dtype=torch.uint8)
        self.flat_peer = None

    def refill(self) -> None:
        """New contents everywhere (outside any timing)."""
        self.seed += 1
        models.refill(self.tensors, self.seed)
        pack_into(self.flat, self.specs, self.tensors)
        if self.flat_peer is not None:
            self.flat_peer.copy_(self.flat)
        self.sync()
        self.digest = models.digest(self.tensors)


def make_rig(preset: str, device: torch.device, peer: bool) -> Rig:
    shapes = models.tensor_shapes(preset)
    tensors = models.random_tensors(shapes, device, seed=0)
    specs, size = layout_flat([(t.name, x) for t, x in zip(shapes, tensors, strict=True)])
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    flat_peer = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", 1)) if peer else None
    rig = Rig(preset, device, shapes, tensors, specs, size, flat, flat_peer)
    rig.refill()
    return rig


def flat_buckets(flat: torch.Tensor, specs: list[TensorSpec], bucket_bytes: int | None) -> list[FlatBucket]:
    """``flat`` cut into views of consecutive tensors of at most ``bucket_bytes`` (None: one bucket),
    specs re-based to each view. All views share one storage, hence one exported handle."""
    if bucket_bytes is None:
        return [FlatBucket(flat, specs)]
    out: list[FlatBucket] = []
    group: list[TensorSpec] = []
    start = 0
    for s in specs:
        end = s.offset_bytes + s.nbytes
        if group and end - start > bucket_bytes:
            stop = group[-1].offset_bytes + group[-1].nbytes
            out.append(
                FlatBucket(
                    flat[start:stop],
                    [dataclasses.replace(g, offset_bytes=g.offset_bytes - start) for g in group],
                )
            )
            group, start = [], s.offset_bytes
        group.append(s)
    if group:
        stop = group[-1].offset_bytes + group[-1].nbytes
        out.append(
            FlatBucket(
                flat[start:stop], [dataclasses.replace(g, offset_bytes=g.offset_bytes - start) for g in group]
            )
        )
    return out


def parse_size(text: str) -> int:
    """``64KiB``, ``64MiB``, ``1GiB``, ``256m``, or plain bytes."""
    t = text.strip().lower()
    for suffix, mult in (("gib", GiB), ("mib", MiB), ("kib", 1024), ("g", GiB), ("m", MiB), ("k", 1024)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)
