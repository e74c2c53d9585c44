"""The wire protocol of a transfer group's rendezvous store, both ends of it: ``WireStoreServer``
(what the trainer's ``StoreServer`` listens with) and ``WireStore``, a ``torch.distributed.Store``
that every member connects with, so that the rendezvous and gloo's and NCCL's own exchanges while
the process groups form all go through it. No gRPC in here.

The caller of JoinTransferGroup names the store's address, so a worker must not let that store
decide how much it allocates (torch's ``TCPStore`` client allocates whatever length the store
claims). Here every length is read as a fixed-size number and checked against a bound before
anything is allocated for it: a frame is at most ``MAX_FRAME_BYTES``, a key at most
``MAX_KEY_BYTES``, a value at most ``MAX_VALUE_BYTES``; every step has a deadline; values are bytes,
never unpickled. The table the server holds, with its bounds, is ``transfer_group_store_table``.

A frame is a 4-byte big-endian length and that many bytes: an op (requests) or a status
(responses), then fields, each a 4-byte big-endian length and its bytes, or an 8-byte signed
number. A connection starts with ``MAGIC`` in both directions.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from weightwire.core.transports.transfer_group_store_table import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    LocalStore,
    StoreProtocolError,
    StoreTable,
    StoreTimeout,
    as_bytes,
)

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "LocalStore",
    "StoreProtocolError",
    "StoreTable",
    "WireStore",
    "WireStoreServer",
]

MAGIC = b"WWSTORE1"
# A CHECK or WAIT lists at most this many keys.
MAX_KEYS_PER_CALL = 4096
MAX_FRAME_BYTES = MAX_VALUE_BYTES * 2 + 64 * 1024
MAX_CONNECTIONS = 8192
# The longest wait the server serves (a group's longest timeout).
MAX_WAIT_S = 3600.0
# Past its waiting time, how long a reply may take to arrive before the store counts as stuck
# (generous: the trainer serving it may be busy on a loaded machine).
REPLY_GRACE_S = 5.0

_SET, _GET, _ADD, _CAS, _CHECK, _WAIT, _NUM_KEYS, _DELETE = range(1, 9)
_OK, _TIMEOUT, _ERROR = range(3)
_LEN = struct.Struct(">I")
_INT = struct.Struct(">q")


def _value_of(fields: _Fields) -> bytes:
    return fields.blob(MAX_VALUE_BYTES)


def _number_of(fields: _Fields) -> int:
    return fields.number()


# What ``WireStore._call`` returns for a wait that timed out.
_TIMED_OUT = object()


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


class _Fields:
    """Reads the fields of one received frame, every length checked against what is left."""

    def __init__(self, body: bytes, at: int = 1) -> None:
        self.body, self.at = body, at

    def blob(self, limit: int) -> bytes:
        if self.at + 4 > len(self.body):
            raise StoreProtocolError("a field is cut short")
        (n,) = _LEN.unpack_from(self.body, self.at)
        if n > limit or self.at + 4 + n > len(self.body):
            raise StoreProtocolError(f"a field claims {n} bytes (at most {limit})")
        self.at += 4 + n
        return self.body[self.at - n : self.at]

    def key(self) -> str:
        return self.blob(MAX_KEY_BYTES).decode("utf-8", "replace")

    def number(self) -> int:
        if self.at + 8 > len(self.body):
            raise StoreProtocolError("a number is cut short")
        (v,) = _INT.unpack_from(self.body, self.at)
        self.at += 8
        return int(v)


def _blob(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


def _frame(head: int, *parts: bytes) -> bytes:
    body = bytes([head]) + b"".join(parts)
    return _LEN.pack(len(body)) + body


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """``n`` bytes (``n`` already checked against a bound), by ``deadline`` (monotonic) if given."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the store closed the connection")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket, deadline: float) -> bytes:
    head = _recv_exact(sock, 4, deadline)
    (n,) = _LEN.unpack(head)
    if not 1 <= n <= MAX_FRAME_BYTES:
        raise StoreProtocolError(f"a frame claims {n} bytes (at most {MAX_FRAME_BYTES})")
    return _recv_exact(sock, n, deadline)


# ---------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------


