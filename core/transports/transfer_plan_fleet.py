"""A fleet that does not fit here, described as data, planned with the transfer planner, and the
time of one update predicted from the plan's bytes per link (``weightwire plan``). Pure: no I/O.

A description names the model (its config), the trainer (GPUs per node and how its ranks hold the
weights), the engine (TP x PP x DP, expert parallelism, the dtype it serves in) and the network (NIC
and NVLink bandwidths, a per-message cost); ``transfer_plan_fleet_description`` reads and checks
it. From it this module builds what a real push would have:
each trainer rank's holdings (``transfer_plan.TensorSpec``) and each engine worker's manifest with
its slice geometry (the engines' own per-layer rules, ``adapters.layer_geometry``), and runs
``transfer_plan.plan_transfers`` on them, the code a push uses.

A 1T-parameter model has ~70,000 expert tensors; tensors that are the same to the plan (same shape,
dtype and split, same stage, same expert-parallel owner on both sides) are planned once and
counted as many times as there are of them, which changes no byte of the tally.

The prediction (``predict``): every transfer is point to point from its source GPU to each
destination GPU; within a node it uses NVLink, across nodes the source's NIC and the destination's
NIC (rail-aligned: GPU i of a node uses NIC i mod nics_per_node); every source sends at once; the
update takes as long as the busiest port, ``max over ports of bytes / bandwidth + messages x
per-message latency``, each NIC and NVLink port counted per direction, a message being one bucket
(what one source sends one destination, packed in buckets of ``bucket_mib``, as weightwire's
buckets are). Not in it: the trainer's
own gathers and dtype conversion (a BF16 trainer quantizing to an FP8 engine), the engine's load,
the control plane, congestion inside the fabric. A delta update of the same plan is predicted by
the same model over its encoded bytes in ``transfer_plan_fleet_delta``.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from weightwire.core import layer_geometry
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest, TensorPiece
from weightwire.core.model_shapes import ModelTensor
from weightwire.core.topology import pp_layer_span
from weightwire.core.transports.transfer_plan import (
    Replicate,
    Shard,
    TensorSpec,
    Transfer,
    TransferPlan,
    plan_transfers,
    whole_box,
)
from weightwire.core.transports.transfer_plan_fleet_description import (
    DTYPES,
    MAX_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_PLAN_WORK,
    NETWORK_RANGES,
    TRAINER_LAYOUTS,
    DeltaUpdate,
    Engine,
    Fleet,
    FleetError,
    Network,
    Trainer,
    checked_changed_fraction,
    fleet_from,
)

__all__ = [
    "DTYPES",
    "MAX_GPUS",
    "MAX_GPUS_PER_NODE",
    "MAX_PLAN_WORK",
    "MODEL_STATEMENT",
    "NETWORK_RANGES",
    "TRAINER_LAYOUTS",
    "DeltaUpdate",
    "Engine",
    "Fleet",
    "FleetError",
    "FleetPlan",
    "Network",
    "Port",
    "Prediction",
    "Trainer",
    "checked_changed_fraction",
    "fleet_from",
    "kept_pieces",
    "plan_fleet",
    "predict",
    "worker_ids",
    "workers",
]


# --- workers: ids, places, slice geometry -----------------------------------------------------


def workers(e: Engine) -> list[tuple[str, int, int]]:
    """(worker id, pipeline stage, TP rank) of every engine worker, in the order of their GPUs
    (replica, then stage, then TP rank)."""
    return [(f"dp{d}-pp{p}-tp{t}", p, t) for d in range(e.dp) for p in range(e.pp) for t in range(e.tp)]


def worker_ids(e: Engine) -> list[str]:
    return [w for w, _, _ in workers(e)]


def _stages_of(t: ModelTensor, f: Fleet) -> tuple[int, ...]:
    """The pipeline stages holding ``t`` (a tied embedding: the first and the last)."""
    e, m = f.engine, f.model
    if t.layer is not None:
        return (bisect.bisect_right(_stage_starts(m.num_layers, e.pp), t.layer) - 1,)
    if t.name.startswith("model.embed_tokens."):
        return (0, e.pp - 1) if m.tied and e.pp > 1 else (0,)
    return (e.pp - 1,)


@functools.cache
def _stage_starts(num_layers: int, pp: int) -> tuple[int, ...]:
    """The first layer of each pipeline stage (stages hold consecutive layers, in order)."""
    return tuple(pp_layer_span(num_layers, p, pp).start for p in range(pp))


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """The sizes a parallel layer records (SGLang's and vLLM's attribute names), for a layer that
    exists only as a config: ``layer_geometry`` computes slices from these as from a real layer."""

    output_size: int
    input_size: int
    output_size_per_partition: int = 0
    input_size_per_partition: int = 0
    head_size: int = 0
    v_head_size: int = 0
    total_num_heads: int = 0
    total_num_kv_heads: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    num_kv_head_replicas: int = 1


def _divide(n: int, by: int, what: str) -> int:
    if n % by:
        raise FleetError(f"{what}: {n} does not split over {by} ranks")
    return n // by


def kept_pieces(t: ModelTensor, f: Fleet, tp_rank: int) -> tuple[TensorPiece, ...] | None:
    """What TP rank ``tp_rank`` of the tensor's stage keeps of ``t`` (None: nothing)."""
    e, m = f.engine, f.model
    tp, rank = e.tp, tp_rank
    if t.expert is not None:
        moe_tp = e.tp // e.ep
        if t.expert // (m.num_experts // e.ep) != tp_rank // moe_tp:
            return None
        tp, rank = moe_tp, tp_rank % moe_tp
    if tp == 1 or t.split == "replicated":
        return ()
    out, inp = t.shape[0], t.shape[-1]
    if t.split == "column":
        sizes = _Sizes(out, inp, output_size_per_partition=_divide(out, tp, t.name))
        return layer_geometry.column(sizes, "weight" if len(t.shape) == 2 else "bias", rank).feeds[0].pieces
    if t.split == "row":
        sizes = _Sizes(out, inp, input_size_per_partition=_divide(inp, tp, t.name))
        return layer_geometry.row(sizes, "weight" if len(t.shape) == 2 else "bias", rank).feeds[0].pieces
    if t.split in ("q", "kv"):
        kv, heads = m.num_kv_heads, m.num_heads
        if (tp % kv if tp >= kv else kv % tp) or heads % tp:
            raise FleetError(f"{t.name}: {heads} heads and {kv} k/v heads do not split over {tp} ranks")
        replicas = tp // kv if tp >= kv else 1
        sizes = _Sizes(
            out,
            inp,
            head_size=m.head_dim,
            v_head_size=m.head_dim,
            total_num_heads=heads,
            total_num_kv_heads=kv,
            num_heads=_divide(heads, tp, t.name),
            num_kv_heads=max(1, kv // tp),
            num_kv_head_replicas=replicas,
        )
        feeds = layer_geometry.qkv(sizes, "weight" if len(t.shape) == 2 else "bias", rank, rank).feeds
        return feeds[0 if t.split == "q" else 1].pieces
    if t.split == "vocab":
        # Even rows per rank, the last ones short (engines pad the vocabulary to make it even).
        step = -(-out // tp)
        start = min(rank * step, out)
        length = min(step, out - start)
        return None if length < 1 else (() if length == out else (TensorPiece(0, start, length),))
    raise FleetError(f"{t.name}: unknown split {t.split!r}")


# --- trainer holdings ------------------------------------------------------------------------


def _trainer_spec(t: ModelTensor, f: Fleet, dtype: int) -> TensorSpec:
    tr, m = f.trainer, f.model
    if tr.layout == "single":
        return TensorSpec(t.name, t.shape, dtype, {0: whole_box(t.shape)})
    if t.expert is not None and tr.ep > 1:
        group = t.expert // (m.num_experts // tr.ep)
        size = tr.gpus // tr.ep
        ranks = range(group * size, (group + 1) * size)
    else:
        ranks = range(tr.gpus)
    if tr.layout == "fsdp" or tr.tp == 1:
        return TensorSpec.dtensor(t.name, t.shape, dtype, (len(ranks),), [Shard(0)], list(ranks))
    tp_dim = {
        "column": Shard(0),
        "q": Shard(0),
        "kv": Shard(0),
        "vocab": Shard(0),
        "row": Shard(len(t.shape) - 1),
    }
    placement = tp_dim.get(t.split, Replicate())
    return TensorSpec.dtensor(
        t.name, t.shape, dtype, (len(ranks) // tr.tp, tr.tp), [Shard(0), placement], list(ranks)
    )


# --- the plan --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FleetPlan:
    fleet: Fleet
    plan: TransferPlan
    counts: Mapping[str, int]
    """Representative tensor name -> how many model tensors it stands for."""

    def total_bytes(self) -> int:
        return sum(t.nbytes * len(t.destinations) * self.counts[t.tensor] for t in self.plan.transfers)


def _dtype_of(t: ModelTensor, f: Fleet) -> int:
    if f.engine.dtype == "fp8" and t.linear and len(t.shape) == 2:
        return DTYPES["fp8"]
    return DTYPES[f.model_dtype if f.engine.dtype == "fp8" else f.engine.dtype]


def plan_fleet(f: Fleet) -> FleetPlan:
    """Plan one update of the whole model on ``f`` (see the module docstring)."""
    e, tr, m = f.engine, f.trainer, f.model
    classes: dict[tuple[Any, ...], ModelTensor] = {}
    counts: dict[str, int] = {}
    for t in m.tensors:
        engine_ep = None if t.expert is None else t.expert // (m.num_experts // e.ep)
        trainer_ep = None if t.expert is None or tr.ep == 1 else t.expert // (m.num_experts // tr.ep)
        key = (t.shape, t.split, t.linear, _stages_of(t, f), engine_ep, trainer_ep, t.expert is not None)
        rep = classes.setdefault(key, t)
        counts[rep.name] = counts.get(rep.name, 0) + 1
    # Each class is cut at every sending rank's boundary for every worker that keeps it: bound that
    # before planning, as the planner's memory and time grow with it.
    senders = 1 if tr.layout == "single" else tr.gpus
    work = len(classes) * e.tp * e.pp * e.dp * senders
    if work > MAX_PLAN_WORK:
        raise FleetError(
            f"{len(classes):,} tensor classes x {e.tp * e.pp * e.dp:,} engine workers x {senders:,} trainer ranks "
            f"is {work:,}, over the {MAX_PLAN_WORK:,} one plan may take; plan fewer replicas (engine.dp: "
            "every replica receives the same bytes) or fewer trainer ranks"
        )

    owned: dict[str, list[OwnedTensor]] = {w: [] for w in worker_ids(e)}
    specs = []
    for rep in classes.values():
        dtype = _dtype_of(rep, f)
        specs.append(_trainer_spec(rep, f, dtype))
        stages = _stages_of(rep, f)
        for w, stage, tp_rank in workers(e):
            if stage not in stages:
                continue
            pieces = kept_pieces(rep, f, tp_rank)
            if pieces is not None:
                owned[w].append(OwnedTensor(rep.name, dtype, rep.shape, pieces))
    host = DeviceRef.host("00000000-0000-0000-0000-000000000000")
    manifests = {
        w: ShardManifest.build(host, ParallelRank(), tensors, worker_id=w, instance_id=w)
        for w, tensors in owned.items()
    }
    return FleetPlan(f, plan_transfers(specs, manifests), counts)


# --- the prediction --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Port:
    """One direction of one NIC or one GPU's NVLink: ``("nic", node, index, "tx")``."""

    kind: str
    node: str
    index: int
    direction: str

    def __str__(self) -> str:
        return f"{self.node} {self.kind}{self.index} {self.direction}"


@dataclasses.dataclass(frozen=True)
class Prediction:
    seconds: float
    bottleneck: Port
    port_bytes: Mapping[Port, int]
    port_messages: Mapping[Port, int]
    bytes_to_worker: Mapping[str, int]
    bytes_from_rank: Mapping[int, int]
    total_bytes: int
    model: str


MODEL_STATEMENT = (
    "time = max over ports (each NIC and each GPU's NVLink, per direction) of bytes / bandwidth "
    "+ messages x per-message latency, a message being one bucket (what one source sends one "
    "destination, in buckets of bucket_mib); point to point (a region k workers need is sent k times), "
    "every source at once, NICs rail-aligned (GPU i uses NIC i mod nics_per_node); not included: "
    "the trainer's gathers and dtype conversion, the engine's load, the control plane, fabric congestion"
)


def predict(
    fp: FleetPlan, wire_bytes: Callable[[Transfer], int] | None = None, model: str = MODEL_STATEMENT
) -> Prediction:
    """The time of one update of ``fp`` by the model ``MODEL_STATEMENT`` states. ``wire_bytes``: what
    one tensor's region of a transfer takes on the wire, to each destination; by default its bytes
    whole (a FULL update). The delta prediction (``transfer_plan_fleet_delta``) passes the encoded
    size instead, so both updates are timed by this one model; ``model`` is the statement it reports."""
    f = fp.fleet
    n = f.network
    e_gpn, t_gpn = f.engine.gpus_per_node, f.trainer.gpus_per_node
    ids = worker_ids(f.engine)
    place = {w: i for i, w in enumerate(ids)}

    def trainer_at(rank: int) -> tuple[str, int]:
        return (f"node{rank // t_gpn}" if n.colocated else f"train{rank // t_gpn}"), rank % t_gpn

    def worker_at(w: str) -> tuple[str, int]:
        i = place[w]
        return (f"node{i // e_gpn}" if n.colocated else f"infer{i // e_gpn}"), i % e_gpn

    port_bytes: dict[Port, int] = {}
    port_msgs: dict[Port, int] = {}
    to_worker: dict[str, int] = {}
    from_rank: dict[int, int] = {}

    def add(port: Port, nbytes: int, msgs: int) -> None:
        port_bytes[port] = port_bytes.get(port, 0) + nbytes
        port_msgs[port] = port_msgs.get(port, 0) + msgs

    pairs: dict[tuple[int, str], int] = {}
    for t in fp.plan.transfers:
        nbytes = (t.nbytes if wire_bytes is None else wire_bytes(t)) * fp.counts[t.tensor]
        for w in t.destinations:
            pairs[t.source, w] = pairs.get((t.source, w), 0) + nbytes
    bucket = max(1, int(n.bucket_mib * (1 << 20)))
    for (source, w), nbytes in sorted(pairs.items()):
        if nbytes == 0:  # a delta with nothing changed for this pair: no bucket, no sender, no port
            continue
        msgs = -(-nbytes // bucket)
        to_worker[w] = to_worker.get(w, 0) + nbytes
        from_rank[source] = from_rank.get(source, 0) + nbytes
        src_node, src_gpu = trainer_at(source)
        dst_node, dst_gpu = worker_at(w)
        if dst_node == src_node:
            if dst_gpu != src_gpu:
                add(Port("nvlink", src_node, src_gpu, "tx"), nbytes, msgs)
                add(Port("nvlink", dst_node, dst_gpu, "rx"), nbytes, msgs)
        else:
            add(Port("nic", src_node, src_gpu % n.nics_per_node, "tx"), nbytes, msgs)
            add(Port("nic", dst_node, dst_gpu % n.nics_per_node, "rx"), nbytes, msgs)

    nic_bw = n.nic_gbit_per_s * 1e9 / 8
    nvl_bw = n.nvlink_gbyte_per_s * 1e9

    def seconds(port: Port) -> float:
        bw = nic_bw if port.kind == "nic" else nvl_bw
        return port_bytes[port] / bw + port_msgs[port] * n.message_latency_us * 1e-6

    bottleneck = max(sorted(port_bytes, key=str), key=seconds) if port_bytes else Port("none", "", 0, "")
    return Prediction(
        seconds=seconds(bottleneck) if port_bytes else 0.0,
        bottleneck=bottleneck,
        port_bytes=port_bytes,
        port_messages=port_msgs,
        bytes_to_worker=to_worker,
        bytes_from_rank=from_rank,
        total_bytes=sum(pairs.values()),
        model=model,
    )
