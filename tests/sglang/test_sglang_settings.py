"""Pure parts of the SGLang adapter (no sglang needed): addresses from ranks, environment parsing,
discovery over real sockets, and the hand-off of work to an engine thread."""

from __future__ import annotations

import itertools
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from weightwire.adapters.sglang import DiscoveryError, Settings, discover, worker_id
from weightwire.adapters.sglang.engine_thread import EngineTaskQueue
from weightwire.adapters.sglang.settings import (
    SettingsError,
    default_socket_dir,
    parse_worker_id,
    worker_index,
)
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import ParallelRank

# --------------------------------------------------------------------------------------- settings


def test_worker_index_is_dense_and_unique() -> None:
    ranks = [
        ParallelRank(tp_rank=t, tp_size=2, pp_rank=p, pp_size=3, dp_rank=d, dp_size=2)
        for d, p, t in itertools.product(range(2), range(3), range(2))
    ]
    assert [worker_index(r) for r in ranks] == list(range(12))


@pytest.mark.parametrize(
    ("rank", "expected"),
    [
        (ParallelRank(tp_rank=1, tp_size=2, pp_rank=0, pp_size=2), "tp1-pp0"),
        (ParallelRank(tp_rank=0, tp_size=2, dp_rank=1, dp_size=2), "tp0-pp0-dp1"),
        (ParallelRank(tp_rank=3, tp_size=4, sp_rank=1, sp_size=2), "tp3-pp0-sp1"),
    ],
)
def test_worker_id_round_trip(rank: ParallelRank, expected: str) -> None:
    assert worker_id(rank) == expected
    assert parse_worker_id(expected) == (rank.dp_rank, rank.pp_rank, rank.tp_rank, rank.sp_rank)


def test_addresses_from_environment(tmp_path: Path) -> None:
    rank = ParallelRank(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    unix = Settings.from_env({"WEIGHTWIRE_SGLANG_SOCKET_DIR": str(tmp_path)})
    assert unix.address(rank) == f"unix:{tmp_path}/tp1-pp1.sock"
    tcp = Settings.from_env({"WEIGHTWIRE_SGLANG_BASE_PORT": "40100"})
    assert tcp.address(rank) == "127.0.0.1:40103"
    default = Settings.from_env({}, engine_port=30000)
    assert default.endpoints.socket_dir == default_socket_dir(30000)
    assert default.address(rank).endswith("weightwire-sglang-30000/tp1-pp1.sock")
    assert Settings.from_env({}).idle_wait_s == 5.0
    assert Settings.from_env({"WEIGHTWIRE_SGLANG_IDLE_WAIT_S": "0"}).idle_wait_s == 0.0
    assert Settings.from_env({"WEIGHTWIRE_SGLANG_ALLOW_UNTESTED": "1"}).allow_untested is True
    assert (
        unix.engine_key()
        != Settings.from_env({"WEIGHTWIRE_SGLANG_SOCKET_DIR": str(tmp_path / "b")}).engine_key()
    )
    assert tcp.engine_key() == "tcp:127.0.0.1:40100"
    guarded = Settings.from_env(
        {
            "WEIGHTWIRE_SGLANG_BASE_PORT": "40100",
            "WEIGHTWIRE_SGLANG_HOST": "10.0.0.5",
            "WEIGHTWIRE_TOKEN": "s3cret",
        }
    )
    assert guarded.address(rank) == "10.0.0.5:40103" and guarded.endpoints.token == "s3cret"
    assert (
        Settings.from_env({"WEIGHTWIRE_SGLANG_ENABLE": "0", "WEIGHTWIRE_SGLANG_FLUSH_CACHE": "0"}).enabled
        is False
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WEIGHTWIRE_SGLANG_SOCKET_DIR": "/x", "WEIGHTWIRE_SGLANG_BASE_PORT": "40000"}, "not both"),
        ({"WEIGHTWIRE_SGLANG_BASE_PORT": "forty"}, "not a port"),
        ({"WEIGHTWIRE_SGLANG_BASE_PORT": "70000"}, "outside"),
        ({"WEIGHTWIRE_SGLANG_BASE_PORT": "40000", "WEIGHTWIRE_SGLANG_HOST": "0.0.0.0"}, "WEIGHTWIRE_TOKEN"),
        ({"WEIGHTWIRE_SGLANG_ENABLE": "maybe"}, "use 1 or 0"),
        ({"WEIGHTWIRE_SGLANG_ENGINE_TIMEOUT_S": "-1"}, "> 0"),
        ({"WEIGHTWIRE_SGLANG_ENGINE_TIMEOUT_S": "0"}, "> 0"),
        ({"WEIGHTWIRE_SGLANG_IDLE_WAIT_S": "-0.5"}, ">= 0"),
        ({"WEIGHTWIRE_SGLANG_IDLE_WAIT_S": "nan"}, "finite"),
        ({"WEIGHTWIRE_SGLANG_IDLE_WAIT_S": "soon"}, "not a number"),
        ({"WEIGHTWIRE_SGLANG_ALLOW_UNTESTED": "perhaps"}, "use 1 or 0"),
    ],
)
def test_bad_environment_is_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


