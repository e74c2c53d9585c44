"""``weightwire plan TOPOLOGY``: plan one update of a described fleet and predict its time.

TOPOLOGY is a JSON or TOML file: ``model_config`` (a Hugging Face ``config.json``, relative to the
file) or an inline ``model`` table, ``trainer``, ``engine`` and ``network`` tables
(``core.transports.transfer_plan_fleet`` lists every field), and optionally ``name`` and
``published`` (``seconds``, ``source``) to print next to the prediction. Prints the bytes per link
and per NIC of the plan the transfer planner makes for it, the predicted time of one update and the
model behind the prediction; ``--json`` prints the same as one JSON object.

``--changed-fraction F`` (or a ``delta`` table with ``changed_fraction`` in the description; the
option wins) predicts a delta update as well, F of every tensor's elements changed (0.01: 1%): its
bytes per link in the encoding the trainer would choose at that density, its time by the same
model, and both as a fraction of the FULL update's (``core.transports.transfer_plan_fleet_delta``).

A description it cannot use (unreadable, nested past the parser, over 16 MiB, a field of the wrong
type, a zero, negative or NaN bandwidth or size, a changed fraction that is not a number from 0 to
1, a layout that does not split, a fleet or model past the bounds of ``transfer_plan_fleet`` and
``model_shapes``) exits 2 with one line naming the field; docs/plan.md lists every field and bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightwire.core.errors import WeightwireError
from weightwire.core.model_shapes import model_shapes
from weightwire.core.transports.transfer_plan_fleet import (
    Fleet,
    FleetError,
    FleetPlan,
    Prediction,
    checked_changed_fraction,
    fleet_from,
    plan_fleet,
    predict,
    worker_ids,
)

if TYPE_CHECKING:
    from weightwire.core.transports.transfer_plan_fleet_delta import DeltaPrediction


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="plan one update of a described fleet and predict its time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("topology", help="fleet description (.json or .toml)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--single-source",
        action="store_true",
        help="plan as if trainer rank 0 held every tensor whole (one source, the funnel)",
    )
    p.add_argument(
        "--changed-fraction",
        metavar="F",
        # a string, checked by the description's own rule: argparse's float() takes "nan" and its
        # refusals are a usage block, not the one line every other refusal of `plan` is
        help="predict a delta update too, F (0 to 1) of every tensor's elements changed; "
        "overrides the description's delta.changed_fraction",
    )
    p.set_defaults(func=run)


# A fleet description or a model config is a few KiB; reading more than this is not what was meant.
MAX_FILE_BYTES = 16 << 20


def _read_bounded(path: Path, what: str) -> bytes:
    with path.open("rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise FleetError(f"{what} {path}: larger than {MAX_FILE_BYTES >> 20} MiB, not a description")
    return data


def _parse(data: bytes, path: Path, what: str, *, toml: bool) -> Any:
    if toml:
        try:
            import tomllib  # Python >= 3.11
        except ImportError:
            raise FleetError(
                f"{path}: reading TOML needs Python 3.11 or later; give the description as JSON"
            ) from None
    try:
        return tomllib.loads(data.decode()) if toml else json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise FleetError(f"{what} {path}: not valid {'TOML' if toml else 'JSON'}: {e}") from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise FleetError(f"{what} {path}: nested too deeply to be a description") from None


def load_description(path: Path) -> dict[str, Any]:
    data = _parse(_read_bounded(path, "description"), path, "description", toml=path.suffix == ".toml")
    if not isinstance(data, dict):
        raise FleetError(f"{path}: the description must be a table/object")
    name = data.get("name", "")
    if not isinstance(name, str):
        raise FleetError(f"name must be a string, got {type(name).__name__}")
    published = data.get("published")
    if published is not None:
        if not isinstance(published, Mapping):
            raise FleetError(f"published must be a table (seconds, source), got {type(published).__name__}")
        seconds, source = published.get("seconds"), published.get("source", "")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float, str)):
            raise FleetError('published.seconds must be a number or a string (a range: "1.9-2.8")')
        if not isinstance(source, str):
            raise FleetError("published.source must be a string")
    return data


def changed_fraction_of(text: str) -> float:
    """The ``--changed-fraction`` argument as a number, by the rule of ``delta.changed_fraction``."""
    number: Any
    try:
        number = float(text)
    except ValueError:
        number = text  # not a number: refused by the same rule below, naming what was given
    return checked_changed_fraction(number, "--changed-fraction")


def fleet_of(
    path: Path, *, single_source: bool = False, changed_fraction: str | None = None
) -> tuple[dict[str, Any], Fleet]:
    description = load_description(path)
    if "model" in description:
        config = description["model"]
    elif "model_config" in description:
        relative = description["model_config"]
        if not isinstance(relative, str):
            raise FleetError(f"model_config must be a path (a string), got {type(relative).__name__}")
        config_path = path.parent / relative
        config = _parse(_read_bounded(config_path, "model_config"), config_path, "model_config", toml=False)
    else:
        raise FleetError(f"{path}: give the model as `model_config` (a config.json path) or a `model` table")
    if not isinstance(config, Mapping):
        raise FleetError("the model config must be an object")
    try:
        model = model_shapes(config)
    except ValueError as e:
        raise FleetError(str(e)) from None
    if single_source:
        trainer = description.get("trainer")
        if not isinstance(trainer, Mapping):
            raise FleetError("the description needs a 'trainer' table")
        description = {**description, "trainer": {**trainer, "layout": "single"}}
    if changed_fraction is not None:
        description = {**description, "delta": {"changed_fraction": changed_fraction_of(changed_fraction)}}
    return description, fleet_from(description, model)


def traffic(fp: FleetPlan, pred: Prediction) -> dict[str, Any]:
    """The bytes per worker, source and port of one predicted update, and its time: the same keys
    for the FULL update (at the top of the summary) and a delta one (under ``delta``)."""
    nic = {str(p): b for p, b in pred.port_bytes.items() if p.kind == "nic"}
    tx = [b for p, b in pred.port_bytes.items() if p.kind == "nic" and p.direction == "tx"]
    rx = [b for p, b in pred.port_bytes.items() if p.kind == "nic" and p.direction == "rx"]
    per_worker = [pred.bytes_to_worker.get(w, 0) for w in worker_ids(fp.fleet.engine)]
    per_rank = list(pred.bytes_from_rank.values())
    return {
        "total_bytes": pred.total_bytes,
        "bytes_per_worker": {"min": min(per_worker), "max": max(per_worker), "workers": len(per_worker)},
        "bytes_per_source": {
            "min": min(per_rank, default=0),
            "max": max(per_rank, default=0),
            "sources": len(per_rank),
            "trainer_ranks": fp.fleet.trainer.gpus,
        },
        "nic_tx": {"max": max(tx, default=0), "ports": len(tx)},
        "nic_rx": {"max": max(rx, default=0), "ports": len(rx)},
        "nvlink_bytes": sum(b for p, b in pred.port_bytes.items() if p.kind == "nvlink"),
        "bytes_per_nic": nic,
        "predicted_seconds": pred.seconds,
        "bottleneck": {
            "port": str(pred.bottleneck),
            "bytes": pred.port_bytes.get(pred.bottleneck, 0),
            "messages": pred.port_messages.get(pred.bottleneck, 0),
        },
    }


def summary(
    description: Mapping[str, Any], fp: FleetPlan, pred: Prediction, delta: DeltaPrediction | None = None
) -> dict[str, Any]:
    """The plan and its predicted FULL update; with ``delta``, the delta update under ``delta``
    (the keys of a run without it are exactly those of before deltas)."""
    f = fp.fleet
    out = {
        "name": description.get("name", ""),
        "model": {
            "family": f.model.family,
            "parameters": f.model.parameters(),
            "tensors": len(f.model.tensors),
        },
        "trainer": dataclasses.asdict(f.trainer),
        "engine": dataclasses.asdict(f.engine),
        "network": dataclasses.asdict(f.network),
        "plan": {
            "transfers": len(fp.plan.transfers),
            "tensor_classes": len(fp.counts),
            "fingerprint": fp.plan.fingerprint,
        },
        **traffic(fp, pred),
        "prediction_model": pred.model,
        "published": description.get("published"),
    }
    if delta is not None:
        out["delta"] = {
            "changed_fraction": delta.changed_fraction,
            **traffic(fp, delta.delta),
            "bytes_ratio": delta.bytes_ratio,
            "seconds_ratio": delta.seconds_ratio,
            "encodings": {
                name: {"regions": share.regions, "bytes": share.wire_bytes}
                for name, share in delta.encodings.items()
            },
            "prediction_model": delta.delta.model,
        }
    return out


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:,.3g} {unit}"
    return str(n)


def _nodes(gpus: int, per_node: int) -> str:
    n = -(-gpus // per_node)
    return f"{n} node" + ("s" if n != 1 else "")


def _gb(n: float) -> str:
    """Bytes in the largest decimal unit that keeps the value >= 1."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 0.1 else f"{s * 1e3:.3g} ms"


