"""Bad input on the command line ends with one line on stderr and exit status 2, never a traceback,
and leaves nothing behind: unreadable checkpoints and files, values a command cannot honour,
workers named twice, and ``serve`` options it cannot act on (real ``weightwire serve`` processes).

The client commands run in process (``main``); they refuse before connecting, so the worker
addresses need not exist."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from weightwire.client.cli.main import build_parser, main

pytestmark = pytest.mark.timeout(120)

NOWHERE = "unix:/nonexistent/weightwire-cli-test.sock"


def _refused(argv: Sequence[str], capsys: pytest.CaptureFixture[str], *, parse_only: bool = False) -> str:
    """Run the CLI in process (only its argument parser with ``parse_only``); it must exit 2
    (returned or raised by argparse) with exactly one stderr line; that line."""
    try:
        code = 0 if parse_only and build_parser().parse_args(list(argv)) else main(list(argv))
    except SystemExit as e:
        code = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, (argv, err)
    assert len(lines) == 1 and "Traceback" not in err, (argv, err)
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli-input")
    (d / "notes.txt").write_text("not a checkpoint\n")
    save_file({"model.norm.weight": torch.ones(64)}, str(d / "good.safetensors"))
    good = (d / "good.safetensors").read_bytes()
    (d / "truncated.safetensors").write_bytes(good[: len(good) // 2])
    (d / "random.safetensors").write_bytes(bytes(range(256)) * 3)
    shards = d / "sharded"
    shards.mkdir()
    save_file(
        {"model.embed_tokens.weight": torch.ones(4, 4)}, str(shards / "model-00001-of-00002.safetensors")
    )
    (shards / "model-00002-of-00002.safetensors").write_bytes(
        good[:24]
    )  # a header that lies about its length
    (d / "empty-token").write_text("\n")
    (d / "token").write_text("s3cret\n")
    return d


@pytest.mark.parametrize("name", ["notes.txt", "truncated.safetensors", "random.safetensors", "sharded"])
def test_push_from_something_that_is_not_a_checkpoint(
    name: str, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refused(["push", "--from", str(files / name), "--to", NOWHERE, "--version", "1"], capsys)
    bad = "model-00002-of-00002.safetensors" if name == "sharded" else name
    assert bad in line and "is not a readable .safetensors file" in line


@pytest.mark.parametrize("value", ["nan", "inf", "1e400"])
def test_push_bucket_mb_must_be_finite(value: str, files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(
        [
            "push",
            "--from",
            str(files / "good.safetensors"),
            "--to",
            NOWHERE,
            "--version",
            "1",
            "--bucket-mb",
            value,
        ],
        capsys,
    )
    assert "--bucket-mb" in line and "finite" in line


@pytest.mark.parametrize(
    "command",
    [
        ["push", "--from", "CKPT", "--to", NOWHERE, "--version", "1"],
        ["status", NOWHERE],
        ["status", NOWHERE, "--watch", "--count", "1"],
        ["manifest", NOWHERE],
    ],
    ids=["push", "status", "status-watch", "manifest"],
)
def test_connection_files_are_checked_before_anything_runs(
    command: list[str], files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(files / "good.safetensors") if a == "CKPT" else a for a in command]
    missing = str(files / "no-such-file")
    line = _refused([*argv, "--token-file", missing], capsys)
    assert "--token-file" in line and missing in line and "No such file or directory" in line
    line = _refused([*argv, "--token-file", str(files / "empty-token")], capsys)
    assert "is empty" in line  # an empty token would send no credentials at all
    line = _refused([*argv, "--token-file", str(files / "token"), "--token", "other"], capsys)
    assert "not allowed with" in line
    line = _refused([*argv, "--tls-ca", missing], capsys)
    assert "--tls-ca" in line and "No such file or directory" in line
    line = _refused([*argv, "--tls-ca", str(files / "notes.txt")], capsys)
    assert "is not a PEM file" in line


def test_a_worker_named_twice_is_refused(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    twice = "unix:/nonexistent/a.sock"
    line = _refused(
        ["push", "--from", str(files / "good.safetensors"), "--to", twice, NOWHERE, twice, "--version", "1"],
        capsys,
    )
    assert twice in line and "more than once" in line
    line = _refused(["status", twice, twice], capsys)
    assert twice in line and "more than once" in line


# ------------------------------------------------------------------------------------------------
# serve: real processes, started together (each imports torch), each with a private temp folder
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _serve_all(cases: dict[str, list[str]], root: Path) -> dict[str, tuple[int, str, list[str]]]:
    """Start ``weightwire serve`` once per case at the same time; each case's (exit status, stderr,
    what its temp folder holds afterwards)."""
    procs = {}
    for name, extra in cases.items():
        tmp = root / f"tmp-{name}"
        tmp.mkdir()
        procs[name] = (
            tmp,
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "weightwire.client.cli.main",
                    "serve",
                    "--log-level",
                    "WARNING",
                    *extra,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "TMPDIR": str(tmp)},
            ),
        )
    out = {}
    for name, (tmp, proc) in procs.items():
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()  # it started serving instead of refusing
            _, err = proc.communicate()
        out[name] = (proc.returncode, err, sorted(os.listdir(tmp)))
    return out


def test_serve_refuses_what_it_cannot_do_with_one_line(tmp_path: Path, busy_port: int, files: Path) -> None:
    cases = {
        "port-in-use": ["--listen", f"127.0.0.1:{busy_port}"],
        "more-stages-than-layers": ["--pp-rank", "7", "--pp-size", "8"],
        "metrics-port-out-of-range": ["--metrics-port", "99999"],
        "dump-dir-unwritable": ["--dump-dir", str(files / "notes.txt" / "dumps")],
        "token-file-missing": ["--token-file", str(files / "no-such-file")],
    }
    expected = {
        "port-in-use": f"cannot listen on 127.0.0.1:{busy_port}: Address already in use",
        "more-stages-than-layers": "4 layers cannot be split over 8 pipeline stages",
        "metrics-port-out-of-range": "argument --metrics-port: '99999' is not a port",
        "dump-dir-unwritable": "cannot write there: Not a directory",
        "token-file-missing": "cannot read token file",
    }
    for name, (code, err, left) in _serve_all(cases, tmp_path).items():
        lines = err.strip().splitlines()
        assert code == 2, (name, err)
        assert len(lines) == 1 and lines[0].startswith("weightwire serve: "), (name, err)
        assert expected[name] in lines[0], (name, err)
        assert left == [], (name, left)  # no private socket directory left behind


# ------------------------------------------------------------------------------------------------
# values a command cannot honour: refused while parsing, before anything connects or starts
# ------------------------------------------------------------------------------------------------

_PUSH = ["push", "--from", "CKPT", "--to", NOWHERE]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--listen", "127.0.0.1:99999"], "'127.0.0.1:99999': '99999' is not a port"),
        (["serve", "--listen", "[::1]:-1"], "is not a port"),
        (["serve", "--listen", "unix:relative.sock"], "needs an absolute path"),
        (["serve", "--listen", "nocolon"], "is not 'unix:/path.sock' or 'HOST:PORT'"),
        (["serve", "--idle-timeout-s=-1"], "must be > 0"),
        (["serve", "--idle-timeout-s", "0"], "must be > 0"),
        (["serve", "--idle-timeout-s", "nan"], "not a finite number"),
        (["serve", "--idle-timeout-s", "1e300"], "at most 1e+07 seconds"),
        (["serve", "--metrics-port=-1"], "is not a port"),
        (["serve", "--tp-size", "0"], "must be at least 1"),
        (["serve", "--seed", str(2**64)], "must be in 0..2^63-1"),
        ([*_PUSH, "--version", "1", "--bucket-mb", "0"], "--bucket-mb: '0' must be > 0"),
        ([*_PUSH, "--version", "1", "--bucket-mb=-3"], "--bucket-mb: '-3' must be > 0"),
        ([*_PUSH, "--version", "1", "--bucket-mb", "1e-9"], "at least one byte"),
        ([*_PUSH, "--version", "1", "--timeout=-1"], "--timeout: '-1' must be > 0"),
        ([*_PUSH, "--version", "1", "--timeout", "nan"], "--timeout: 'nan' is not a finite number"),
        ([*_PUSH, "--version", "1", "--transport", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
        ([*_PUSH, "--version", "0"], "--version: '0' must be at least 1"),
        ([*_PUSH, "--version", str(2**63)], "over the largest version"),
        (["status", NOWHERE, "--timeout", "0"], "--timeout: '0' must be > 0"),
        (["status", NOWHERE, "--watch", "--interval", "nan"], "--interval: 'nan' is not a finite number"),
        (["status", NOWHERE, "--watch", "--interval", "0"], "--interval: '0' must be > 0"),
        (["status", NOWHERE, "--watch", "--count", "0"], "--count: '0' must be at least 1"),
        (["manifest", NOWHERE, "--timeout", "inf"], "--timeout: 'inf' is not a finite number"),
        (["demo", "--tp", "0"], "--tp: '0' must be at least 1"),
        (["demo", "--versions=-1"], "--versions: '-1' must be at least 1"),
        (["demo", "--bucket-kb", "0"], "--bucket-kb: '0' must be > 0"),
        (["discover", "--base-address", "127.0.0.1:1", "--count=-1"], "--count: '-1' must be at least 1"),
        (
            ["discover", "--base-address", "127.0.0.1:1", "--count", "1", "--wait", "nan"],
            "--wait: 'nan' is not a finite number",
        ),
    ],
)
def test_values_a_command_cannot_honour_are_refused(
    argv: list[str], says: str, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Parsing only: a value that got through would otherwise start a server in this process.
    line = _refused(
        [str(files / "good.safetensors") if a == "CKPT" else a for a in argv], capsys, parse_only=True
    )
    assert says in line, line


@pytest.mark.parametrize(
    ("tp", "pp", "says"),
    [
        ("2", "8", "cannot run as TP=2 x PP=8: 4 layers cannot be split over 8 pipeline stages"),
        ("3", "2", "cannot run as TP=3 x PP=2"),
    ],
)
def test_demo_refuses_a_layout_of_its_model_before_starting_workers(
    tp: str, pp: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refused(["demo", "--tp", tp, "--pp", pp], capsys)
    assert says in line, line


def test_the_limits_themselves_are_accepted() -> None:
    parser = build_parser()
    serve = parser.parse_args(
        [
            "serve",
            "--listen",
            "[::1]:65535",
            "--idle-timeout-s",
            "1e7",
            "--metrics-port",
            "0",
            "--seed",
            str(2**63 - 1),
        ]
    )
    assert (serve.listen, serve.idle_timeout_s, serve.metrics_port, serve.seed) == (
        "[::1]:65535",
        1e7,
        0,
        2**63 - 1,
    )
    push = parser.parse_args([*_PUSH, "--version", str(2**63 - 1), "--bucket-mb", "0.5", "--timeout", "0.25"])
    assert (push.version, push.bucket_bytes, push.timeout) == (2**63 - 1, 512 * 1024, 0.25)
    assert parser.parse_args(["discover", "--base-address", "h:1", "--count", "1", "--wait", "0"]).wait == 0.0