def test_socket_path_over_the_kernel_limit_is_refused() -> None:
    settings = Settings.from_env({"WEIGHTWIRE_SGLANG_SOCKET_DIR": "/" + "d" * 100})
    with pytest.raises(SettingsError, match="over the kernel's limit"):
        settings.address(ParallelRank())


# -------------------------------------------------------------------------------------- discovery


@pytest.fixture
def listeners() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for s in opened:
        s.close()


def listen_unix(path: str, opened: list[socket.socket]) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen()
    opened.append(s)


def test_discover_socket_dir_orders_by_rank(tmp_path: Path, listeners: list[socket.socket]) -> None:
    for wid in ("tp1-pp1", "tp0-pp1", "tp1-pp0", "tp0-pp0"):
        listen_unix(str(tmp_path / f"{wid}.sock"), listeners)
    (tmp_path / "notes.sock").write_text("not a worker socket")
    found = discover(str(tmp_path), count=4)
    assert found == [f"unix:{tmp_path}/{w}.sock" for w in ("tp0-pp0", "tp1-pp0", "tp0-pp1", "tp1-pp1")]
    with pytest.raises(DiscoveryError, match="expected 3 workers"):
        discover(str(tmp_path), count=3)


def test_discover_refuses_a_socket_nobody_listens_on(tmp_path: Path, listeners: list[socket.socket]) -> None:
    listen_unix(str(tmp_path / "tp0-pp0.sock"), listeners)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "tp1-pp0.sock"))
    stale.close()  # the file stays, nothing accepts: a worker of an engine that exited
    with pytest.raises(DiscoveryError, match=r"tp1-pp0\.sock"):
        discover(str(tmp_path))
    assert discover(str(tmp_path), check_alive=False) == [
        f"unix:{tmp_path}/tp0-pp0.sock",
        f"unix:{tmp_path}/tp1-pp0.sock",
    ]


def test_discover_waits_for_workers_that_come_up_late(tmp_path: Path, listeners: list[socket.socket]) -> None:
    listen_unix(str(tmp_path / "tp0-pp0.sock"), listeners)
    late = threading.Timer(0.5, listen_unix, args=(str(tmp_path / "tp1-pp0.sock"), listeners))
    late.start()
    try:
        assert len(discover(str(tmp_path), count=2, timeout_s=60)) == 2
    finally:
        late.join()


def test_discover_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match="does not exist"):
        discover(str(tmp_path / "absent"))


def test_discover_base_address(listeners: list[socket.socket]) -> None:
    base = None
    for _ in range(50):  # two consecutive free loopback ports
        a = socket.socket()
        a.bind(("127.0.0.1", 0))
        b = socket.socket()
        try:
            b.bind(("127.0.0.1", a.getsockname()[1] + 1))
        except OSError:
            a.close()
            b.close()
            continue
        base = a.getsockname()[1]
        for s in (a, b):
            s.listen()
            listeners.append(s)
        break
    assert base is not None
    assert discover(base_address=f"127.0.0.1:{base}", count=2) == [
        f"127.0.0.1:{base}",
        f"127.0.0.1:{base + 1}",
    ]
    listeners[1].close()
    with pytest.raises(DiscoveryError, match=re.escape(f"127.0.0.1:{base + 1}")):
        discover(base_address=f"127.0.0.1:{base}", count=2)
    with pytest.raises(ValueError, match="needs count"):
        discover(base_address=f"127.0.0.1:{base}")


# ---------------------------------------------------------------------------- engine-thread queue


