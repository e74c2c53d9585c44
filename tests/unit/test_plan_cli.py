"""``weightwire plan``: the fleet planner on the committed topologies. Bytes are checked against
what the model and the engine layout imply, worked out here from the shapes; the prediction
against the bound its stated model gives; a bad description is refused with a message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from weightwire.client.cli.main import main
from weightwire.core.model_shapes import model_shapes
from weightwire.core.transports.transfer_plan_fleet import fleet_from, plan_fleet

TOPOLOGIES = Path(__file__).resolve().parents[2] / "bench" / "topologies"


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_small_fleet_every_worker_gets_its_slices_from_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    path = TOPOLOGIES / "small-tp2-pp2.json"
    s = plan_json(capsys, str(path))
    description = json.loads(path.read_text())
    model = model_shapes(description["model"])
    # fp32; TP2 splits everything but the norms, which both ranks keep whole; 2 kv heads over 2
    # ranks: no replication; 2 replicas.
    split = sum(numel(t.shape) * 4 for t in model.tensors if t.split != "replicated")
    norms = sum(numel(t.shape) * 4 for t in model.tensors if t.split == "replicated")
    replica = split + 2 * norms
    assert s["total_bytes"] == 2 * replica
    assert sum(s["bytes_per_nic"][p] for p in s["bytes_per_nic"] if p.endswith("rx")) == 2 * replica
    assert s["bytes_per_worker"]["workers"] == 8
    assert s["bytes_per_source"]["sources"] == 4  # every FSDP rank sends: no funnel
    bound = s["bottleneck"]["bytes"] / (description["network"]["nic_gbit_per_s"] * 1e9 / 8)
    latency = s["bottleneck"]["messages"] * description["network"]["message_latency_us"] * 1e-6
    assert s["predicted_seconds"] == pytest.approx(bound + latency)

    single = plan_json(capsys, str(path), "--single-source")
    assert single["total_bytes"] == s["total_bytes"]
    assert single["bytes_per_source"]["sources"] == 1
    assert single["nic_tx"]["max"] == s["total_bytes"]
    assert single["predicted_seconds"] > s["predicted_seconds"]


def test_qwen3_235b_fleet_receives_the_model_once_plus_replicated_kv(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """8 -> 8 GPUs, BF16, TP8 over 4 k/v heads: every split byte once, k/v twice (two ranks per
    head), norms and routers on all 8 ranks."""
    s = plan_json(capsys, str(TOPOLOGIES / "vllm-qwen3-235b.json"))
    config = json.loads((TOPOLOGIES / "models" / "qwen3-235b-a22b.json").read_text())
    model = model_shapes(config)
    assert 235e9 < model.parameters() < 236e9  # Qwen3-235B-A22B
    kv = sum(numel(t.shape) for t in model.tensors if t.split == "kv")
    replicated = sum(numel(t.shape) for t in model.tensors if t.split == "replicated")
    assert s["total_bytes"] == 2 * (model.parameters() + kv + 7 * replicated)
    assert s["bytes_per_worker"]["min"] == s["bytes_per_worker"]["max"]
    assert s["published"]["seconds"] == 3.2


def test_published_model_sizes() -> None:
    for name, low, high in (("kimi-k2", 1.02e12, 1.03e12), ("deepseek-v3", 670e9, 672e9)):
        model = model_shapes(json.loads((TOPOLOGIES / "models" / f"{name}.json").read_text()))
        assert low < model.parameters() < high, name


def test_fleet_classes_change_no_byte() -> None:
    """Planning tensor classes once and counting them gives the bytes of planning every tensor:
    the small model planned whole (every tensor its own class, by name) against the classed plan."""
    description = json.loads((TOPOLOGIES / "small-tp2-pp2.json").read_text())
    fleet = fleet_from(description, model_shapes(description["model"]))
    classed = plan_fleet(fleet)
    assert len(classed.counts) < len(fleet.model.tensors)
    per_worker = classed.plan.bytes_to()
    # Per worker from the classes, scaled by counts.
    scaled: dict[str, int] = {}
    for t in classed.plan.transfers:
        for w in t.destinations:
            scaled[w] = scaled.get(w, 0) + t.nbytes * classed.counts[t.tensor]
    assert sum(scaled.values()) == classed.total_bytes()
    assert set(scaled) == set(per_worker)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine": {"tp": 3}}, "do not split over 3 ranks"),
        ({"engine": {"tp": 4, "pp": 2, "dp": 1}, "trainer": {"gpus": 4}}, None),
        ({"engine": {"tp": 2, "speed": 1}}, "unknown field"),
        ({"trainer": {"gpus": 4, "layout": "zero3"}}, "trainer.layout"),
        ({"engine": {"tp": 2, "ep": 3}}, "engine.ep 3 must divide"),
    ],
)
def test_bad_descriptions_are_refused_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, Any], message: str | None
) -> None:
    description = json.loads((TOPOLOGIES / "small-tp2-pp2.json").read_text())
    description.update(change)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(description))
    if message is None:  # the control: the same route with a good change plans
        assert main(["plan", str(path)]) == 0
        return
    assert main(["plan", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_toml_description(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('model_config = "qwen3.json"\n[trainer]\ngpus = 8\n[engine]\ntp = 8\nep = 8\n')
    (tmp_path / "qwen3.json").write_text((TOPOLOGIES / "models" / "qwen3-235b-a22b.json").read_text())
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "8 of 8 trainer ranks send" in out
