"""DTensor (FSDP2) weights on the trainer side: recognise them, describe them by their full
checkpoint shape, and write each one's full value into a staging buffer, one tensor at a time.

``weightwire.client.ranks.collective_push`` uses this while it fills a bucket: every trainer rank calls
``FullTensorWriter.write`` for the same tensors in the same order (each call on a sharded tensor is a
collective on the tensor's own device-mesh group), and the ranks that pack the bucket pass the
tensor's place in their staging buffer as ``dst``. Only one tensor's full value exists at a time
outside the staging buffers, and for the common FSDP2 layout (one ``Shard(0)`` placement on a 1-D
mesh, evenly divided, no dtype conversion) the all-gather writes straight into the staging buffer,
so memory stays bounded by the bucket size, never the model's.

A dtype conversion happens only when the caller asks for one (``cast_to``): an fp32 master weight
pushed into a bf16 engine without it is a ``DTYPE_MISMATCH`` before anything is sent.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from weightwire.client.inputs.plan import TensorSpec
from weightwire.core.errors import PushError, Reason, WeightwireError

# ``cast_to``: one dtype for every floating-point tensor, or a map from a pushed dtype to the dtype
# the engine gets. Integer and bool tensors are never converted by the single-dtype form.
CastTo = torch.dtype | Mapping[torch.dtype, torch.dtype] | None


class RankLostError(WeightwireError, PushError):
    """A collective of the trainer's process group failed: a rank died, or did not take part in time.

    After this the group is out of step (a collective was left half done); no further update can use
    it, so the trainer must restart its ranks (the usual answer to a lost rank in torch.distributed).
    It is a ``PushError`` (a caller's ``except PushError`` catches every failed push; no worker
    failed, so ``failures`` and ``results`` are empty) and a ``WeightwireError`` with reason
    ``TRAINER_RANK_LOST``.
    """

    def __init__(self, message: str, **metadata: str) -> None:
        # Not through super(): the two bases take different arguments.
        described = WeightwireError(Reason.TRAINER_RANK_LOST, message, **metadata)
        self.__dict__.update(described.__dict__)
        PushError.__init__(self, {})
        self.args = (str(self),)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, *, group: Any, async_op: bool) -> Any:
    """``all_gather_single`` (torch >= 2.13), or its older name ``all_gather_into_tensor``."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


@functools.cache
def _dtensor_type() -> type | None:
    # Looked up once: an import statement per tensor is a dict lookup under the import lock, twice
    # per tensor per push, which a model of hundreds of tensors notices.
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed support
        return None
    return DTensor


def is_dtensor(t: object) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def named_items(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    """A mapping (``state_dict()``), ``(name, tensor)`` pairs or a generator (``named_parameters()``)
    as a list of pairs. Only references are kept: no tensor is copied or gathered here."""
    return named_items_and_dtensors(named_tensors)[0]


def named_items_and_dtensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
) -> tuple[list[tuple[str, torch.Tensor]], bool]:
    """``named_items``, and whether any of them is a DTensor (``has_dtensors``), in one pass."""
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    out: list[tuple[str, torch.Tensor]] = []
    dtensor = _dtensor_type()
    found = False
    for item in pairs:
        try:
            name, t = item
        except (TypeError, ValueError):
            raise TypeError(
                f"push takes a mapping of name -> tensor or (name, tensor) pairs; got an item of type {type(item).__name__}"
            ) from None
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(
                f"push takes (name, tensor) pairs; got ({type(name).__name__}, {type(t).__name__})"
            )
        if dtensor is not None and not found and isinstance(t, dtensor):
            found = True
        out.append((name, t))
    return out, found


def has_dtensors(items: Iterable[tuple[str, torch.Tensor]]) -> bool:
    cls = _dtensor_type()
    return cls is not None and any(isinstance(t, cls) for _, t in items)