class EngineLoop(threading.Thread):
    """Drains the queue over and over, as the plugin's hook on Scheduler.ingest_requests does."""

    def __init__(self, q: EngineTaskQueue) -> None:
        super().__init__(daemon=True)
        self.q, self.stop = q, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.q.drain()
            self.stop.wait(0.001)


def test_tasks_run_on_the_draining_thread_and_return_or_raise() -> None:
    q = EngineTaskQueue(timeout_s=60)
    loop = EngineLoop(q)
    loop.start()
    try:
        assert q.call(threading.get_ident, what="ident") == loop.ident
        with pytest.raises(KeyError, match="boom"):
            q.call(lambda: {}["boom"], what="fails")
        # A task that submits another one runs it inline instead of waiting on itself.
        assert q.call(lambda: q.call(lambda: 7, what="inner"), what="outer") == 7
    finally:
        loop.stop.set()
        loop.join()
    assert q.drained_tasks == 3


def test_task_nobody_drains_is_withdrawn() -> None:
    q = EngineTaskQueue(timeout_s=0.2)
    ran: list[int] = []
    with pytest.raises(WeightwireError) as err:
        q.call(lambda: ran.append(1), what="load 3 tensor(s)")
    assert err.value.reason == "LOAD_FAILED" and "load 3 tensor(s)" in err.value.message
    assert q.drain() == 0 and ran == []


# ----------------------------------------------------------------------------- discover command


def run_discover_command(argv: list[str]) -> int:
    import argparse

    from weightwire.adapters.sglang import cli

    parser = argparse.ArgumentParser(prog="weightwire")
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["discover", *argv])
    return int(args.func(args))


def test_discover_command(
    tmp_path: Path, listeners: list[socket.socket], capsys: pytest.CaptureFixture[str]
) -> None:
    for wid in ("tp1-pp0", "tp0-pp0"):
        listen_unix(str(tmp_path / f"{wid}.sock"), listeners)
    assert run_discover_command([str(tmp_path), "--count", "2"]) == 0
    assert capsys.readouterr().out.split() == [
        f"unix:{tmp_path}/tp0-pp0.sock",
        f"unix:{tmp_path}/tp1-pp0.sock",
    ]
    assert run_discover_command([str(tmp_path), "--count", "3"]) == 1
    assert "expected 3 workers" in capsys.readouterr().err
    assert run_discover_command([]) == 2


# ------------------------------------------------------------------------------------------- wake


def test_wake_datagram_ends_an_idle_poll_and_is_drained() -> None:
    """What makes a push fast with sleep_on_idle: a sleeping scheduler's zmq poll returns as soon
    as a worker of its replica queues a step (the poll's own timeout is 1 s in SGLang)."""
    import time

    from weightwire.adapters.sglang.wake import WakeReceiver, WakeSender

    zmq = pytest.importorskip("zmq")
    key = f"unix:/test/{time.monotonic_ns()}"
    receiver = WakeReceiver(key, 0)
    sender = WakeSender(key, [0, 1, 3])  # 1 and 3: ranks that do not sleep (nothing bound): ignored
    poller = zmq.Poller()
    poller.register(receiver.fileno(), zmq.POLLIN)
    try:
        assert poller.poll(0) == []
        sender.wake()
        sender.wake()
        assert poller.poll(5000) != []  # readable: the poll ended on the datagram, not its timeout
        assert receiver.drain() == 2
        assert poller.poll(0) == []  # drained: the next idle poll sleeps again
        with pytest.raises(OSError):
            WakeReceiver(key, 0)  # one sleeper per name: a second engine with the same key cannot bind
    finally:
        receiver.close()
        sender.close()


def test_settings_use_the_shared_endpoint_rules() -> None:
    # one algorithm for every engine adapter: the same environment gives the same addresses as
    # EndpointSettings with SGLang's prefix, and TLS needs both halves
    from weightwire.adapters.endpoints import EndpointSettings

    env = {"WEIGHTWIRE_SGLANG_BASE_PORT": "41000"}
    rank = ParallelRank(tp_rank=1, tp_size=2)
    shared = EndpointSettings.from_env("WEIGHTWIRE_SGLANG", default_socket_dir="/unused", env=env)
    assert Settings.from_env(env).address(rank) == shared.address(rank) == "127.0.0.1:41001"
    with pytest.raises(SettingsError, match="needs both"):
        Settings.from_env({"WEIGHTWIRE_TLS_CERT": "/c.pem"})
