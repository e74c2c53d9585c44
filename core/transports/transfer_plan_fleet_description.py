"""What ``weightwire plan`` reads: a fleet described as data (the trainer, the engine, the
network, optionally the delta update to predict), every field checked for its type and range
(``fleet_from``, ``FleetError`` naming the field), within bounds that keep planning it small.
Pure: no I/O. ``transfer_plan_fleet`` plans the ``Fleet`` this returns and re-exports all of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from weightwire.core.model_shapes import ModelShapes
from weightwire.v1 import weight_transfer_pb2 as pb

DTYPES = {
    "bf16": pb.DTYPE_BFLOAT16,
    "fp16": pb.DTYPE_FLOAT16,
    "fp32": pb.DTYPE_FLOAT32,
    "fp8": pb.DTYPE_FLOAT8_E4M3FN,
}
TRAINER_LAYOUTS = ("fsdp", "fsdp+tp", "single")


class FleetError(ValueError):
    """A description this module cannot plan (the message says which field and why)."""


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The trainer's ranks and how they hold the weights (the description's ``trainer`` table)."""

    gpus: int
    gpus_per_node: int = 8
    layout: str = "fsdp"
    """``fsdp``: every tensor ``Shard(0)`` over all ranks (experts over their EP group's ranks);
    ``fsdp+tp``: a (gpus / tp, tp) mesh, ``Shard(0)`` then the TP split of the tensor's layer;
    ``single``: rank 0 holds every tensor whole (one source, as a push from one process)."""
    tp: int = 1
    ep: int = 1


@dataclasses.dataclass(frozen=True)
class Engine:
    """The engine's parallel layout and the dtype it serves in (the ``engine`` table)."""

    tp: int
    pp: int = 1
    dp: int = 1
    ep: int = 1
    """Expert-parallel ranks among a stage's TP ranks (experts whole on ep ranks, each split over
    tp / ep ranks); 1: every expert split over all TP ranks."""
    gpus_per_node: int = 8
    dtype: str = "bf16"
    """What the engine serves: ``fp8`` holds linear weights in 8 bits (block scales not counted)."""


@dataclasses.dataclass(frozen=True)
class Network:
    """The links a transfer can take and what a message costs (the ``network`` table, optional)."""

    nic_gbit_per_s: float = 400.0
    """One NIC's rate in each direction (a GPU's traffic between nodes goes through NIC gpu mod nics_per_node)."""
    nics_per_node: int = 8
    nvlink_gbyte_per_s: float = 450.0
    message_latency_us: float = 10.0
    """Cost of one message on a port beyond its bytes (posting, completion, a round trip)."""
    bucket_mib: float = 256.0
    """The data plane packs what one source sends one destination into buckets of at most this
    size, one message each (weightwire's buckets), rather than one message per tensor region."""
    colocated: bool = False
    """Trainer and engine on the same nodes (transfers within a node over NVLink)."""


@dataclasses.dataclass(frozen=True)
class DeltaUpdate:
    """A delta update to predict next to the FULL one (the optional ``delta`` table)."""

    changed_fraction: float
    """The fraction of every tensor's elements changed since the base, from 0 to 1 (0.01: 1%)."""


@dataclasses.dataclass(frozen=True)
class Fleet:
    """One described fleet, checked: the model, both sides and the network between them."""

    model: ModelShapes
    """The model's tensors (names, shapes, layers, experts), read from its config."""
    trainer: Trainer
    engine: Engine
    network: Network
    model_dtype: str = "bf16"
    delta: DeltaUpdate | None = None
    """Set: predict a delta update at this changed fraction as well."""


# What ``weightwire plan`` takes. Past these a description is refused before anything is built: the
# planner lists every trainer rank, engine worker and port, so 10^9 of any would exhaust memory.
MAX_GPUS = 65_536
"""Most GPUs on either side (trainer ranks; engine TP x PP x DP)."""
MAX_GPUS_PER_NODE = 1024
MAX_PLAN_WORK = 30_000_000
"""Most (tensor classes) x (engine workers) x (trainer ranks sending) a plan may take: about 20 s
and 1 GB of planning; DeepSeek-V3 from 1024 FSDP ranks into 128 GPUs is 10^7."""
NETWORK_RANGES: Mapping[str, tuple[float, float]] = {
    "nic_gbit_per_s": (0.0, 1e6),
    "nvlink_gbyte_per_s": (0.0, 1e6),
    "message_latency_us": (0.0, 1e7),
    "bucket_mib": (0.0, float(1 << 20)),
}
"""(low, high) of each network number: bandwidths and bucket sizes > low, latency >= low; all <= high."""
_KINDS = {"int": "a whole number", "float": "a number", "str": "a string", "bool": "true or false"}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _typed(value: Any, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, str)