def target_dtype(dtype: torch.dtype, cast_to: CastTo) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is sent as under ``cast_to``."""
    if cast_to is None:
        return dtype
    if isinstance(cast_to, torch.dtype):
        return cast_to if dtype.is_floating_point else dtype
    return cast_to.get(dtype, dtype)


def check_cast_to(cast_to: CastTo) -> None:
    if cast_to is None:
        return
    if not isinstance(cast_to, torch.dtype | Mapping):
        raise TypeError(
            f"cast_to takes a torch.dtype or a mapping of torch.dtype -> torch.dtype, not {cast_to!r}"
        )
    targets = [cast_to] if isinstance(cast_to, torch.dtype) else list(cast_to.values())
    keys = [] if isinstance(cast_to, torch.dtype) else list(cast_to.keys())
    for d in [*targets, *keys]:
        if not isinstance(d, torch.dtype):
            raise TypeError(
                f"cast_to takes a torch.dtype or a mapping of torch.dtype -> torch.dtype, not {d!r}"
            )
    if isinstance(cast_to, torch.dtype) and not cast_to.is_floating_point:
        raise ValueError(
            f"cast_to={cast_to} converts floating-point tensors, so it must be a floating-point dtype"
        )
    fp8 = [d for d in targets if d.itemsize == 1 and d.is_floating_point]
    if fp8:
        # A plain cast to FP8 has no scales: the engine's kernels would read unscaled bytes.
        raise ValueError(
            f"cast_to={fp8[0]} would send FP8 bytes without their scales; quantise with "
            "weightwire.core.fp8_quant.quantize_for(named_tensors, pusher.manifests().values()), "
            "which makes each weight's scales too (docs/sglang.md, FP8)"
        )


def spec_of(name: str, t: torch.Tensor, cast_to: CastTo = None) -> TensorSpec:
    """The checkpoint-level description of ``t``: its full (global) shape even for a DTensor shard."""
    return TensorSpec(name, target_dtype(t.dtype, cast_to), tuple(int(d) for d in t.shape))


def local_device(t: torch.Tensor) -> torch.device:
    """Where ``t``'s bytes are on this rank (a DTensor's local shard), e.g. ``cuda:0`` or ``cpu``."""
    if is_dtensor(t):
        return t.to_local().device  # type: ignore[attr-defined, no-any-return]
    return t.device


def source_device(items: Iterable[tuple[str, torch.Tensor]]) -> torch.device:
    """The first non-CPU device among the tensors' local bytes, else the CPU."""
    return next((d for d in (local_device(t) for _, t in items) if d.type != "cpu"), torch.device("cpu"))


def default_group(items: Iterable[tuple[str, torch.Tensor]]) -> Any:
    """The process group every rank holding a shard of these DTensors belongs to: the device mesh's
    group for a 1-D mesh (FSDP2's usual ``fully_shard`` mesh), the default group when the meshes cover
    the whole world (HSDP's 2-D mesh); otherwise the caller must name one (``group=``)."""
    import torch.distributed as dist

    meshes = {id(t.device_mesh): t.device_mesh for _, t in items if is_dtensor(t)}  # type: ignore[attr-defined]
    if not meshes:
        return None
    if len(meshes) == 1:
        mesh = next(iter(meshes.values()))
        if mesh.ndim == 1:
            return mesh.get_group()
    world = dist.get_world_size()
    if all(m.size() == world for m in meshes.values()):
        return dist.group.WORLD
    raise ValueError(
        "these DTensors live on several device meshes (or on a multi-dimensional mesh smaller than the world); "
        "pass group= naming the process group of every trainer rank that calls push"
    )


def single_rank_items(
    items: list[tuple[str, torch.Tensor]], group: Any
) -> list[tuple[str, torch.Tensor]] | None:
    """The tensors as plain local tensors when the update has one trainer rank (``group`` of one
    member, or DTensors whose meshes all have one device), else None.

    With one rank there is nothing to agree on and nothing to gather: a DTensor on a one-device mesh
    holds its full value locally (FSDP2's shard of a one-rank mesh is the whole parameter), so the
    update takes the single-process push and its fast paths instead of the per-bucket lockstep of
    ``collective_push``. Anything that is not whole locally (padding, a Partial placement) is
    resolved with ``full_tensor()``, which on one rank moves no bytes between processes.
    """
    import torch.distributed as dist

    if group is not None:
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) != 1:
            return None
    elif any(is_dtensor(t) and t.device_mesh.size() != 1 for _, t in items):  # type: ignore[attr-defined]
        return None
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in items:
        if is_dtensor(t):
            local = t.to_local()  # type: ignore[attr-defined]
            full = local if tuple(local.shape) == tuple(t.shape) and not _partial(t) else t.full_tensor()  # type: ignore[attr-defined]
            out.append((name, full.detach()))
        else:
            out.append((name, t))
    return out


def _partial(t: Any) -> bool:
    return any(type(p).__name__ == "Partial" for p in t.placements)