def _of_full(ratio: float | None) -> str:
    return "FULL sends nothing" if ratio is None else f"{100 * ratio:.3g}% of FULL"


def _render_delta(d: Mapping[str, Any]) -> list[str]:
    encodings = ", ".join(
        f"{name} {share['regions']:,} regions ({_gb(share['bytes'])})"
        for name, share in d["encodings"].items()
    )
    return [
        f"  delta     {100 * d['changed_fraction']:g}% of every tensor's elements changed (predicted, "
        f"not measured): {_gb(d['total_bytes'])} in all, {_of_full(d['bytes_ratio'])}; per worker "
        f"{_gb(d['bytes_per_worker']['min'])} - {_gb(d['bytes_per_worker']['max'])}",
        f"            encoded as {encodings or 'nothing'}",
        f"            NICs busiest send {_gb(d['nic_tx']['max'])}, busiest receive {_gb(d['nic_rx']['max'])}; "
        f"NVLink {_gb(d['nvlink_bytes'])}",
        f"            predicted {_seconds(d['predicted_seconds'])}, {_of_full(d['seconds_ratio'])}, bound by "
        f"{d['bottleneck']['port']} ({_gb(d['bottleneck']['bytes'])}, {d['bottleneck']['messages']:,} messages)"
        if d["total_bytes"]
        else "            predicted 0 s: nothing changed, nothing to send",
    ]


