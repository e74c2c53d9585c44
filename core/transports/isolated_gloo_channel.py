"""The control channel between a worker and its gloo receiving process (``isolated_gloo``): one
Unix socket pair, each message a 4-byte length and a JSON object, file descriptors (shared-memory
segments) passed alongside with ``SCM_RIGHTS``. Nothing is unpickled; every length is bounded.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Any

__all__ = ["MAX_MESSAGE_BYTES", "Channel", "ChannelClosed"]

# A message names operations and buffers, never bytes of a tensor: a batch of posts stays far below.
MAX_MESSAGE_BYTES = 16 << 20
_MAX_FDS = 4
_HEADER = struct.Struct("<I")


class ChannelClosed(Exception):
    """The other end hung up (or sent something that is not a message of this channel)."""


class Channel:
    """One end of the pair. ``send`` may be called from several threads; ``recv`` from one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        body = json.dumps(message, separators=(",", ":")).encode()
        if len(body) > MAX_MESSAGE_BYTES:
            raise ValueError(f"a control message of {len(body)} bytes is over {MAX_MESSAGE_BYTES}")
        data = _HEADER.pack(len(body)) + body
        with self._send_lock:
            try:
                if fds:
                    sent = socket.send_fds(self.sock, [data[:1]], fds)
                    if sent != 1:
                        raise ChannelClosed("the descriptor message was not sent whole")
                    self.sock.sendall(data[1:])
                else:
                    self.sock.sendall(data)
            except OSError as e:
                raise ChannelClosed(str(e)) from None

    def recv(self) -> tuple[dict[str, Any], list[int]]:
        """The next message and the descriptors that came with it; ``ChannelClosed`` at the end."""
        try:
            first, fds, _, _ = socket.recv_fds(self.sock, 1, _MAX_FDS)
        except OSError as e:
            raise ChannelClosed(str(e)) from None
        if not first:
            raise ChannelClosed("hung up")
        head = first + self._exact(_HEADER.size - 1)
        (length,) = _HEADER.unpack(head)
        if length > MAX_MESSAGE_BYTES:
            raise ChannelClosed(f"a control message claims {length} bytes")
        try:
            message = json.loads(self._exact(length))
        except ValueError as e:
            raise ChannelClosed(f"not a control message: {e}") from None
        if not isinstance(message, dict):
            raise ChannelClosed("not a control message")
        return message, list(fds)

    def _exact(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except OSError as e:
                raise ChannelClosed(str(e)) from None
            if not chunk:
                raise ChannelClosed("hung up mid-message")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
