"""What a new user meets first on the command line: the light commands start without importing
torch, Ctrl-C in the middle of a call exits 130 with one line (no traceback from gRPC), and a
worker address gRPC would misread (a socket path without ``unix:``, a host without a port) is
refused before connecting, with one line and exit status 2. Real ``weightwire`` processes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from weightwire.client.cli.main import main

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "weightwire.client.cli.main"]
TOPOLOGY = Path(__file__).resolve().parents[2] / "bench" / "topologies" / "small-tp2-pp2.json"


def test_light_commands_do_not_import_torch(tmp_path: Path) -> None:
    """``--version``, ``status``, ``manifest`` and ``plan`` run without torch (importing it takes
    seconds); the process reports what it imported."""
    nowhere = f"unix:{tmp_path}/nobody.sock"
    script = f"""
import sys
from weightwire.client.cli.main import main
codes = []
for argv in (["--version"], ["status", {nowhere!r}, "--timeout", "2"],
             ["manifest", {nowhere!r}, "--timeout", "2"], ["plan", {str(TOPOLOGY)!r}]):
    try:
        codes.append(main(argv))
    except SystemExit as e:
        codes.append(e.code)
print("codes", codes, file=sys.stderr)
print("torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "codes [0, 1, 1, 0]" in out.stderr, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout


@pytest.fixture()
def silent_worker() -> Iterator[tuple[str, threading.Event]]:
    """A TCP port that accepts connections and never answers: every call to it waits."""
    listener = socket.create_server(("127.0.0.1", 0))
    connected = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            connected.set()

    threading.Thread(target=accept, daemon=True).start()
    yield f"127.0.0.1:{listener.getsockname()[1]}", connected
    listener.close()
    for conn in held:
        conn.close()


def _interrupted(argv: list[str], connected: threading.Event) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert connected.wait(60), "the command never connected"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_during_push_exits_130_with_one_line(
    silent_worker: tuple[str, threading.Event], tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(8)}, str(tmp_path / "ckpt.safetensors"))
    address, connected = silent_worker
    argv = ["push", "--from", str(tmp_path / "ckpt.safetensors"), "--to", address, "--version", "1"]
    done = _interrupted([*argv, "--timeout", "60"], connected)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "weightwire: interrupted"


def test_ctrl_c_during_status_exits_130_with_one_line(silent_worker: tuple[str, threading.Event]) -> None:
    address, connected = silent_worker
    done = _interrupted(["status", address, "--timeout", "60"], connected)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines() == ["weightwire: interrupted"], done.stderr


@pytest.mark.parametrize(
    ("address", "expect"),
    [
        ("/tmp/ww/tp0.sock", "a Unix socket address starts with unix: (unix:/tmp/ww/tp0.sock)"),
        ("tp0.sock", "starts with unix:"),
        ("localhost", "'localhost' has no port: a worker address is HOST:PORT"),
        ("10.0.0.5", "has no port"),
        ("[::1]", "has no port"),
        ("localhost:0", "port '0' is not 1..65535"),
        ("localhost:http", "port 'http' is not 1..65535"),
    ],
)
@pytest.mark.parametrize("command", ["status", "manifest", "push"])
def test_an_address_grpc_would_misread_is_refused_before_connecting(
    command: str, address: str, expect: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = {
        "status": ["status", "unix:/run/ww/tp1.sock", address],
        "manifest": ["manifest", address],
        "push": ["push", "--from", str(tmp_path), "--to", address, "--version", "1"],
    }[command]
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expect in err, err


@pytest.mark.parametrize(
    "address", ["unix:/run/ww/tp0.sock", "unix:relative.sock", "localhost:50051", "[::1]:50051", "dns:///h:1"]
)
def test_addresses_grpc_reads_as_meant_are_accepted(address: str) -> None:
    from weightwire.client.cli.commands import address_problem

    assert address_problem(address) is None


def test_the_status_table_keeps_the_whole_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unreachable worker's row carries gRPC's whole message, down to why it failed (it was cut at
    90 characters, inside "the worker went away", before the "No such file" that says why)."""
    gone = f"unix:{tmp_path}/nobody.sock"
    assert main(["status", gone, "--timeout", "2"]) == 1
    row = capsys.readouterr().out.splitlines()[-1]
    assert "UNREACHABLE" in row and "UNAVAILABLE: " in row
    assert row.rstrip().endswith("No such file or directory"), row


def test_a_socket_path_too_long_for_unix_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["status", "unix:/" + "d" * 120 + "/tp0.sock"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at most 107 bytes" in err, err