def fleet_from(description: Mapping[str, Any], model: ModelShapes) -> Fleet:
    """A ``Fleet`` from a parsed description (``trainer``, ``engine``, ``network`` tables). Every
    field is checked for its type and range here (``FleetError`` naming it), so planning and the
    prediction only ever see numbers they can use."""

    def table(cls: type, key: str, required: bool = True) -> Any:
        raw = description.get(key)
        if raw is None and not required:
            return cls()
        if not isinstance(raw, Mapping):
            raise FleetError(f"the description needs a {key!r} table")
        fields = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in set(raw) - set(fields))
        if unknown:
            raise FleetError(f"{key}: unknown field(s) {unknown}; known: {sorted(fields)}")
        for name, value in raw.items():
            if not _typed(value, fields[name]):
                raise FleetError(f"{key}.{name} must be {_KINDS[fields[name]]}, got {_shown(value)}")
        try:
            return cls(**raw)
        except TypeError as e:  # a required field left out
            raise FleetError(f"{key}: {e}") from None

    model_dtype = description.get("model_dtype", "bf16")
    if not isinstance(model_dtype, str):
        raise FleetError(f"model_dtype must be a string, got {_shown(model_dtype)}")
    delta = None
    if description.get("delta") is not None:
        # checked here, as ``table`` would say "needs a 'delta' table" of a table that is optional
        if not isinstance(description["delta"], Mapping):
            raise FleetError(f"delta must be a table (changed_fraction), got {_shown(description['delta'])}")
        delta = table(DeltaUpdate, "delta")
        checked_changed_fraction(delta.changed_fraction, "delta.changed_fraction")
    fleet = Fleet(
        model,
        table(Trainer, "trainer"),
        table(Engine, "engine"),
        table(Network, "network", False),
        model_dtype,
        delta,
    )
    _check(fleet)
    return fleet


def checked_changed_fraction(value: Any, what: str) -> float:
    """``value`` as a changed fraction (a finite number from 0 to 1), or ``FleetError`` naming
    ``what``: the ``delta`` table and the command line's ``--changed-fraction`` share this rule."""
    if not (_typed(value, "float") and 0 <= value <= 1):
        raise FleetError(f"{what} must be a number from 0 to 1 (0.01: 1% changed), got {_shown(value)}")
    return float(value)


def _check(f: Fleet) -> None:
    t, e, m, n = f.trainer, f.engine, f.model, f.network
    if t.layout not in TRAINER_LAYOUTS:
        raise FleetError(f"trainer.layout {t.layout!r}: one of {TRAINER_LAYOUTS}")
    for what, value, high in (
        ("trainer.gpus", t.gpus, MAX_GPUS),
        ("trainer.gpus_per_node", t.gpus_per_node, MAX_GPUS_PER_NODE),
        ("trainer.tp", t.tp, MAX_GPUS),
        ("trainer.ep", t.ep, MAX_GPUS),
        ("engine.tp", e.tp, MAX_GPUS),
        ("engine.pp", e.pp, MAX_GPUS),
        ("engine.dp", e.dp, MAX_GPUS),
        ("engine.ep", e.ep, MAX_GPUS),
        ("engine.gpus_per_node", e.gpus_per_node, MAX_GPUS_PER_NODE),
        ("network.nics_per_node", n.nics_per_node, MAX_GPUS_PER_NODE),
    ):
        if not 1 <= value <= high:
            raise FleetError(f"{what} must be a whole number from 1 to {high:,}, got {value!r}")
    if e.tp * e.pp * e.dp > MAX_GPUS:
        raise FleetError(
            f"engine TP{e.tp} x PP{e.pp} x DP{e.dp} is {e.tp * e.pp * e.dp:,} GPUs, over the {MAX_GPUS:,} planned"
        )
    for name, (low, top) in NETWORK_RANGES.items():
        number: float = getattr(n, name)
        floor_ok = number >= low if name == "message_latency_us" else number > low
        if not (floor_ok and number <= top):
            bound = ">= 0" if name == "message_latency_us" else "> 0"
            raise FleetError(f"network.{name} must be {bound} and at most {top:g}, got {number!r}")
    if n.bucket_mib * (1 << 20) < 1:
        raise FleetError(f"network.bucket_mib {n.bucket_mib!r} is less than one byte")
    if t.gpus % t.tp or t.gpus % t.ep:
        raise FleetError(f"trainer.gpus {t.gpus} is not divisible by trainer.tp {t.tp} and trainer.ep {t.ep}")
    if t.layout == "fsdp+tp" and (t.gpus // t.ep) % t.tp:
        raise FleetError(
            f"trainer.gpus {t.gpus} over trainer.ep {t.ep} groups leaves {t.gpus // t.ep} ranks per group, "
            f"not divisible by trainer.tp {t.tp}"
        )
    if e.tp % e.ep:
        raise FleetError(f"engine.ep {e.ep} must divide engine.tp {e.tp}")
    if m.num_experts and (m.num_experts % e.ep or m.num_experts % t.ep):
        raise FleetError(f"{m.num_experts} experts do not split over engine.ep {e.ep} / trainer.ep {t.ep}")
    if e.pp > m.num_layers:
        raise FleetError(f"engine.pp {e.pp} exceeds the model's {m.num_layers} layers")
    for what, dtype in (("engine.dtype", e.dtype), ("model_dtype", f.model_dtype)):
        if dtype not in DTYPES:
            raise FleetError(f"{what} {dtype!r}: one of {sorted(DTYPES)}")