class FullTensorWriter:
    """Writes tensors' full values, one at a time, into the caller's staging views.

    ``write(t, dst)`` must be called by every rank of each DTensor's mesh, in the same order (it is a
    collective); ``dst`` is this rank's view to fill (shape and dtype of the tensor's spec), or None on
    a rank that only takes part. Waits on the trainer's collectives end after ``timeout_s`` (gloo; a
    NCCL group has its own watchdog timeout) with ``RankLostError``.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout = datetime.timedelta(seconds=max(0.001, float(timeout_s)))

    def write(self, name: str, t: torch.Tensor, dst: torch.Tensor | None) -> None:
        with torch.no_grad():
            if not is_dtensor(t):
                if dst is not None:
                    dst.copy_(t.detach())
                return
            layout = _shard_layout(t)
            if layout is None:
                self._write_redistributed(name, t, dst)
            else:
                self._write_gathered(name, t, dst, *layout)

    def _write_redistributed(self, name: str, t: Any, dst: torch.Tensor | None) -> None:
        # Any other layout (Partial sums, several mesh dimensions, strided FSDP+TP shards): DTensor's
        # own redistribution, which has no deadline of ours (the process group's timeout applies).
        try:
            full = t.detach().full_tensor()
            if dst is not None:
                dst.copy_(full)
        except RuntimeError as e:
            raise _lost(name, e) from e

    def _write_gathered(
        self, name: str, t: Any, dst: torch.Tensor | None, dim: int | None, group: Any, world: int
    ) -> None:
        import torch.distributed as dist

        local = t.to_local().detach()
        full_shape = tuple(int(d) for d in t.shape)
        if dim is None:  # Replicate: this rank already holds the full value
            if dst is not None:
                dst.copy_(local)
            return
        n = full_shape[dim]
        chunk = -(-n // world)
        padded_shape = (*full_shape[:dim], chunk, *full_shape[dim + 1 :])
        if tuple(local.shape) == padded_shape and local.is_contiguous():
            send = local
        else:
            send = local.new_zeros(padded_shape)
            if local.numel():
                send.narrow(dim, 0, local.shape[dim]).copy_(local)
        direct = (
            dst is not None
            and dim == 0
            and n == chunk * world
            and dst.dtype == local.dtype
            and dst.is_contiguous()
        )
        out = dst if direct and dst is not None else local.new_empty((world, *padded_shape))
        try:
            work = all_gather_single(out.reshape(-1), send.reshape(-1), group=group, async_op=True)
            if dist.get_backend(group) == "gloo":
                work.wait(timeout=self.timeout)
            else:  # NCCL: stream-ordered; its watchdog bounds the wait
                work.wait()
        except RuntimeError as e:
            raise _lost(name, e) from e
        if direct or dst is None:
            return
        for i in range(world):
            start = i * chunk
            length = max(0, min(chunk, n - start))
            if length:
                dst.narrow(dim, start, length).copy_(out[i].narrow(dim, 0, length))


def _shard_layout(t: Any) -> tuple[int | None, Any, int] | None:
    """``(shard dim or None for Replicate, group, world size)`` for a DTensor on a
    1-D mesh with a plain ``Shard(d)`` or ``Replicate`` placement; None for anything else."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh
    if mesh.ndim != 1 or len(t.placements) != 1:
        return None
    p = t.placements[0]
    if type(p) is Shard:  # not a subclass such as _StridedShard (FSDP over TP)
        return (p.dim % t.ndim, mesh.get_group(), mesh.size())
    if type(p) is Replicate:
        return (None, mesh.get_group(), mesh.size())
    return None


def _lost(name: str, err: RuntimeError) -> RankLostError:
    text = str(err).splitlines()[0][:500] if str(err) else type(err).__name__
    return RankLostError(
        f"gathering {name} across the trainer's ranks failed ({text}): a rank died or did not take part in time. "
        "Nothing was committed on any worker; the process group is out of step, so restart the trainer's ranks.",
        tensor=name,
    )


__all__ = [
    "CastTo",
    "FullTensorWriter",
    "RankLostError",
    "all_gather_single",
    "check_cast_to",
    "default_group",
    "has_dtensors",
    "is_dtensor",
    "local_device",
    "named_items",
    "named_items_and_dtensors",
    "source_device",
    "spec_of",
    "target_dtype",
]
