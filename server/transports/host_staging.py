"""Host tensors a worker receives slices into over gloo, kept from one update to the next: an
SGLang or vLLM worker's slices held until the update commits (``filled_bucket``: a stager's
bucket), and the host copies of a torch-adapter worker's kept tensors on a GPU
(``transfer_group_slices.receive_bucket``).

Host memory allocated fresh is paid for again at its first touch on every update: a bucket's
bytes copied from the receiving process into new tensors ran at about 2.5 x the time of the same
copy into tensors touched before (``bench/bench_host_staging.py``). So the buffers stay, one per
kept tensor name, while the worker's group lives.

A buffer is handed out as a view of its own. It is handed out again only when nothing refers to its
storage any more: neither that view, nor anything made from it (an engine's loader may keep what it
was given, or a view of it). A buffer still referred to is left to whoever holds it and a new one
takes its place, so nothing outside the pool ever sees its bytes change. Where torch does not tell
how many refer to a storage, every buffer is new (as before the pool).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

__all__ = ["HostStaging"]

# What refers to an idle buffer's storage while it is counted: the pool's own tensor and the
# storage object the count is read through.
_IDLE_USES = 2


def _storage_uses(t: torch.Tensor) -> int | None:
    """How many tensors and storage objects refer to ``t``'s storage, or None where torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(t.untyped_storage()._cdata))


class HostStaging:
    """Per kept tensor name, a host buffer of its shape and dtype that is reused once idle."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def take(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` for ``name``'s bytes: the kept buffer if it has
        that shape and dtype and nothing refers to it, else a new one kept in its place. Its
        contents are whatever was there: the receive writes every byte."""
        shape = torch.Size(shape)
        with self._lock:
            base = self._buffers.get(name)
            if (
                base is None
                or base.shape != shape
                or base.dtype != dtype
                or _storage_uses(base) != _IDLE_USES
            ):
                base = torch.empty(shape, dtype=dtype)
                self._buffers[name] = base
            return base.view(shape)

    @property
    def kept_bytes(self) -> int:
        """Bytes of host memory the pool keeps."""
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._buffers.values())
