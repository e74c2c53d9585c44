"""The control channel between a worker and its gloo receiving process: whole messages both ways,
descriptors passed with them, and what is not a message of the channel (a length past the bound,
bytes that are not a JSON object, a hang-up mid-message) ends it instead of being read."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

import pytest
from weightwire.core.transports.isolated_gloo_channel import MAX_MESSAGE_BYTES, Channel, ChannelClosed


@pytest.fixture
def pair() -> Iterator[tuple[Channel, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield Channel(ours), theirs
    ours.close()
    theirs.close()


def test_messages_and_descriptors_arrive_whole(pair: tuple[Channel, socket.socket]) -> None:
    channel, raw = pair
    other = Channel(raw)
    r, w = os.pipe()
    try:
        other.send({"do": "segment", "size": 5}, [w])
        other.send({"posts": [{"id": i, "bufs": [[0, i * 64, 64, "uint8"]]} for i in range(300)]})
        message, fds = channel.recv()
        assert message == {"do": "segment", "size": 5} and len(fds) == 1
        os.write(fds[0], b"hello")  # the descriptor is the pipe's write end
        assert os.read(r, 5) == b"hello"
        os.close(fds[0])
        message, fds = channel.recv()
        assert fds == [] and len(message["posts"]) == 300 and message["posts"][299]["bufs"][0][1] == 299 * 64
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize(
    "data",
    [
        struct.pack("<I", MAX_MESSAGE_BYTES + 1) + b"{}",  # a length past the bound: never allocated
        struct.pack("<I", 7) + b"not json",
        struct.pack("<I", 2) + b"[]",  # JSON, but not an object
        struct.pack("<I", 100) + b'{"do":',  # then the other end hangs up mid-message
    ],
    ids=["too long", "not json", "not an object", "cut short"],
)
def test_what_is_not_a_message_ends_the_channel(pair: tuple[Channel, socket.socket], data: bytes) -> None:
    channel, raw = pair
    raw.sendall(data)
    raw.shutdown(socket.SHUT_WR)
    with pytest.raises(ChannelClosed):
        channel.recv()


def test_a_message_over_the_bound_is_not_sent(pair: tuple[Channel, socket.socket]) -> None:
    channel, _ = pair
    with pytest.raises(ValueError, match="over"):
        channel.send({"blob": "x" * MAX_MESSAGE_BYTES})
