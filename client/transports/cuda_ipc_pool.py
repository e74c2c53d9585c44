"""The fresh-tensor pool of the CUDA IPC exporter: device buffers every worker opened once, that a
push packs the trainer's fresh tensors into with one device copy each.

RL trainers mostly hand ``push`` tensors made for it (an FSDP ``full_tensor()`` gather, a Megatron to
HF conversion, a ``state_dict()`` copy, ``load_state_dict(assign=True)``): every parameter in a new
storage each step. Exported where they live, each such storage is shared anew and opened anew by
every worker (about 0.2 ms each: 72-90 ms for Qwen3-8B's 399 parameters on one H200). Packed into
the pool instead (one ``torch.cat`` per run of back-to-back tensors), the payload names the same
few pool storages every step, so each worker finds it kept with its views and prepared load (the
kept path's cost on the worker), and the trainer pays one device copy of the bytes.

``CudaIpcExporter.export_tensors`` decides per push, from what it already shared, which storages go
where they live and which are packed (``pack_fresh``); this module has that rule, the pool's layout
(``lay_out``: pure, tested on CPU) and the buffers (``PoolRegion``). No gRPC.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

# What a storage exported anew costs (the trainer's share plus each worker's open of a new handle,
# ~0.2 ms on one H200) against what packing its bytes costs (a device copy, ~0.5 ms/GiB there):
# a fresh storage is packed when its copy is the cheaper.
OPEN_COST_NS = 200_000
COPY_NS_PER_BYTE = 0.5e6 / (1 << 30)
# Pool buffers are allocations of up to this size (a tensor larger than it gets one of its own):
# the caching allocator finds blocks of this size more easily than one of a whole model.
CHUNK_BYTES = 1 << 30
# Each packed tensor starts at a multiple of this (element-aligned for every dtype, and aligned for
# vectorised copies on both sides).
ALIGN_BYTES = 256
# Allocations are rounded up to this (the caching allocator's large-block granule).
ALLOC_GRANULE = 2 * 1024 * 1024
# Tensors of at most this many bytes are packed in one grouped launch (``torch._foreach_copy_``),
# larger ones by their own copy: the bound the worker's adapter uses for the same reason.
GROUPED_COPY_MAX_BYTES = 16 * 1024 * 1024


def pack_fresh(fresh_storages: int, all_storages: int, fresh_bytes: int) -> bool:
    """Whether a push packs its fresh storages into the pool rather than sharing each anew.

    Fresh storages are those this exporter never shared nor saw in the push before (new every
    step). They are packed when they are at least half of the payload's storages (a trainer that
    replaces a few parameters shares those anew and keeps the rest's kept payload changing little)
    and their copy costs less than opening each of them anew."""
    if fresh_storages == 0 or 2 * fresh_storages < all_storages:
        return False
    return fresh_bytes * COPY_NS_PER_BYTE <= fresh_storages * OPEN_COST_NS


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each packed tensor goes: ``places[i]`` = (chunk index, byte offset in that chunk) of the
    i-th size given to ``lay_out``; ``chunks`` the chunk sizes, already rounded for allocation."""

    places: tuple[tuple[int, int], ...]
    chunks: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.chunks)


def _round_up(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def lay_out(sizes: Sequence[int], chunk_bytes: int = CHUNK_BYTES) -> Layout:
    """Tensors of ``sizes`` bytes, in order, each at an ``ALIGN_BYTES`` boundary, into chunks of at
    most ``chunk_bytes`` (a larger tensor gets a chunk of its own size)."""
    places: list[tuple[int, int]] = []
    chunks: list[int] = []
    used = 0
    for n in sizes:
        at = _round_up(used, ALIGN_BYTES)
        if not chunks or (at + n > chunk_bytes and used > 0):
            if chunks:
                chunks[-1] = used
            chunks.append(0)
            at = 0
        places.append((len(chunks) - 1, at))
        used = at + max(int(n), 0)
    if chunks:
        chunks[-1] = used
    return Layout(tuple(places), tuple(_round_up(max(c, 1), ALLOC_GRANULE) for c in chunks))


class PoolRegion:
    """The pool buffers of one recipient group: allocated for one layout, kept across pushes that
    pack the same tensors, and the typed views each packed tensor is copied into."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        # Raises torch.OutOfMemoryError when the device cannot hold them (the caller then shares).
        self.chunks: list[torch.Tensor] = [
            torch.empty(n, dtype=torch.uint8, device=device) for n in layout.chunks
        ]

    def views(self, shapes: Sequence[tuple[torch.dtype, torch.Size]]) -> list[torch.Tensor]:
        """One view per packed tensor (its dtype and shape) at its place."""
        out: list[torch.Tensor] = []
        for (chunk, at), (dtype, shape) in zip(self.layout.places, shapes, strict=True):
            n = shape.numel() * dtype.itemsize
            out.append(self.chunks[chunk].narrow(0, at, n).view(dtype).view(shape))
        return out


# How ``ExportedTensors.pack`` copies: True, one ``torch.cat`` into each run of packed tensors of one
# dtype that lie back to back (``cat_runs``; Qwen3-8B's 399 tensors are 16 runs, one per chunk);
# False, one copy per tensor with the small ones grouped (``copy_into``). On one H200 the cat packs
# those 15.26 GiB in 8.20 ms against 8.48 (BENCHMARKS.md, "Issue 37").
PACK_WITH_CAT = True


def cat_runs(
    layout: Layout, chunks: Sequence[torch.Tensor], shapes: Sequence[tuple[torch.dtype, torch.Size]]
) -> list[tuple[torch.Tensor, list[int]]]:
    """The packed tensors (indices into ``shapes``) cut into runs of one dtype lying back to back in
    one chunk, each with the flat view of the chunk it fills (what one ``torch.cat`` writes)."""
    runs: list[tuple[torch.Tensor, list[int]]] = []
    start = end = -1
    run: list[int] = []
    run_chunk = -1
    run_dtype: torch.dtype | None = None

    def close() -> None:
        if run and run_dtype is not None:
            runs.append((chunks[run_chunk].narrow(0, start, end - start).view(run_dtype), list(run)))

    for i, ((chunk, at), (dtype, shape)) in enumerate(zip(layout.places, shapes, strict=True)):
        n = shape.numel() * dtype.itemsize
        if not (chunk == run_chunk and dtype == run_dtype and at == end):
            close()
            run, run_chunk, run_dtype, start = [], chunk, dtype, at
        run.append(i)
        end = at + n
    close()
    return runs


def cat_into(runs: Sequence[tuple[torch.Tensor, list[int]]], srcs: Sequence[torch.Tensor]) -> None:
    """Every run's sources (contiguous tensors) concatenated into its flat view, on the current stream."""
    with torch.no_grad():
        for out, members in runs:
            torch.cat([srcs[i].view(-1) for i in members], out=out)


def copy_into(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """Every ``srcs[i]`` into ``dsts[i]`` on the current stream: small ones in one grouped launch,
    large ones by their own copy (a grouped copy of large tensors is slower than plain copies)."""
    small_d: list[torch.Tensor] = []
    small_s: list[torch.Tensor] = []
    with torch.no_grad():
        for d, s in zip(dsts, srcs, strict=True):
            if d.nbytes <= GROUPED_COPY_MAX_BYTES:
                small_d.append(d)
                small_s.append(s)
            else:
                d.copy_(s)
        if small_d:
            torch._foreach_copy_(small_d, small_s)
