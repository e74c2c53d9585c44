"""Engine adapter for any ``torch.nn.Module`` whose parameter names are checkpoint names.

Used by ``weightwire serve --model demo``, by tests and by anyone who serves a plain PyTorch model.
The module's parameters ARE the shard: a parameter matched by a ``TPRule`` holds slice ``tp_rank``
of one dimension of the full checkpoint tensor, every other parameter is replicated. With
``num_layers`` set, only the parameters of this pipeline stage (``core.topology``) are published.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
from weightwire.adapters.torch.delta_pieces import apply_to_piece
from weightwire.core import dtypes
from weightwire.core.delta import Delta, apply_delta
from weightwire.core.devices import DeviceRef, device_ref_of
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest, TensorPiece, transports_for
from weightwire.core.topology import pp_layer_span, stage_owns, tp_slice_bounds

__all__ = [
    "DEFAULT_COPY_STREAMS",
    "DEFAULT_GROUP_COPY_MAX_BYTES",
    "TPRule",
    "TorchAdapter",
    "default_worker_id",
    "shard_tensor",
    "tp_split_dim",
]

# Parameters of at most this many bytes are copied together, in one grouped launch per bucket
# (``torch._foreach_copy_``); larger ones get one ``copy_`` each. A copy launch costs the host a few
# microseconds whatever its size, so a model's hundreds of norms and biases cost more in launches
# than in bytes; but a grouped copy moves large tensors slower than plain copies do, so large ones
# stay separate. The threshold is measured (bench/copy_group.py; the figures are in BENCHMARKS.md,
# "Worker copy").
DEFAULT_GROUP_COPY_MAX_BYTES = 16 << 20

GroupCopy = Callable[[list[torch.Tensor], list[torch.Tensor]], None]


# How many CUDA streams the large copies of one load are spread over. A copy leaves the device
# partly idle as it ends, and the next on the same stream starts only after it; copies on two
# streams overlap those ends. Two is what measured best (bench/copy_group.py, bench_gpu.py
# --copy-streams; the figures are in BENCHMARKS.md); more streams gained nothing further.
DEFAULT_COPY_STREAMS = 2


def _spread(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], start_bytes: list[int]
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``pairs`` (destination, source) dealt in order over one list per lane, each to the lane
    with the fewest bytes so far (lane i starts with ``start_bytes[i]``)."""
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in start_bytes]
    loads = list(start_bytes)
    for pair in pairs:
        i = loads.index(min(loads))
        out[i].append(pair)
        loads[i] += pair[0].numel() * pair[0].element_size()
    return out


