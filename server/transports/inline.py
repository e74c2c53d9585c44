"""The worker's importer for bytes carried in the message itself (small updates, a fallback).

The transport table (``weightwire.core.transports.table.INLINE``) names ``InlineImporter``. The bytes
belong to the request message, so they are viewed in place; their length must equal ``size_bytes``.
"""

from __future__ import annotations

import warnings
import zlib

import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.transports import table as transports
from weightwire.server.rules.views import ReadBatch
from weightwire.server.transports.importer import ImportContext, ImportedPayload, PayloadImporter
from weightwire.v1 import weight_transfer_pb2 as pb

__all__ = ["InlineImporter"]

# torch warns once per process that a read-only buffer gives a writable-typed tensor. The views are
# only ever read (copied into the model), so the warning carries no information here: trigger the
# one-time warning now, silently, instead of changing the process's warning filters.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


class _InlineBytes:
    copy_chunk_bytes: int | None = None

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.size_bytes = len(data)

    def fetch(self, batch: ReadBatch) -> torch.Tensor:
        if not self.size_bytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._data, dtype=torch.uint8, count=self.size_bytes)  # type: ignore[call-overload]

    def crc32(self, size_bytes: int) -> int:
        return zlib.crc32(memoryview(self._data)[:size_bytes])

    def close(self) -> None:
        self._data = b""


class InlineImporter(PayloadImporter):
    """Bytes carried in the message itself. Length must equal size_bytes."""

    TRANSPORT = transports.INLINE
    bytes_in_message = True

    def check(self, payload: pb.Payload) -> None:
        if len(payload.inline_data) != payload.size_bytes:
            raise WeightwireError(
                Reason.INVALID_SIZE,
                f"inline payload carries {len(payload.inline_data)} bytes but size_bytes says {payload.size_bytes}",
            )

    def open(self, payload: pb.Payload, ctx: ImportContext) -> tuple[ImportedPayload, bool]:
        return _InlineBytes(payload.inline_data), True
