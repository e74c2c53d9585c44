"""The rendezvous store's own protocol (``transfer_group_wire``): torch's store operations round-trip
through a real ``StoreServer`` on loopback; every length a peer claims is checked against its bound
before anything is allocated (a lying reply is refused, the client's connection closed); a server
refuses what is past its bounds and keeps serving; a peer that speaks another protocol, or none,
is unreachable within the timeout."""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from weightwire.core.errors import WeightwireError
from weightwire.core.transports.transfer_group_store import StoreServer, connect_store
from weightwire.core.transports.transfer_group_wire import (
    MAGIC,
    MAX_FRAME_BYTES,
    MAX_VALUE_BYTES,
    StoreProtocolError,
)

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def server() -> Iterator[StoreServer]:
    s = StoreServer(HOST, 0, timeout_s=5.0)
    yield s
    s.close()


def test_store_operations_round_trip(server: StoreServer) -> None:
    client = connect_store(server.address, 2.0)
    prefixed = torch.distributed.PrefixStore("g", client)
    prefixed.set("a", b"\x00\x01value")  # type: ignore[arg-type]  # torch takes bytes too
    assert prefixed.get("a") == b"\x00\x01value"
    # The trainer's in-process store is the same table.
    assert server.store.get("g/a") == b"\x00\x01value"
    assert prefixed.add("n", 3) == 3 and prefixed.add("n", -1) == 2
    assert prefixed.compare_set("c", "", "first") == b"first"
    assert prefixed.compare_set("c", "", "second") == b"first"
    assert prefixed.compare_set("c", "first", "third") == b"third"
    assert prefixed.check(["a", "c"]) and not prefixed.check(["a", "missing"])
    prefixed.wait(["a", "n"])
    later = threading.Timer(0.2, lambda: server.store.set("g/late", "here"))
    later.start()
    assert prefixed.get("late") == b"here"
    # (torch forwards no delete through a PrefixStore to a Python store; the client has its own.)
    assert client.delete_key("g/a") and not client.delete_key("g/a")
    assert client.num_keys() >= 3
    started = time.monotonic()
    with pytest.raises(Exception, match="timed out"):
        prefixed.wait(["never"], datetime.timedelta(seconds=0.3))
    assert time.monotonic() - started < 2.0


def test_a_value_at_its_bound_passes_and_one_past_it_is_refused_by_both_ends(server: StoreServer) -> None:
    client = connect_store(server.address, 2.0)
    big = bytes(range(256)) * (MAX_VALUE_BYTES // 256)
    client.set("big", big)
    assert client.get("big") == big
    with pytest.raises(StoreProtocolError, match="at most"):
        client.set("bigger", big + b"x")
    with pytest.raises(StoreProtocolError, match="at most"):
        server.store.set("bigger", big + b"x")
    assert not client.check(["bigger"])


def _liar(reply: Callable[[socket.socket], None]) -> tuple[socket.socket, str]:
    """A server that greets like a weightwire store and answers the first request with ``reply``."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(4)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            try:
                conn.recv(len(MAGIC))
                conn.sendall(MAGIC)
                conn.recv(65536)
                reply(conn)
                while conn.recv(65536):
                    pass
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    return listener, f"{HOST}:{listener.getsockname()[1]}"


@pytest.mark.parametrize(
    "lie",
    [
        pytest.param(lambda c: c.sendall(struct.pack(">I", 384 << 20)), id="frame"),
        # A small frame (status OK) whose value field claims 384 MiB.
        pytest.param(lambda c: c.sendall(struct.pack(">IBI", 5, 0, 384 << 20)), id="field"),
        pytest.param(lambda c: c.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1)), id="just-past"),
    ],
)
def test_a_reply_that_claims_more_than_its_bound_is_refused_at_once(
    lie: Callable[[socket.socket], None],
) -> None:
    listener, address = _liar(lie)
    try:
        client = connect_store(address, 5.0)
        started = time.monotonic()
        with pytest.raises(StoreProtocolError, match="claims"):
            client.get("k")
        assert time.monotonic() - started < 2.0
        with pytest.raises(StoreProtocolError, match="closed"):
            client.check(["k"])
    finally:
        listener.close()


def test_a_server_drops_a_connection_that_claims_a_huge_frame_and_keeps_serving(server: StoreServer) -> None:
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(MAGIC)
        assert raw.recv(len(MAGIC)) == MAGIC
        raw.sendall(struct.pack(">I", 384 << 20))
        assert raw.recv(1) == b""  # closed by the server
    client = connect_store(server.address, 2.0)
    client.set("after", "ok")
    assert client.get("after") == b"ok"


@pytest.mark.parametrize(
    "answer", [b"", b"HTTP/1.1 400 Bad Request\r\n\r\n"], ids=["silent", "other-protocol"]
)
def test_a_peer_that_does_not_greet_is_unreachable_within_the_timeout(answer: bytes) -> None:
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(4)
    held: list[socket.socket] = []

    def accept() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        held.append(conn)
        if answer:
            conn.sendall(answer)

    threading.Thread(target=accept, daemon=True).start()
    try:
        started = time.monotonic()
        with pytest.raises(WeightwireError) as refused:
            connect_store(f"{HOST}:{listener.getsockname()[1]}", 0.5)
        assert refused.value.reason == "GROUP_STORE_UNREACHABLE"
        assert time.monotonic() - started < 1.5
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_a_closed_server_takes_no_new_connection_and_serves_the_open_ones() -> None:
    server = StoreServer(HOST, 0, timeout_s=5.0)
    client = connect_store(server.address, 2.0)
    client.set("k", "v")
    address = server.address
    server.close()
    assert client.get("k") == b"v"
    with pytest.raises(WeightwireError) as refused:
        connect_store(address, 0.5)
    assert refused.value.reason == "GROUP_STORE_UNREACHABLE"
