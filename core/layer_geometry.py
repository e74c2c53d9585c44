"""What one tensor-parallel layer of SGLang or vLLM consumes from the checkpoint, and which part of
each checkpoint tensor it keeps. Pure: no torch, no engine import.

SGLang's and vLLM's parallel linear layers and vocabulary embeddings are the same design (vLLM's,
which SGLang copied): the same class names, the same records of their unsharded sizes and the same
weight-loader arithmetic. So the per-layer rules live here once, and each engine's manifest module
only finds the layers, reads the engine's tensor-parallel rank and checks the parameter it holds
against the ``local`` shape given here. The fleet planner (``core.transports.transfer_plan_fleet``)
applies the same rules to layers that exist only as a model config.

The arithmetic is the weight loaders' own (SGLang 0.5.17-0.5.23 and vLLM 0.32 ``layers/linear.py``):
a column-parallel output keeps rows ``[tp_rank * per_rank, (tp_rank + 1) * per_rank)``; a merged
column layer (gate/up) does that per output; q of a QKV layer by ``tp_rank``, k and v by
``kv_tp_rank // num_kv_head_replicas`` (k/v heads are replicated when there are fewer of them than
ranks); a row-parallel weight keeps columns (dimension 1) and its bias whole; a vocabulary-parallel
embedding keeps rows ``[org_vocab_start_index, org_vocab_end_index)`` of its shard indices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from weightwire.core.manifest import TensorPiece


class GeometryError(ValueError):
    """A layer whose sizes do not add up to a slice this module can state."""


@dataclasses.dataclass(frozen=True)
class Feed:
    """One checkpoint tensor a layer parameter is filled from."""

    component: int
    """Index among the layer's fused checkpoint modules (q, k, v = 0, 1, 2); 0 for an unfused layer."""
    shard_id: str | int | None
    """The shard id the engine's weight loader takes for it (``"k"``, ``1``), None if unfused."""
    shape: tuple[int, ...]
    """Full checkpoint shape."""
    pieces: tuple[TensorPiece, ...]
    """What this rank keeps of it (empty: the whole tensor)."""


@dataclasses.dataclass(frozen=True)
class LayerFeeds:
    """A parameter's expected local (model-format) shape and the checkpoint tensors it is filled from."""

    local: tuple[int, ...]
    feeds: tuple[Feed, ...]


_QKV_SHARD_IDS = ("q", "k", "v")


def _rows(leaf: str, rows: int, cols: int) -> tuple[int, ...]:
    return (rows, cols) if leaf == "weight" else (rows,)


def _piece(dim: int, offset: int, length: int, full: int) -> tuple[TensorPiece, ...]:
    """A one-dimension slice, or () when it is the whole dimension (nothing sliced)."""
    if length < 1 or offset < 0 or offset + length > full:
        raise GeometryError(f"slice [{offset}, {offset + length}) of a dimension of size {full}")
    return () if (offset, length) == (0, full) else (TensorPiece(dim, offset, length),)


def qkv(layer: Any, leaf: str, tp_rank: int, kv_tp_rank: int) -> LayerFeeds:
    """A ``QKVParallelLinear``'s weight or bias: q, k, v, each a row range of its own tensor."""
    hs, vhs = layer.head_size, layer.v_head_size
    full = (layer.total_num_heads * hs, layer.total_num_kv_heads * hs, layer.total_num_kv_heads * vhs)
    local = (layer.num_heads * hs, layer.num_kv_heads * hs, layer.num_kv_heads * vhs)
    kv_shard = kv_tp_rank // int(getattr(layer, "num_kv_head_replicas", 1) or 1)
    starts = (tp_rank * local[0], kv_shard * local[1], kv_shard * local[2])
    feeds = tuple(
        Feed(i, sid, _rows(leaf, f, layer.input_size), _piece(0, s, n, f))
        for i, (sid, f, n, s) in enumerate(zip(_QKV_SHARD_IDS, full, local, starts, strict=True))
    )
    return LayerFeeds(_rows(leaf, sum(local), layer.input_size), feeds)


def merged_column(layer: Any, leaf: str, tp_rank: int) -> LayerFeeds:
    """A ``MergedColumnParallelLinear`` (gate/up): each output a row range of its own tensor."""
    fulls, parts = list(layer.output_sizes), list(layer.output_partition_sizes)
    if len(fulls) != len(parts):
        raise GeometryError(f"{len(fulls)} output sizes but {len(parts)} partition sizes")
    feeds = tuple(
        Feed(i, i, _rows(leaf, f, layer.input_size), _piece(0, tp_rank * n, n, f))
        for i, (f, n) in enumerate(zip(fulls, parts, strict=True))
    )
    return LayerFeeds(_rows(leaf, sum(parts), layer.input_size), feeds)


def column(layer: Any, leaf: str, tp_rank: int) -> LayerFeeds:
    """A ``ColumnParallelLinear``: rows ``tp_rank`` of its weight and bias."""
    n, f = layer.output_size_per_partition, layer.output_size
    feed = Feed(0, None, _rows(leaf, f, layer.input_size), _piece(0, tp_rank * n, n, f))
    return LayerFeeds(_rows(leaf, n, layer.input_size), (feed,))


def row(layer: Any, leaf: str, tp_rank: int) -> LayerFeeds:
    """A ``RowParallelLinear``: columns (dimension 1) ``tp_rank`` of its weight; its bias whole."""
    if leaf != "weight":
        return LayerFeeds((layer.output_size,), (Feed(0, None, (layer.output_size,), ()),))
    n, f = layer.input_size_per_partition, layer.input_size
    feed = Feed(0, None, (layer.output_size, f), _piece(1, tp_rank * n, n, f))
    return LayerFeeds((layer.output_size, n), (feed,))


def replicated(layer: Any, leaf: str) -> LayerFeeds:
    """A ``ReplicatedLinear``: every rank keeps the whole tensor."""
    full = _rows(leaf, layer.output_size, layer.input_size)
    return LayerFeeds(full, (Feed(0, None, full, ()),))


def vocab(layer: Any, leaf: str) -> LayerFeeds:
    """A ``VocabParallelEmbedding`` / ``ParallelLMHead``: this rank's rows of the original vocabulary
    (the local parameter may have padding rows past them, which no checkpoint byte fills)."""
    full_rows = layer.org_vocab_size
    full = _rows(leaf, full_rows, layer.embedding_dim)
    idx = layer.shard_indices
    start, end = idx.org_vocab_start_index, idx.org_vocab_end_index
    local = _rows(leaf, layer.num_embeddings_per_partition, layer.embedding_dim)
    return LayerFeeds(local, (Feed(0, None, full, _piece(0, start, end - start, full_rows)),))


def union_of_pieces(groups: Iterable[tuple[TensorPiece, ...]]) -> tuple[TensorPiece, ...]:
    """What several parameters filled from one checkpoint tensor keep of it together (a tied
    embedding and lm_head): () (the whole tensor) when one of them keeps it whole."""
    out: set[TensorPiece] = set()
    for pieces in groups:
        if not pieces:
            return ()
        out.update(pieces)
    return tuple(sorted(out, key=lambda p: (p.dim, p.offset)))
