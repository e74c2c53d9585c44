"""``weightwire plan`` with a changed fraction: the delta update predicted next to the FULL one.

On a small regular fleet (2 FSDP trainer ranks on one node, one TP1 worker on another: every tensor
arrives as two halves of its rows, one from each rank, through one receiving NIC) the bytes and the
time are worked out here: each half's bytes are what the delta encoding's own size rule gives at
that density, and the time is the FULL prediction's formula over those bytes. The encoding switches
where the contract says it does (1/32 changed; 1 - 1/(8 x bytes per element)); a fraction that is
not a number from 0 to 1, from the command line or the description, is refused with one line and
exit status 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from weightwire.client.cli.main import main
from weightwire.core.delta.encoding import Encoding, choose_encoding, encoded_size_bytes
from weightwire.core.model_shapes import model_shapes
from weightwire.core.transports.transfer_plan_fleet import FleetError, fleet_from, plan_fleet, predict
from weightwire.core.transports.transfer_plan_fleet_delta import predict_delta, region_encoding

TOPOLOGIES = Path(__file__).resolve().parents[2] / "bench" / "topologies"
NIC_GBIT_PER_S = 100
LATENCY_US = 10
BUCKET_BYTES = 16 << 10


def regular(dtype: str = "bf16", delta: dict[str, Any] | None = None) -> dict[str, Any]:
    """2 FSDP ranks (train0, GPUs 0 and 1, NICs 0 and 1) into one TP1 worker (infer0, GPU 0, NIC 0)."""
    d: dict[str, Any] = {
        "model": {
            "model_type": "qwen2",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "vocab_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "tie_word_embeddings": False,
        },
        "trainer": {"gpus": 2, "gpus_per_node": 2, "layout": "fsdp"},
        "engine": {"tp": 1, "gpus_per_node": 1, "dtype": dtype},
        "network": {
            "nic_gbit_per_s": NIC_GBIT_PER_S,
            "nics_per_node": 2,
            "message_latency_us": LATENCY_US,
            "bucket_mib": BUCKET_BYTES / (1 << 20),
        },
    }
    if delta is not None:
        d["delta"] = delta
    return d


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def halves(d: dict[str, Any]) -> list[int]:
    """Elements of every region the plan sends: each tensor's rows split evenly over the 2 ranks."""
    model = model_shapes(d["model"])
    assert all(t.shape[0] % 2 == 0 for t in model.tensors)  # so the halves are equal
    return [numel(t.shape) // 2 for t in model.tensors for _rank in range(2)]


def by_hand_bytes(region_elements: list[int], itemsize: int, fraction: float) -> int:
    """Each region's changed elements rounded to a whole one, in the encoding the trainer picks."""
    total = 0
    for n in region_elements:
        k = round(fraction * n)
        total += encoded_size_bytes(choose_encoding(n, k, itemsize), n, k, itemsize)
    return total


def by_hand_seconds(total_bytes: int) -> float:
    """The busiest port is the worker's NIC (infer0 nic0 rx): everything, in the buckets of both
    ranks' halves (each rank sends half of every tensor, so half the bytes)."""
    messages = 2 * -(-(total_bytes // 2) // BUCKET_BYTES)
    return total_bytes / (NIC_GBIT_PER_S * 1e9 / 8) + messages * LATENCY_US * 1e-6


def planned(d: dict[str, Any]) -> Any:
    return plan_fleet(fleet_from(d, model_shapes(d["model"])))


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.03, 0.1, 0.5, 0.95, 1.0])
def test_regular_fleet_bytes_and_time_by_hand(fraction: float) -> None:
    d = regular()
    regions = halves(d)
    p = predict_delta(planned(d), fraction)
    full_bytes = sum(regions) * 2
    delta_bytes = by_hand_bytes(regions, 2, fraction)

    assert p.full.total_bytes == full_bytes
    assert p.delta.total_bytes == delta_bytes
    assert p.bytes_ratio == pytest.approx(delta_bytes / full_bytes)
    # every byte crosses the one receiving NIC, half of it from each rank's NIC
    assert {str(port): b for port, b in p.delta.port_bytes.items() if b} == (
        {
            "infer0 nic0 rx": delta_bytes,
            "train0 nic0 tx": delta_bytes // 2,
            "train0 nic1 tx": delta_bytes // 2,
        }
        if delta_bytes
        else {}
    )
    assert dict(p.delta.bytes_to_worker) == ({"dp0-pp0-tp0": delta_bytes} if delta_bytes else {})
    # one model times both: the FULL prediction by the formula, the delta by the same formula
    assert p.full.seconds == pytest.approx(by_hand_seconds(full_bytes))
    assert p.full.seconds == predict(planned(d)).seconds
    assert p.delta.seconds == pytest.approx(by_hand_seconds(delta_bytes))
    if delta_bytes:
        assert str(p.delta.bottleneck) == "infer0 nic0 rx"
        assert p.seconds_ratio == pytest.approx(by_hand_seconds(delta_bytes) / by_hand_seconds(full_bytes))
    # every region is counted once in some encoding, and their bytes add up to the total
    assert sum(s.regions for s in p.encodings.values()) == len(regions)
    assert sum(s.wire_bytes for s in p.encodings.values()) == delta_bytes


def test_one_percent_of_bf16_is_six_bytes_per_changed_element() -> None:
    """The figure docs/deltas.md gives (INDICES: a 4-byte index and a 2-byte value per change), on
    the largest regions, where rounding to whole elements does not matter."""
    assert region_encoding(8192, 2, 0.01) == (Encoding.INDICES, 82 * 6)  # 81.92 -> 82 changed
    assert region_encoding(8192, 2, 0.1) == (Encoding.BITMAP, 1024 + 819 * 2)
    assert region_encoding(8192, 2, 1.0) == (Encoding.DENSE, 8192 * 2)
    assert region_encoding(8192, 2, 0.0) == (Encoding.INDICES, 0)


@pytest.mark.parametrize(
    ("dtype", "fraction", "chosen"),
    [
        ("bf16", 0.01, "INDICES"),
        ("bf16", 0.03, "INDICES"),  # just under 1/32
        # over it; at 0.04 a norm's 32-element half rounds to 1 change, where the two tie (6 bytes)
        ("bf16", 0.05, "BITMAP"),
        ("bf16", 0.9, "BITMAP"),
        ("bf16", 0.95, "DENSE"),  # past 1 - 1/16 for 2-byte elements
        ("fp32", 0.95, "BITMAP"),  # under 1 - 1/32 for 4-byte ones
        ("fp32", 0.98, "DENSE"),
        ("bf16", 1.0, "DENSE"),
    ],
)
def test_the_encoding_switches_with_density(dtype: str, fraction: float, chosen: str) -> None:
    d = regular(dtype)
    p = predict_delta(planned(d), fraction)
    assert set(p.encodings) == {chosen}
    assert p.encodings[chosen].regions == len(halves(d))


def test_every_element_changed_is_the_full_update() -> None:
    """At 1, DENSE everywhere: the same bytes on every port and the same time as FULL, on the
    committed TP2 x PP2 x DP2 fleet (both ways of describing the fraction)."""
    p = predict_delta(planned(json.loads((TOPOLOGIES / "small-tp2-pp2.json").read_text())), 1.0)
    assert dict(p.delta.port_bytes) == dict(p.full.port_bytes)
    assert p.delta.seconds == p.full.seconds
    assert p.bytes_ratio == 1.0 and p.seconds_ratio == 1.0


def plan_json(capsys: pytest.CaptureFixture[str], path: Path, *args: str) -> dict[str, Any]:
    assert main(["plan", str(path), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_reports_the_delta_next_to_full(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(regular()))
    plain = plan_json(capsys, path)
    assert "delta" not in plain  # without a fraction, the output of before

    s = plan_json(capsys, path, "--changed-fraction", "0.01")
    regions = halves(regular())
    delta_bytes = by_hand_bytes(regions, 2, 0.01)
    assert {k: v for k, v in s.items() if k != "delta"} == plain  # FULL's figures unchanged
    d = s["delta"]
    assert d["changed_fraction"] == 0.01
    assert d["total_bytes"] == delta_bytes
    assert d["bytes_ratio"] == pytest.approx(delta_bytes / plain["total_bytes"])
    assert d["predicted_seconds"] == pytest.approx(by_hand_seconds(delta_bytes))
    assert d["seconds_ratio"] == pytest.approx(d["predicted_seconds"] / plain["predicted_seconds"])
    assert d["bytes_per_nic"] == {
        "infer0 nic0 rx": delta_bytes,
        "train0 nic0 tx": delta_bytes // 2,
        "train0 nic1 tx": delta_bytes // 2,
    }
    assert d["bottleneck"]["port"] == "infer0 nic0 rx"
    assert d["encodings"] == {"INDICES": {"regions": len(regions), "bytes": delta_bytes}}
    assert "rounded to a whole element" in d["prediction_model"]

    # the description's table says the same; the command line's option wins over it
    path.write_text(json.dumps(regular(delta={"changed_fraction": 0.01})))
    assert plan_json(capsys, path)["delta"] == d
    path.write_text(json.dumps(regular(delta={"changed_fraction": 0.5})))
    assert plan_json(capsys, path, "--changed-fraction", "0.01")["delta"] == d

    assert main(["plan", str(path), "--changed-fraction", "0.01"]) == 0
    text = capsys.readouterr().out
    assert "1% of every tensor's elements changed (predicted, not measured)" in text
    assert "encoded as INDICES" in text and "model of the delta:" in text


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], d: Any, args: list[str], expect: str) -> None:
    """Plan ``d`` with ``args``; exit 2, nothing on stdout, one line on stderr naming ``expect``."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(d, allow_nan=True))
    code = main(["plan", str(path), *args])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("weightwire plan: ") and expect in lines[0], lines[0]


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("nan", "nan"),
        ("-0.01", "-0.01"),
        ("1.5", "1.5"),
        ("inf", "inf"),
        ("1%", "'1%'"),
        ("", "''"),
        ("0.01,0.02", "'0.01,0.02'"),
    ],
)
def test_bad_changed_fraction_option_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, shown: str
) -> None:
    refused(
        tmp_path,
        capsys,
        regular(),
        [f"--changed-fraction={text}"],
        f"--changed-fraction must be a number from 0 to 1 (0.01: 1% changed), got {shown}",
    )


@pytest.mark.parametrize(
    ("delta", "expect"),
    [
        ({"changed_fraction": math.nan}, "delta.changed_fraction must be a number, got nan"),
        ({"changed_fraction": -0.01}, "delta.changed_fraction must be a number from 0 to 1"),
        ({"changed_fraction": 1.01}, "delta.changed_fraction must be a number from 0 to 1"),
        ({"changed_fraction": "0.01"}, "delta.changed_fraction must be a number, got '0.01'"),
        ({"changed_fraction": True}, "delta.changed_fraction must be a number, got True"),
        ({"changed_fraction": [0.01]}, "delta.changed_fraction must be a number"),
        ({"fraction": 0.01}, "delta: unknown field(s) ['fraction']"),
        ({}, "changed_fraction"),
        (0.01, "delta must be a table (changed_fraction), got 0.01"),
    ],
)
def test_bad_delta_table_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], delta: Any, expect: str
) -> None:
    d = regular()
    d["delta"] = delta
    refused(tmp_path, capsys, d, [], expect)


@pytest.mark.parametrize("fraction", [0, 1, 0.0, 1e-9])
def test_the_bounds_themselves_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fraction: float
) -> None:
    """The controls: 0 and 1 are fractions (nothing changed: no bytes, no time; all: FULL)."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(regular(delta={"changed_fraction": fraction})))
    d = plan_json(capsys, path)["delta"]
    assert d["changed_fraction"] == fraction
    if fraction == 0:
        assert d["total_bytes"] == 0 and d["predicted_seconds"] == 0.0
        assert d["bytes_per_source"]["sources"] == 0
        assert main(["plan", str(path)]) == 0
        assert "predicted 0 s: nothing changed, nothing to send" in capsys.readouterr().out
    if fraction == 1:
        assert d["bytes_ratio"] == 1.0


def test_predict_delta_refuses_a_fraction_outside_0_to_1() -> None:
    fp = planned(regular())
    for bad in (-1.0, 2.0, math.nan, math.inf):
        with pytest.raises(FleetError, match="changed_fraction must be"):
            predict_delta(fp, bad)