def _copy_each(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


# ``torch._foreach_copy_`` (torch >= 2.2); copying one by one does the same where it is missing.
_GROUP_COPY: GroupCopy = getattr(torch, "_foreach_copy_", None) or _copy_each


class TPRule(NamedTuple):
    """Parameters whose name matches ``pattern`` (``re.search``) are split over TP ranks along ``dim``."""

    pattern: str
    dim: int


def tp_split_dim(name: str, rules: Sequence[TPRule]) -> int | None:
    """The dimension ``name`` is split along under tensor parallelism, or None if replicated."""
    for rule in rules:
        if re.search(rule.pattern, name):
            return rule.dim
    return None


def shard_tensor(name: str, full: torch.Tensor, rank: ParallelRank, rules: Sequence[TPRule]) -> torch.Tensor:
    """The part of the full checkpoint tensor that ``rank`` holds (a view; no copy)."""
    dim = tp_split_dim(name, rules)
    if dim is None or rank.tp_size == 1:
        return full
    start, end = tp_slice_bounds(full.shape[dim], rank.tp_rank, rank.tp_size)
    return full.narrow(dim, start, end - start)


class _LoadPlan(NamedTuple):
    """How one parameter is loaded, worked out once at construction: the parameter, the split
    dimension (None: replicated) with its full size and this rank's start and length, and whether
    it is small enough to be copied in the bucket's grouped launch."""

    param: torch.nn.Parameter
    dim: int | None
    full_size: int
    start: int
    length: int
    grouped: bool


def default_worker_id(rank: ParallelRank) -> str:
    """Stable readable worker name: ``tp0-pp1`` plus ``-dp0``/``-sp1`` when those sizes exceed 1."""
    return "-".join(f"{axis}{r}" for axis, r, _ in rank.shown_axes())


class TorchAdapter:
    """``EngineAdapter`` over an ``nn.Module``: publishes its parameters, copies full tensors in."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        rank: ParallelRank,
        device: torch.device,
        own_device: DeviceRef | None,
        tp_rules: Sequence[TPRule] = (),
        num_layers: int = 0,
        engine: str = "torch",
        worker_id: str | None = None,
        group_copy_max_bytes: int = DEFAULT_GROUP_COPY_MAX_BYTES,
        copy_streams: int = DEFAULT_COPY_STREAMS,
    ) -> None:
        if group_copy_max_bytes < 0:
            raise ValueError(
                f"group_copy_max_bytes must be >= 0 (0: no grouped copies), got {group_copy_max_bytes}"
            )
        if copy_streams < 1:
            raise ValueError(f"copy_streams must be >= 1, got {copy_streams}")
        self.module = module
        self.rank = rank
        self.device = torch.device(device)
        self.own_device = own_device if own_device is not None else device_ref_of(self.device)
        self.tp_rules = tuple(tp_rules)
        self.num_layers = num_layers
        self.engine = engine
        self.worker_id = worker_id or default_worker_id(rank)
        self.instance_id = uuid.uuid4().hex
        self.span = pp_layer_span(num_layers, rank.pp_rank, rank.pp_size) if num_layers > 0 else None
        self.group_copy_max_bytes = group_copy_max_bytes
        # Side streams for the large copies (CUDA only), made once: see DEFAULT_COPY_STREAMS.
        self._side_streams = (
            [torch.cuda.Stream(self.device) for _ in range(copy_streams - 1)]
            if self.device.type == "cuda"
            else []
        )
        self._params: dict[str, torch.nn.Parameter] = {}
        # Each parameter's load plan, worked out once, so loading does no name matching per tensor.
        self._plans: dict[str, _LoadPlan] = {}
        owned: list[OwnedTensor] = []
        for name, param in module.named_parameters():
            if self.span is not None and not stage_owns(name, self.span, rank.pp_rank, rank.pp_size):
                continue
            self._params[name] = param
            full_shape = self._full_shape(name, param)
            dim = tp_split_dim(name, self.tp_rules) if rank.tp_size > 1 else None
            grouped = param.numel() * param.element_size() <= group_copy_max_bytes
            if dim is None:
                self._plans[name] = _LoadPlan(param, None, 0, 0, 0, grouped)
                pieces: tuple[TensorPiece, ...] = ()
            else:
                start, end = tp_slice_bounds(full_shape[dim], rank.tp_rank, rank.tp_size)
                self._plans[name] = _LoadPlan(param, dim, full_shape[dim], start, end - start, grouped)
                # The manifest states the slice the load below keeps, from the same plan.
                pieces = (TensorPiece(dim, start, end - start),)
            owned.append(OwnedTensor(name, dtypes.from_torch(param.dtype), full_shape, pieces))
        self._manifest = ShardManifest.build(
            self.own_device,
            rank,
            owned,
            layer_start=self.span.start if self.span else 0,
            layer_end=self.span.end if self.span else 0,
            num_layers=num_layers,
            engine=engine,
            worker_id=self.worker_id,
            transports=transports_for(self.own_device),
            instance_id=self.instance_id,
        )

    def _full_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        shape = list(param.shape)
        dim = tp_split_dim(name, self.tp_rules)
        if dim is not None:
            shape[dim] *= self.rank.tp_size
        return tuple(shape)

    # --- EngineAdapter -------------------------------------------------------------------------

    def manifest(self) -> ShardManifest:
        return self._manifest

    def begin_update(self, version: int) -> None:
        pass

    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor's slice into its parameter; every shape is checked before anything is
        written. Small parameters are copied in one grouped launch, large ones one by one, all on
        the current stream; returns once the copies finished on the device."""
        self.prepare_load(named_tensors)()

    def prepare_load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Callable[[], None]:
        """``load``'s checks and slicing now, its copies when the returned function is called (as
        often as wanted: each call copies what the tensors hold then). The worker keeps it for views
        it reuses across updates (a kept CUDA IPC mapping), so the per-tensor work is done once."""
        grouped_dst: list[torch.Tensor] = []
        grouped_src: list[torch.Tensor] = []
        each: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, full in named_tensors:
            # The same slice shard_tensor takes, from the plan made at construction.
            plan = self._plans[name]
            param = plan.param
            if plan.dim is None:
                part = full
            elif full.dim() > plan.dim and full.shape[plan.dim] == plan.full_size:
                part = full.narrow(plan.dim, plan.start, plan.length)
            else:  # not the manifest's shape (a direct caller): slice as shard_tensor does
                part = shard_tensor(name, full, self.rank, self.tp_rules)
            if part.shape != param.shape:
                raise ValueError(
                    f"{name}: slice of shape {tuple(part.shape)} does not fit parameter of shape {tuple(param.shape)}"
                )
            if plan.grouped and part.dtype == param.dtype and part.device == param.device:
                grouped_dst.append(param)
                grouped_src.append(part)
            else:
                each.append((param, part))
        on_cuda = self.device.type == "cuda"
        # The large copies within this device spread over the side streams and the current one
        # (which also runs the grouped copy), by bytes; one from another GPU (a peer import) stays
        # on the current stream.
        local = [(d, p) for d, p in each if p.device == d.device]
        grouped_bytes = sum(d.numel() * d.element_size() for d in grouped_dst)
        lanes = _spread(local, [grouped_bytes] + [0] * len(self._side_streams))
        sides = [(st, lane) for st, lane in zip(self._side_streams, lanes[1:], strict=True) if lane]
        here = lanes[0] + [(d, p) for d, p in each if p.device != d.device]

        def copy() -> None:
            current = torch.cuda.current_stream(self.device) if on_cuda else None
            with torch.no_grad():
                for stream, lane in sides:
                    assert current is not None  # side streams exist on CUDA only
                    # What the current stream waited for (the sender's event) comes first there too.
                    stream.wait_stream(current)
                    with torch.cuda.stream(stream):
                        for dst, part in lane:
                            dst.copy_(part)
                for dst, part in here:
                    dst.copy_(part)
                if grouped_dst:
                    _GROUP_COPY(grouped_dst, grouped_src)
            if current is not None:
                for stream, _ in sides:
                    current.wait_stream(stream)
                # The service acks right after this returns; the sender may then reuse its buffer.
                # Every copy above ran on (or, across GPUs, was joined back into) the calling
                # thread's current stream of this device.
                current.synchronize()

        return copy

    def end_update(self, success: bool) -> None:
        pass

    def apply_deltas(self, deltas: Sequence[tuple[str, Delta]]) -> None:
        """``AppliesDeltas``: each delta of a full checkpoint tensor (checked by the service) written
        into its parameter in place, only the changes inside this rank's slice for a split one."""
        with torch.no_grad():
            for name, delta in deltas:
                plan = self._plans[name]
                kept = plan.param.detach()
                if plan.dim is None:
                    apply_delta(kept, delta, checked=True)
                else:
                    full = self._manifest.tensors[name].shape
                    apply_to_piece(kept, delta, tuple(full), plan.dim, plan.start, plan.length)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def delta_parts(self, name: str) -> Sequence[tuple[tuple[int, int, int] | None, torch.Tensor]]:
        """``AppliesDeltas``: the parameter, as the piece its manifest lists (or the whole tensor)."""
        plan = self._plans[name]
        piece = None if plan.dim is None else (plan.dim, plan.start, plan.length)
        return [(piece, plan.param.detach())]

    def kept_tensors(self) -> Mapping[str, torch.Tensor]:
        """``KeepsTensors``: each parameter is what this worker keeps of its checkpoint tensor (its TP
        slice, or the whole tensor), so an M-to-N update receives straight into it."""
        return {name: p.detach() for name, p in self._params.items()}

    # --- helpers for dumps and tests -----------------------------------------------------------

    def state(self) -> Mapping[str, torch.Tensor]:
        """This worker's local shard, by checkpoint name (live parameters; do not modify)."""
        return dict(self._params)
