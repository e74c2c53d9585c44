"""``weightwire push`` against a real TP=2 engine: a refusal's hint names this command's flags, not
the Python API's arguments (``--partial``, not ``scope='partial'``), and ``--cast-to`` converts a
checkpoint stored in another dtype on the way, landing bit for bit what the conversion gives."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from engines import CONFIG, Engine, layout, shard_mismatches, start_engine
from safetensors.torch import save_file
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.client import WeightPusher
from weightwire.client.cli.main import main

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = start_engine(layout(tp=2, pp=1), tmp_path_factory.mktemp("dumps"))
    yield eng
    eng.stop()


def _next_version(engine: Engine) -> int:
    with WeightPusher(engine.addresses) as p:
        return max(s.weights_version for s in p.status().values()) + 1


def _push(engine: Engine, path: str, version: int, *flags: str) -> list[str]:
    return ["push", "--from", path, "--to", *engine.addresses, "--version", str(version), *flags]


def test_a_checkpoint_in_another_dtype_lands_with_cast_to(
    engine: Engine, tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    v = _next_version(engine)
    bf16 = {n: t.to(torch.bfloat16) for n, t in full_checkpoint(CONFIG, seed=v).items()}
    path = os.path.join(tmp_path, "bf16.safetensors")
    save_file(bf16, path)
    assert main(_push(engine, path, v)) == 1
    err = capsys.readouterr().err
    assert "DTYPE_MISMATCH" in err and "--cast-to" in err and "cast_to=" not in err, err

    with WeightPusher(engine.addresses) as p:
        manifests = p.manifests()
    assert main(_push(engine, path, v, "--cast-to", "fp32")) == 0, capsys.readouterr().err
    expected = {n: t.to(torch.float32) for n, t in bf16.items()}
    assert shard_mismatches(engine.dump_dir, manifests, expected, v) == {}


def test_hints_name_the_flags(
    engine: Engine, tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    v = _next_version(engine)
    full = full_checkpoint(CONFIG, seed=v)
    one = os.path.join(tmp_path, "one.safetensors")
    save_file({"model.norm.weight": full["model.norm.weight"]}, one)
    assert main(_push(engine, one, v)) == 1
    err = capsys.readouterr().err
    assert "INCOMPLETE_UPDATE" in err and "use --partial" in err and "scope=" not in err, err
    assert main(_push(engine, one, v, "--partial")) == 0

    extra = os.path.join(tmp_path, "extra.safetensors")
    save_file({**full, "model.extra.weight": torch.ones(2)}, extra)
    assert main(_push(engine, extra, v + 1)) == 1
    err = capsys.readouterr().err
    assert "UNKNOWN_TENSOR" in err and "Pass --allow-unowned" in err and "allow_unowned=" not in err, err
    assert main(_push(engine, extra, v + 1, "--allow-unowned")) == 0


def test_cast_to_takes_only_its_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["push", "--from", "x", "--to", "unix:/x.sock", "--version", "1", "--cast-to", "int8"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cast-to" in err


def test_results_table_gives_a_rate_only_where_one_means_something() -> None:
    from types import SimpleNamespace

    from weightwire.client.cli.tables import LATENCY_NOTE, results_table

    def result(nbytes: int, gbps: float) -> SimpleNamespace:
        return SimpleNamespace(
            worker_id="tp0-pp0",
            version=1,
            tensors_loaded=3,
            buckets=1,
            handles_opened=1,
            bytes_loaded=nbytes,
            duration_s=0.004,
            gbps=gbps,
            transport="host_shm",
        )

    big = results_table({"a": result(64 << 20, 16.78)})
    assert big.splitlines()[-1].split()[-2] == "16.78" and LATENCY_NOTE not in big
    tiny = results_table({"a": result(4096, 0.001)})
    assert tiny.splitlines()[-2].split()[-2] == "-" and tiny.splitlines()[-1] == LATENCY_NOTE


def test_demo_prints_refusals_whole_and_times_for_tiny_shards() -> None:
    import re
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightwire.client.cli.main",
            "demo",
            "--tp",
            "1",
            "--pp",
            "1",
            "--versions",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    injected = next(line for line in lines if line.startswith("injected mismatch"))
    labels = re.findall(r"(?:host|cuda):[0-9a-f-]{36}", injected)
    assert len(labels) == 2
    refusal = next(line for line in lines if "FAILED_PRECONDITION/NO_PAYLOAD_FOR_DEVICE" in line)
    for label in labels:  # the labels it received, whole (the line was cut mid-UUID)
        assert label in refusal, refusal
    header = next(line for line in lines if line.startswith("worker") and "GB/s" in line)
    assert header.split()[7:9] == ["ms", "GB/s"]
    row = lines[lines.index(header) + 2].split()
    assert float(row[-4]) > 0 and row[-3] == "-"
    assert "latency-bound" in lines[lines.index(header) + 3]
