"""The client's command line against real workers: ``manifest``, ``status``, ``push --from`` a
safetensors checkpoint (file or directory), and ``weightwire demo`` as ``make demo`` runs it,
including its cleanup on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
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


def test_manifest_table_and_json(engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["manifest", engine.addresses[1]]) == 0
    out = capsys.readouterr().out
    assert "tp1-pp0" in out and "tp1/2 pp0/1" in out
    assert "model.layers.3.mlp.down_proj.weight" in out and "64x128" in out
    assert main(["manifest", engine.addresses[0], "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["worker_id"] == "tp0-pp0"
    assert len(data["tensors"]) == len(full_checkpoint(CONFIG, seed=0))


def test_push_checkpoint_directory_then_status(
    engine: Engine, tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with WeightPusher(engine.addresses) as p:
        v = max(s.weights_version for s in p.status().values()) + 1
        manifests = p.manifests()
    full = full_checkpoint(CONFIG, seed=v)
    names = list(full)
    ckpt = os.path.join(tmp_path, "ckpt")
    os.makedirs(ckpt)
    # A sharded checkpoint, as Hugging Face writes them.
    save_file(
        {n: full[n] for n in names[: len(names) // 2]}, os.path.join(ckpt, "model-00001-of-00002.safetensors")
    )
    save_file(
        {n: full[n] for n in names[len(names) // 2 :]}, os.path.join(ckpt, "model-00002-of-00002.safetensors")
    )
    code = main(
        ["push", "--from", ckpt, "--to", *engine.addresses, "--version", str(v), "--bucket-mb", "0.05"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "buckets" not in captured.err  # no progress bar: stderr is not a terminal here
    assert "tp0-pp0" in captured.out and "tp1-pp0" in captured.out
    assert shard_mismatches(engine.dump_dir, manifests, full, v) == {}

    assert main(["status", *engine.addresses]) == 0
    out = capsys.readouterr().out
    assert out.count("CONSISTENT") == 2 and f"v{v}" in out
    assert main(["status", "--json", *engine.addresses]) == 0
    statuses = json.loads(capsys.readouterr().out)
    assert {int(s["weights_version"]) for s in statuses.values()} == {v}


def test_push_refuses_wrapped_names_with_a_hint(
    engine: Engine, tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = os.path.join(tmp_path, "fsdp.safetensors")
    save_file({f"_fsdp_wrapped_module.{n}": t for n, t in full_checkpoint(CONFIG, seed=1).items()}, path)
    assert main(["push", "--from", path, "--to", *engine.addresses, "--version", "1000"]) == 1
    err = capsys.readouterr().err
    assert (
        "UNKNOWN_TENSOR" in err
        and "_fsdp_wrapped_module.model.embed_tokens.weight -> model.embed_tokens.weight" in err
    )


def test_status_of_an_unreachable_worker(
    engine: Engine, tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    gone = f"unix:{tmp_path}/nobody.sock"
    assert main(["status", "--timeout", "5", engine.addresses[0], gone]) == 1
    out = capsys.readouterr().out
    assert "UNREACHABLE" in out and "UNAVAILABLE" in out


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(pid))
            except OSError:
                continue
    return pids


def _demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "weightwire.client.cli.main", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _workdir(line: str) -> str:
    return line.rsplit("logs in ", 1)[1].rstrip(")\n")


def test_demo_runs_clean() -> None:
    proc = _demo()
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, out + err
    assert "4/4 shards bit-exact" in out and "v3:" in out
    assert "NO_PAYLOAD_FOR_DEVICE" in out and "demo OK" in out
    workdir = _workdir(next(line for line in out.splitlines() if "logs in" in line))
    assert not os.path.exists(workdir) and not _processes_mentioning(workdir)


def test_demo_cleans_up_on_ctrl_c() -> None:
    # Enough versions that the demo is still pushing when the Ctrl-C comes, however late this test
    # gets to send it on a loaded machine (with the default 3 it could finish first and exit 0).
    proc = _demo("--tp", "1", "--pp", "1", "--versions", "100000")
    assert proc.stdout is not None
    line = ""
    for line in proc.stdout:
        if "logs in" in line:
            break
    workdir = _workdir(line)
    assert len(_processes_mentioning(workdir)) == 1  # the worker is up
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not os.path.exists(workdir) and not _processes_mentioning(workdir)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ww-{proc.pid}-")]
