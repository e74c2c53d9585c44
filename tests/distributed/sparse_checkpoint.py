"""The demo checkpoint after sparse training steps: what the delta tests push and expect. A step
moves ``CHANGED`` of each tensor's elements (at least one) a little, as an RL step at a small
learning rate does; the same seeds give the same bits in every process."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint

CHANGED = 0.005


def stepped(config: DemoConfig, seed: int, steps: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """``full_checkpoint(config, seed)`` after one sparse step per seed of ``steps``, in order."""
    ckpt = full_checkpoint(config, seed)
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        for name in sorted(ckpt):
            flat = ckpt[name].view(-1)
            k = max(1, int(flat.numel() * CHANGED))
            at = torch.randperm(flat.numel(), generator=gen)[:k]
            flat[at] += 1e-2
    return ckpt
