"""``weightwire plan`` on descriptions that are wrong: every one is refused with one line on stderr
and exit status 2, never a traceback; impossible network values are refused instead of predicted;
a fleet or model far past the documented bounds is refused at once instead of being built."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from weightwire.client.cli.main import main
from weightwire.core.model_shapes import MAX_MODEL_TENSORS
from weightwire.core.transports.transfer_plan_fleet import MAX_GPUS, MAX_PLAN_WORK

TOPOLOGIES = Path(__file__).resolve().parents[2] / "bench" / "topologies"


def small() -> dict[str, Any]:
    return json.loads((TOPOLOGIES / "small-tp2-pp2.json").read_text())


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expect: str) -> str:
    """Plan the description ``text``; assert exit 2 with one line naming ``expect``."""
    path = tmp_path / "fleet.json"
    path.write_text(text)
    started = time.monotonic()
    code = main(["plan", str(path)])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("weightwire plan: "), lines[0]
    assert expect in lines[0], lines[0]
    assert "Traceback" not in captured.err
    assert time.monotonic() - started < 20  # refused, not built
    return lines[0]


def changed(path: tuple[str, ...], value: Any) -> str:
    d = small()
    target = d
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    return json.dumps(d, allow_nan=True)


# Item E: what used to end in a traceback.
@pytest.mark.parametrize(
    ("path", "value", "expect"),
    [
        (("network", "nic_gbit_per_s"), 0, "network.nic_gbit_per_s must be > 0"),
        (("network", "nvlink_gbyte_per_s"), 0, "network.nvlink_gbyte_per_s must be > 0"),
        (("network", "nic_gbit_per_s"), "400", "network.nic_gbit_per_s must be a number, got '400'"),
        (("network", "bucket_mib"), math.nan, "network.bucket_mib must be a number, got nan"),
        (("network", "bucket_mib"), math.inf, "network.bucket_mib must be a number"),
        (("network", "bucket_mib"), 1e-9, "less than one byte"),
        (("network", "colocated"), "yes", "network.colocated must be true or false"),
        (("model", "num_attention_heads"), 0, "'num_attention_heads' must be 1.."),
        (("model", "hidden_size"), -64, "'hidden_size' must be 1.."),
        (("model", "hidden_size"), 64.5, "'hidden_size' must be a whole number"),
        (("model", "vocab_size"), "256", "'vocab_size' must be a whole number"),
        (("model", "num_key_value_heads"), 3, "do not group over 3 k/v heads"),
        (("model", "intermediate_size"), None, "has no 'intermediate_size'"),
        (("model", "tie_word_embeddings"), "no", "'tie_word_embeddings' must be true or false"),
        (("model", "text_config"), "qwen2", "'text_config' must be an object"),
        (("engine", "dtype"), ["bf16"], "engine.dtype must be a string"),
        (("engine", "tp"), 2.0, "engine.tp must be a whole number"),
        (("engine", "tp"), True, "engine.tp must be a whole number"),
        (("trainer", "layout"), None, "trainer.layout must be a string"),
        (("published",), "3.2 s", "published must be a table"),
        (("published",), {"seconds": [1]}, "published.seconds must be a number or a string"),
        (("name",), 7, "name must be a string"),
        (("model_dtype",), 16, "model_dtype must be a string"),
    ],
)
def test_bad_values_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], path: tuple[str, ...], value: Any, expect: str
) -> None:
    refused(tmp_path, capsys, changed(path, value), expect)


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
        ('{"a": ' * 200_000 + "1" + "}" * 200_000, "nested too deeply"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a table/object"),
        ("\xff\xfe", "not valid JSON"),
    ],
)
def test_unreadable_files_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expect: str
) -> None:
    refused(tmp_path, capsys, text, expect)


def test_model_config_that_is_not_a_path_or_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = small()
    del d["model"]
    d["model_config"] = ["models/x.json"]
    refused(tmp_path, capsys, json.dumps(d), "model_config must be a path")
    d["model_config"] = "missing.json"
    refused(tmp_path, capsys, json.dumps(d), "cannot read")
    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    d["model_config"] = "deep.json"
    refused(tmp_path, capsys, json.dumps(d), "nested too deeply")


def test_single_source_with_a_trainer_that_is_not_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(changed(("trainer",), "fsdp"))
    assert main(["plan", str(path), "--single-source"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'trainer' table" in err


# Item F: impossible network values used to print a prediction (negative, NaN) and exit 0.
@pytest.mark.parametrize(
    ("key", "value", "expect"),
    [
        ("nic_gbit_per_s", -400, "network.nic_gbit_per_s must be > 0"),
        ("nic_gbit_per_s", math.nan, "network.nic_gbit_per_s must be a number, got nan"),
        ("nvlink_gbyte_per_s", -1, "network.nvlink_gbyte_per_s must be > 0"),
        ("message_latency_us", -10, "network.message_latency_us must be >= 0"),
        ("message_latency_us", 1e300, "network.message_latency_us must be >= 0 and at most 1e+07"),
        ("nic_gbit_per_s", 1e300, "at most 1e+06"),
        ("nics_per_node", 0, "network.nics_per_node must be a whole number from 1"),
        ("bucket_mib", -1, "network.bucket_mib must be > 0"),
    ],
)
def test_impossible_network_values_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: float, expect: str
) -> None:
    refused(tmp_path, capsys, changed(("network", key), value), expect)


def test_the_smallest_possible_network_values_still_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The control: latency 0 is allowed, and the prediction is then bytes / bandwidth exactly."""
    path = tmp_path / "fleet.json"
    path.write_text(changed(("network", "message_latency_us"), 0))
    assert main(["plan", str(path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["predicted_seconds"] == pytest.approx(s["bottleneck"]["bytes"] / (100e9 / 8))
    assert s["predicted_seconds"] > 0


# Item G: sizes that used to be built in full until memory ran out.
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("path", "value", "expect"),
    [
        (("trainer", "gpus"), 10**9, f"trainer.gpus must be a whole number from 1 to {MAX_GPUS:,}"),
        (("engine", "dp"), 10**9, f"engine.dp must be a whole number from 1 to {MAX_GPUS:,}"),
        (("engine", "tp"), 10**100, "engine.tp must be a whole number from 1"),
        (("engine", "dp"), 30_000, f"over the {MAX_GPUS:,} planned"),
        (("model", "num_hidden_layers"), 10**9, "'num_hidden_layers' must be 1..16,777,216"),
        (
            ("model", "num_hidden_layers"),
            1_000_000,
            f"over the {MAX_MODEL_TENSORS:,} a planned model may have",
        ),
    ],
)
def test_huge_fleets_and_models_are_refused_past_the_bounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], path: tuple[str, ...], value: int, expect: str
) -> None:
    refused(tmp_path, capsys, changed(path, value), expect)


