"""Where vLLM workers listen (settings from the environment) and how a trainer finds them
(discovery over real Unix sockets). No engine: pure functions and real sockets."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from weightwire.adapters.discovery import DiscoveryError, discover
from weightwire.adapters.endpoints import SettingsError, prepare_socket, worker_index
from weightwire.adapters.vllm.plugin import check_version, version_supported
from weightwire.adapters.vllm.settings import Settings, default_socket_dir
from weightwire.core.manifest import ParallelRank


@pytest.mark.parametrize(
    ("rank", "index", "name"),
    [
        (ParallelRank(), 0, "tp0-pp0"),
        (ParallelRank(tp_rank=1, tp_size=2), 1, "tp1-pp0"),
        (ParallelRank(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2), 3, "tp1-pp1"),
        (ParallelRank(tp_rank=0, tp_size=2, pp_rank=1, pp_size=2, dp_rank=1, dp_size=2), 6, "tp0-pp1-dp1"),
    ],
)
def test_addresses_follow_vllms_global_rank_order(
    rank: ParallelRank, index: int, name: str, tmp_path: Path
) -> None:
    assert worker_index(rank) == index
    unix = Settings.from_env("abc", {"WEIGHTWIRE_VLLM_SOCKET_DIR": str(tmp_path)})
    assert unix.endpoints.address(rank) == f"unix:{tmp_path}/{name}.sock"
    tcp = Settings.from_env("abc", {"WEIGHTWIRE_VLLM_BASE_PORT": "41000"})
    assert tcp.endpoints.address(rank) == f"127.0.0.1:{41000 + index}"


def test_default_directory_is_per_engine_instance() -> None:
    a, b = Settings.from_env("1a2b3", {}), Settings.from_env("9f8e7", {})
    assert a.endpoints.socket_dir == default_socket_dir("1a2b3") != b.endpoints.socket_dir
    # Only the id's letters, digits, '-' and '_' reach the path.
    assert Path(default_socket_dir("../x y")).name == "weightwire-vllm-xy"


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"WEIGHTWIRE_VLLM_SOCKET_DIR": "/tmp/x", "WEIGHTWIRE_VLLM_BASE_PORT": "4000"}, "not both"),
        ({"WEIGHTWIRE_VLLM_BASE_PORT": "http"}, "not a port number"),
        ({"WEIGHTWIRE_VLLM_BASE_PORT": "70000"}, "outside 1..65535"),
        ({"WEIGHTWIRE_VLLM_BASE_PORT": "4000", "WEIGHTWIRE_VLLM_HOST": "10.1.2.3"}, "WEIGHTWIRE_TOKEN"),
        ({"WEIGHTWIRE_TLS_CERT": "/c.pem"}, "both"),
        ({"WEIGHTWIRE_VLLM_FORWARD_WAIT_S": "0"}, "must be > 0"),
        ({"WEIGHTWIRE_VLLM_FINISH_WAIT_S": "soon"}, "not a number"),
        # float() reads these; a wait of nan or inf seconds never ends (or never starts).
        ({"WEIGHTWIRE_VLLM_FINISH_WAIT_S": "nan"}, "finite"),
        ({"WEIGHTWIRE_VLLM_FORWARD_WAIT_S": "inf"}, "finite"),
        ({"WEIGHTWIRE_VLLM_DIRECT_COPY": "maybe"}, "use 1 or 0"),
    ],
)
def test_bad_settings_say_what_to_change(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(SettingsError, match=fragment):
        Settings.from_env("abc", env)


def test_socket_path_over_the_kernel_limit_is_refused(tmp_path: Path) -> None:
    long_dir = tmp_path / ("d" * 100)
    settings = Settings.from_env("abc", {"WEIGHTWIRE_VLLM_SOCKET_DIR": str(long_dir)})
    with pytest.raises(SettingsError, match="WEIGHTWIRE_VLLM_SOCKET_DIR"):
        settings.endpoints.address(ParallelRank())


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[list[Path]]:
    """Two real listening sockets named as a TP=2 engine names them, plus a stale one."""
    sockets = []
    paths = [tmp_path / "tp0-pp0.sock", tmp_path / "tp1-pp0.sock"]
    for p in paths:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(p))
        s.listen(1)
        sockets.append(s)
    try:
        yield paths
    finally:
        for s in sockets:
            s.close()


def test_discovery_lists_live_workers_in_rank_order(listening: list[Path], tmp_path: Path) -> None:
    assert discover(str(tmp_path), count=2) == [f"unix:{p}" for p in listening]
    with pytest.raises(DiscoveryError, match="expected 4 workers"):
        discover(str(tmp_path), count=4)


def test_discovery_and_start_refuse_a_dead_socket_and_a_live_one(
    listening: list[Path], tmp_path: Path
) -> None:
    stale = tmp_path / "tp0-pp1.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # bound, never listening: what an engine that died leaves behind
    with pytest.raises(DiscoveryError, match="no worker listening"):
        discover(str(tmp_path))
    prepare_socket(str(stale))  # a starting worker removes it...
    assert not stale.exists()
    with pytest.raises(FileExistsError, match="another worker is listening"):
        prepare_socket(str(listening[0]))  # ...but never takes over a live one


@pytest.mark.parametrize("version", ["0.26.0", "0.27.1", "0.32.0", "0.32.0+cpu", "0.33.0", "0.33.2"])
def test_releases_in_the_supported_range_are_accepted(version: str) -> None:
    assert version_supported(version)
    check_version(version, env={})


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "1.0.0", "0.9.2", "unknown"])
def test_other_releases_are_refused_with_the_range_named(version: str) -> None:
    assert not version_supported(version)
    with pytest.raises(
        RuntimeError,
        match=rf"vLLM {re.escape(version)} is outside .*0\.26 through 0\.33.*WEIGHTWIRE_VLLM_ALLOW_UNTESTED=1",
    ):
        check_version(version, env={})
    check_version(version, env={"WEIGHTWIRE_VLLM_ALLOW_UNTESTED": "1"})  # the user's explicit choice
