"""The keys and values a transfer group's rendezvous store holds: the table with its bounds and
waits, and the same table as a ``torch.distributed.Store`` in the serving process (``LocalStore``).

``transfer_group_wire`` serves this table over its protocol (``WireStoreServer``) and reads a remote
one (``WireStore``); both raise the errors defined here. No gRPC in here.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence
from typing import Any

import torch

# What one value may weigh: gloo's address record of a 4096-member group is about 0.6 MiB; every
# record of weightwire's own is a few KiB at most.
MAX_VALUE_BYTES = 1 << 20
MAX_KEY_BYTES = 1024
# What the server holds in all (a member that writes past it is refused, the store stays up).
MAX_STORE_BYTES = 256 << 20


class StoreProtocolError(RuntimeError):
    """The peer does not speak this protocol, broke a bound, or did not answer in time."""


class StoreTimeout(StoreProtocolError):
    """A wait on the store timed out (the message says "timed out", which callers classify)."""


def as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class StoreTable:
    """The keys and values a store holds, bounded in size, with waits on them."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.weight = 0
        self.cv = threading.Condition()

    def _put(self, key: str, value: bytes) -> None:
        if len(key.encode()) > MAX_KEY_BYTES or len(value) > MAX_VALUE_BYTES:
            raise StoreProtocolError(
                f"a key or value past its bound (keys at most {MAX_KEY_BYTES} bytes, values at most {MAX_VALUE_BYTES})"
            )
        old = self.data.get(key)
        weight = self.weight + len(key) + len(value) - (0 if old is None else len(key) + len(old))
        if weight > MAX_STORE_BYTES:
            raise StoreProtocolError(f"the store holds its {MAX_STORE_BYTES} bytes already")
        self.data[key] = value
        self.weight = weight
        self.cv.notify_all()

    def set(self, key: str, value: bytes) -> None:
        with self.cv:
            self._put(key, value)

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: all(k in self.data for k in keys), max(timeout_s, 0.0))

    def get(self, key: str, timeout_s: float) -> bytes | None:
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.data, max(timeout_s, 0.0)):
                return None
            return self.data[key]

    def add(self, key: str, amount: int) -> int:
        with self.cv:
            try:
                value = int(self.data.get(key, b"0")) + amount
            except ValueError:
                raise StoreProtocolError(f"key {key[:80]!r} does not hold a number") from None
            self._put(key, str(value).encode())
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        # torch's semantics: an absent key with an empty ``expected`` is set; the reply is the
        # value held afterwards (or ``expected`` when the key is absent and was not set).
        with self.cv:
            current = self.data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._put(key, desired)
                return desired
            return expected if current is None else current

    def check(self, keys: Sequence[str]) -> bool:
        with self.cv:
            return all(k in self.data for k in keys)

    def num_keys(self) -> int:
        with self.cv:
            return len(self.data)

    def delete(self, key: str) -> bool:
        with self.cv:
            old = self.data.pop(key, None)
            if old is None:
                return False
            self.weight -= len(key) + len(old)
            return True


class LocalStore(torch.distributed.Store):
    """The server's table as a ``torch.distributed.Store`` in the serving process (the trainer
    forms its side of a group on it without a connection)."""

    def __init__(self, table: StoreTable, timeout_s: float) -> None:
        super().__init__()
        self._table = table
        self._timeout_s = timeout_s

    def set(self, key: str, value: Any) -> None:
        self._table.set(key, as_bytes(value))

    def get(self, key: str) -> bytes:
        value = self._table.get(key, self._timeout_s)
        if value is None:
            raise StoreTimeout(f"timed out after {self._timeout_s:g} s waiting for key {key[:80]!r}")
        return value

    def add(self, key: str, amount: int) -> int:
        return self._table.add(key, int(amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._table.compare_set(key, as_bytes(expected), as_bytes(desired))

    def check(self, keys: list[str]) -> bool:
        return self._table.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        wait_s = self._timeout_s if timeout is None else timeout.total_seconds()
        if not self._table.wait(keys, wait_s):
            raise StoreTimeout(f"timed out after {wait_s:g} s waiting for {len(keys)} key(s)")

    def num_keys(self) -> int:
        return self._table.num_keys()

    def delete_key(self, key: str) -> bool:
        return self._table.delete(key)

    def clone(self) -> LocalStore:
        return LocalStore(self._table, self._timeout_s)