def render(s: Mapping[str, Any]) -> str:
    t, e, n = s["trainer"], s["engine"], s["network"]
    engine_gpus = e["tp"] * e["pp"] * e["dp"]
    lines = [
        s["name"] or "fleet",
        f"  model     {s['model']['family']}, {_count(s['model']['parameters'])} parameters, "
        f"{s['model']['tensors']:,} tensors",
        f"  trainer   {t['gpus']} GPUs ({_nodes(t['gpus'], t['gpus_per_node'])} of {t['gpus_per_node']}), "
        f"layout {t['layout']}"
        + (f", tp {t['tp']}" if t["tp"] > 1 else "")
        + (f", ep {t['ep']}" if t["ep"] > 1 else ""),
        f"  engine    TP{e['tp']} x PP{e['pp']} x DP{e['dp']}"
        + (f" (EP{e['ep']})" if e["ep"] > 1 else "")
        + f" = {engine_gpus} GPUs ({_nodes(engine_gpus, e['gpus_per_node'])}), serving {e['dtype']}",
        f"  network   {n['nics_per_node']} x {n['nic_gbit_per_s']:g} Gb/s NICs per node, NVLink "
        f"{n['nvlink_gbyte_per_s']:g} GB/s, {n['message_latency_us']:g} us per message, buckets of "
        f"{n['bucket_mib']:g} MiB" + (", colocated" if n["colocated"] else ""),
        f"  plan      {s['plan']['transfers']:,} transfers ({s['plan']['tensor_classes']} tensor classes planned), "
        f"fingerprint {s['plan']['fingerprint']}",
        f"  bytes     {_gb(s['total_bytes'])} in all; per worker {_gb(s['bytes_per_worker']['min'])} - "
        f"{_gb(s['bytes_per_worker']['max'])}; {s['bytes_per_source']['sources']} of "
        f"{s['bytes_per_source']['trainer_ranks']} trainer ranks send, "
        f"{_gb(s['bytes_per_source']['min'])} - {_gb(s['bytes_per_source']['max'])} each",
        f"  NICs      busiest send {_gb(s['nic_tx']['max'])} ({s['nic_tx']['ports']} sending), busiest receive "
        f"{_gb(s['nic_rx']['max'])} ({s['nic_rx']['ports']} receiving); NVLink {_gb(s['nvlink_bytes'])}",
        f"  predicted {_seconds(s['predicted_seconds'])}, bound by {s['bottleneck']['port']} "
        f"({_gb(s['bottleneck']['bytes'])}, {s['bottleneck']['messages']:,} messages)",
    ]
    if s.get("published"):
        pub = s["published"]
        lines.append(f"  published {pub.get('seconds')} s ({pub.get('source', '')})")
    if "delta" in s:
        lines.extend(_render_delta(s["delta"]))
    lines.append(f"  model of the prediction: {s['prediction_model']}")
    if "delta" in s:
        lines.append(f"  model of the delta: {s['delta']['prediction_model']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        description, fleet = fleet_of(
            Path(args.topology), single_source=args.single_source, changed_fraction=args.changed_fraction
        )
        fp = plan_fleet(fleet)
    except (FleetError, WeightwireError) as e:
        print(f"weightwire plan: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the description or its model config cannot be read
        print(
            f"weightwire plan: cannot read {e.filename or args.topology}: {e.strerror or e}", file=sys.stderr
        )
        return 2
    if fleet.delta is None:
        s = summary(description, fp, predict(fp))
    else:
        # imported only when a delta is asked for: the encoding's size rule lives beside its torch
        # kernels, and torch takes a second or more to import that a FULL plan does not need
        from weightwire.core.transports.transfer_plan_fleet_delta import predict_delta

        d = predict_delta(fp, fleet.delta.changed_fraction)
        s = summary(description, fp, d.full, d)
    print(json.dumps(s, indent=1, sort_keys=True) if args.json else render(s))
    return 0
