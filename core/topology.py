"""Pure ownership rules: which checkpoint tensors a (tp, pp) shard owns. No I/O, no torch.

Pipeline placement follows SGLang's ``get_pp_indices`` (even split; the last ``remainder`` stages
get one extra layer). Names follow Hugging Face checkpoints: ``model.layers.N.`` for decoder layers,
``model.embed_tokens.weight`` on the first stage, ``model.norm.weight`` and ``lm_head.weight`` on the
last stage.
"""

from __future__ import annotations

import dataclasses
import re

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")

FIRST_STAGE_PREFIXES = ("model.embed_tokens.",)
LAST_STAGE_PREFIXES = ("model.norm.", "lm_head.")


@dataclasses.dataclass(frozen=True)
class LayerSpan:
    """Decoder layers [start, end) of ``num_layers`` on one pipeline stage."""

    start: int
    end: int
    num_layers: int

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end


def pp_layer_span(num_layers: int, pp_rank: int, pp_size: int) -> LayerSpan:
    """Layers held by ``pp_rank`` of ``pp_size`` (SGLang's default partition)."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} out of range for pp_size {pp_size}")
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
    base, remainder = divmod(num_layers, pp_size)
    if pp_rank >= pp_size - remainder:
        start = pp_rank * (base + 1) - (pp_size - remainder)
        return LayerSpan(start, start + base + 1, num_layers)
    start = pp_rank * base
    return LayerSpan(start, start + base, num_layers)


def layer_index(name: str) -> int | None:
    """Decoder layer number in a checkpoint name (``model.layers.7.mlp...`` -> 7), else None."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def stage_owns(name: str, span: LayerSpan, pp_rank: int, pp_size: int) -> bool:
    """Whether pipeline stage ``pp_rank`` holds checkpoint tensor ``name``.

    Layer tensors go to the stage whose span holds the layer; embeddings to the first stage; the
    final norm and lm_head to the last stage; anything else (unknown top-level tensors) to every
    stage, so it is never silently dropped.
    """
    layer = layer_index(name)
    if layer is not None:
        return layer in span
    if name.startswith(FIRST_STAGE_PREFIXES):
        return pp_rank == 0
    if name.startswith(LAST_STAGE_PREFIXES):
        return pp_rank == pp_size - 1
    return True


def tp_slice_bounds(full_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of ``tp_rank``'s even slice of a dimension of ``full_size``."""
    if full_size % tp_size:
        raise ValueError(f"dimension {full_size} is not divisible by tp_size {tp_size}")
    step = full_size // tp_size
    return tp_rank * step, (tp_rank + 1) * step