class WireStoreServer:
    """Serves ``table`` on ``sock`` (bound and listening), one thread per connection.

    A connection must send ``MAGIC`` within ``timeout_s``, and every frame it starts must arrive
    whole within ``timeout_s``; a connection that breaks a bound is closed. A wait lasts what the
    client asks (its group's timeout), at most ``MAX_WAIT_S``."""

    def __init__(self, sock: socket.socket, table: StoreTable, timeout_s: float) -> None:
        self._sock = sock
        self.table = table
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="ww-store-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="ww-store-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if _recv_exact(conn, len(MAGIC), time.monotonic() + self.timeout_s) != MAGIC:
                return
            conn.settimeout(None)
            conn.sendall(MAGIC)
            while True:
                # Between requests a connection may stay idle (a member between steps); once a
                # frame has begun it must arrive whole in time.
                conn.settimeout(None)
                head = _recv_exact(conn, 4, None)
                (n,) = _LEN.unpack(head)
                if not 1 <= n <= MAX_FRAME_BYTES:
                    return
                body = _recv_exact(conn, n, time.monotonic() + self.timeout_s)
                reply = self._answer(body)
                conn.settimeout(self.timeout_s)
                conn.sendall(reply)
        except (OSError, StoreProtocolError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _answer(self, body: bytes) -> bytes:
        op, f, t = body[0], _Fields(body), self.table
        try:
            if op == _SET:
                key = f.key()
                t.set(key, f.blob(MAX_VALUE_BYTES))
                return _frame(_OK)
            if op == _GET:
                key = f.key()
                value = t.get(key, min(f.number() / 1000, MAX_WAIT_S))
                return _frame(_TIMEOUT) if value is None else _frame(_OK, _blob(value))
            if op == _ADD:
                key = f.key()
                return _frame(_OK, _INT.pack(t.add(key, f.number())))
            if op == _CAS:
                key = f.key()
                expected = f.blob(MAX_VALUE_BYTES)
                return _frame(_OK, _blob(t.compare_set(key, expected, f.blob(MAX_VALUE_BYTES))))
            if op in (_CHECK, _WAIT):
                wait_ms = f.number() if op == _WAIT else 0
                count = f.number()
                if not 0 <= count <= MAX_KEYS_PER_CALL:
                    raise StoreProtocolError(f"{count} keys in one call (at most {MAX_KEYS_PER_CALL})")
                keys = [f.key() for _ in range(count)]
                if op == _CHECK:
                    return _frame(_OK, _INT.pack(int(t.check(keys))))
                return _frame(_OK if t.wait(keys, min(wait_ms / 1000, MAX_WAIT_S)) else _TIMEOUT)
            if op == _NUM_KEYS:
                return _frame(_OK, _INT.pack(t.num_keys()))
            if op == _DELETE:
                return _frame(_OK, _INT.pack(int(t.delete(f.key()))))
            raise StoreProtocolError(f"unknown op {op}")
        except StoreProtocolError as e:
            return _frame(_ERROR, _blob(str(e).encode()[:512]))

    def close(self) -> None:
        """Stop accepting. Connections already open are served until their members hang up (a
        formed group's backend may still look at the store, as NCCL's monitor does)."""
        with self._lock:
            self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._sock.close()


# ---------------------------------------------------------------------------------------------
# Client
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _failures_end(end: Callable[[], None], timed_out: str, broken: str) -> Iterator[None]:
    """A client step: on a timeout, a socket error or a broken bound, ``end()`` the connection and
    raise one ``StoreProtocolError`` (``timed_out``, or ``broken`` with what broke)."""
    try:
        yield
    except TimeoutError:
        end()
        raise StoreProtocolError(timed_out) from None
    except (OSError, StoreProtocolError) as e:
        end()
        raise StoreProtocolError(f"{broken}: {e}") from None


class WireStore(torch.distributed.Store):
    """A member's connection to the store at ``host:port``, as a ``torch.distributed.Store``.

    Every reply is read with a deadline (the wait the request asked for plus ``REPLY_GRACE_S``)
    and every length in it is checked against its bound before anything is allocated for it. A
    broken bound, a reply past its deadline or a closed connection raise ``StoreProtocolError``,
    and the connection is closed (every later call fails at once)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        super().__init__()
        self._where = (host, port)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        deadline = time.monotonic() + timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=max(timeout_s, 0.001))
        except OSError as e:
            raise StoreProtocolError(f"cannot connect: {e.strerror or e}") from None
        with _failures_end(
            sock.close,
            "connected, but the store never answered",
            "connected, but the store's greeting failed",
        ):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(MAGIC)
            if _recv_exact(sock, len(MAGIC), deadline) != MAGIC:
                raise StoreProtocolError("the peer is not a weightwire store (wrong greeting)")
        self._sock: socket.socket | None = sock

    def _call(self, request: bytes, wait_s: float = 0.0, read: Callable[[_Fields], Any] | None = None) -> Any:
        """Send ``request`` and read its reply: ``read(fields)`` of an OK reply (``None`` without
        ``read``), ``_TIMED_OUT`` for a wait that timed out. A reply that breaks the protocol
        (a length past its bound included, in the frame or in a field) closes the connection."""
        with self._lock:
            sock = self._sock
            if sock is None:
                raise StoreProtocolError("the connection to the store was closed after an earlier failure")
            with _failures_end(
                self._drop, "timed out: the store did not answer in time", "the store broke the protocol"
            ):
                sock.settimeout(self._timeout_s + REPLY_GRACE_S)
                sock.sendall(request)
                body = _recv_frame(sock, time.monotonic() + wait_s + REPLY_GRACE_S)
                status, fields = body[0], _Fields(body)
                if status == _ERROR:
                    refusal = fields.blob(512).decode("utf-8", "replace")
                elif status == _TIMEOUT:
                    return _TIMED_OUT
                elif status == _OK:
                    return None if read is None else read(fields)
                else:
                    raise StoreProtocolError(f"the store answered status {status}")
        raise StoreProtocolError(f"the store refused: {refusal}")

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        with self._lock:
            self._drop()

    @staticmethod
    def _key(key: str) -> bytes:
        raw = key.encode()
        if len(raw) > MAX_KEY_BYTES:
            raise StoreProtocolError(f"a key of {len(raw)} bytes (at most {MAX_KEY_BYTES})")
        return _blob(raw)

    @staticmethod
    def _value(value: Any) -> bytes:
        raw = as_bytes(value)
        if len(raw) > MAX_VALUE_BYTES:
            raise StoreProtocolError(f"a value of {len(raw)} bytes (at most {MAX_VALUE_BYTES})")
        return _blob(raw)

    def set(self, key: str, value: Any) -> None:
        self._call(_frame(_SET, self._key(key), self._value(value)))

    def get(self, key: str) -> bytes:
        wait_s = self._timeout_s
        value = self._call(_frame(_GET, self._key(key), _INT.pack(int(wait_s * 1000))), wait_s, _value_of)
        if value is _TIMED_OUT:
            raise StoreTimeout(f"timed out after {wait_s:g} s waiting for key {key[:80]!r}")
        return value  # type: ignore[no-any-return]

    def add(self, key: str, amount: int) -> int:
        return self._call(_frame(_ADD, self._key(key), _INT.pack(int(amount))), read=_number_of)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        request = _frame(_CAS, self._key(key), self._value(expected), self._value(desired))
        return self._call(request, read=_value_of)  # type: ignore[no-any-return]

    def _keys(self, keys: Sequence[str]) -> bytes:
        if len(keys) > MAX_KEYS_PER_CALL:
            raise StoreProtocolError(f"{len(keys)} keys in one call (at most {MAX_KEYS_PER_CALL})")
        return _INT.pack(len(keys)) + b"".join(self._key(k) for k in keys)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(_frame(_CHECK, self._keys(keys)), read=_number_of))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        wait_s = self._timeout_s if timeout is None else timeout.total_seconds()
        if self._call(_frame(_WAIT, _INT.pack(int(wait_s * 1000)), self._keys(keys)), wait_s) is _TIMED_OUT:
            raise StoreTimeout(f"timed out after {wait_s:g} s waiting for {len(keys)} key(s)")

    def num_keys(self) -> int:
        return self._call(_frame(_NUM_KEYS), read=_number_of)  # type: ignore[no-any-return]

    def delete_key(self, key: str) -> bool:
        return bool(self._call(_frame(_DELETE, self._key(key)), read=_number_of))

    def clone(self) -> WireStore:
        return WireStore(*self._where, self._timeout_s)