@pytest.mark.timeout(60)
def test_a_plan_past_the_work_bound_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = small()
    d["trainer"] = {"gpus": 65_536, "gpus_per_node": 8}
    d["engine"]["dp"] = 64  # 14 tensor classes x 512 workers x 65,536 ranks
    refused(tmp_path, capsys, json.dumps(d), f"over the {MAX_PLAN_WORK:,} one plan may take")


@pytest.mark.timeout(60)
def test_a_million_experts_is_refused_before_any_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.loads((TOPOLOGIES / "models" / "qwen3-235b-a22b.json").read_text())
    config["num_experts"] = 10**6
    d = {"model": config, "trainer": {"gpus": 8}, "engine": {"tp": 8}}
    refused(tmp_path, capsys, json.dumps(d), f"over the {MAX_MODEL_TENSORS:,} a planned model may have")


def test_a_large_fleet_inside_the_bounds_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The control for the bounds: 4096 trainer ranks into 8 replicas of the small model's engine
    plans, with the bytes of one replica times 8."""
    path = tmp_path / "fleet.json"
    d = small()
    d["trainer"] = {"gpus": 4096, "gpus_per_node": 8}
    d["engine"]["dp"] = 8
    path.write_text(json.dumps(d))
    assert main(["plan", str(path), "--json"]) == 0
    big = json.loads(capsys.readouterr().out)
    d["engine"]["dp"] = 1
    path.write_text(json.dumps(d))
    assert main(["plan", str(path), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert big["total_bytes"] == 8 * one["total_bytes"]
    assert big["bytes_per_worker"]["workers"] == 32
