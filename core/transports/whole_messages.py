"""Every message of a transfer group checked whole when it lands, with no copy of its bytes.

torch.distributed tells a receiver nothing about what arrived: gloo completes the receive of a
message shorter than the posted buffer as if it were whole (the rest of the buffer keeps what it
held), and NCCL requires matching sizes without checking them. Counting the planned bytes as
received would then commit old bytes as new ones.

So a sender first sends each receiver an **announcement** of the messages that follow: the byte
count and the last byte of each, closed by a marker and the message count (``announce``). The
receiver checks the counts against its own plan (``Arrivals.open``), then, before posting each
receive, writes the complement of the announced last byte over the last byte of the message's
landing zone (``Arrivals.prime``; a receive held back from the tensor until the update commits is
primed where it is held instead, ``Arrivals.primed``, so a failed update never wrote the tensor at
all). After the receive that byte must equal the announced one
(``Arrivals.check``): a message short by even one byte leaves its last byte unwritten, and that
byte then differs from the announced one in every bit. The announcement lands in a buffer whose
closing marker was primed the same way, so a short announcement is caught too.

The cost is one small message per sender and receiver per update and one byte written and read
per message; payloads still go from and land in tensors in place.

Both transfer-group planes use it: ``transfer_group_slices`` (every trainer rank a source) and the
single-source point-to-point and broadcast buckets (``client/transports/transfer_group_link`` and
``server/transports/transfer_group_member``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from weightwire.core.errors import Reason, WeightwireError

__all__ = ["Arrivals", "announce", "announcement_nbytes", "last_byte"]

# Closes every announcement, before the message count ("wwannou1" as a little-endian int64).
_MARKER = int.from_bytes(b"wwannou1", "little", signed=True)


def announcement_nbytes(count: int) -> int:
    """Bytes of the announcement of ``count`` messages: an int64 byte count and an int64 last byte
    per message, then the marker and the count."""
    return 16 * (count + 1)


def last_byte(t: torch.Tensor) -> torch.Tensor:
    """The last byte of ``t``'s elements in row-major order (what a message made of ``t`` ends
    with), as a one-element uint8 view: no copy, even when ``t`` is not contiguous."""
    if t.numel() == 0:
        raise ValueError("a transfer-group message is never empty")
    return t[(-1,) * t.dim()].reshape(1).view(torch.uint8)[-1:]


def announce(messages: Sequence[tuple[int, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The announcement a sender sends a receiver before ``messages``: ``(byte count, last byte)``
    of each (``last_byte`` of its content), in the order they are then sent. Built on ``device``
    without reading anything back to the host."""
    n = len(messages)
    closing = torch.tensor([_MARKER, n], dtype=torch.int64, device=device)
    if n == 0:
        return closing.view(torch.uint8)
    sizes = torch.tensor([s for s, _ in messages], dtype=torch.int64, device=device)
    lasts = torch.cat([b.to(device) for _, b in messages]).to(torch.int64)
    return torch.cat([torch.stack([sizes, lasts], 1).reshape(-1), closing]).view(torch.uint8)


class Arrivals:
    """The receiver's side for one sender: the buffer its announcement lands in, then the checks
    around each message's receive. ``sizes`` are the byte counts this receiver's own plan expects
    from that sender, in order; ``what`` names the sender in errors."""

    def __init__(self, sizes: Sequence[int], device: torch.device, what: str) -> None:
        self.sizes = [int(s) for s in sizes]
        self.what = what
        self.buffer = torch.empty(announcement_nbytes(len(self.sizes)), dtype=torch.uint8, device=device)
        closing = torch.tensor([_MARKER, len(self.sizes)], dtype=torch.int64, device=device)
        self.buffer[-16:].copy_(torch.bitwise_not(closing).view(torch.uint8))
        self._lasts: list[int] = []

    def open(self) -> None:
        """Check the announcement that arrived: whole, and announcing the planned sizes. Raises
        MESSAGE_TRUNCATED or GROUP_PLAN_MISMATCH."""
        words = self.buffer.cpu().view(torch.int64).tolist()
        n = len(self.sizes)
        if words[-2:] != [_MARKER, n]:
            raise WeightwireError(
                Reason.MESSAGE_TRUNCATED,
                f"{self.what}: the announcement of {n} message(s) arrived short or malformed (its "
                "closing marker is not there); nothing from this sender counts as received",
            )
        for i, (got, want) in enumerate(zip(words[0 : 2 * n : 2], self.sizes, strict=True)):
            if got != want:
                raise WeightwireError(
                    Reason.GROUP_PLAN_MISMATCH,
                    f"{self.what}: message {i} is announced as {got} bytes, but this member's plan "
                    f"expects {want}; every member must plan from the same holdings and manifests",
                )
        self._lasts = [w & 0xFF for w in words[1 : 2 * n : 2]]

    def primed(self, index: int, target: torch.Tensor) -> int:
        """The byte to write over the last byte of message ``index``'s landing zone before its
        receive is posted: the complement of the announced one. For a receive staged away from
        ``target`` (its bytes reach ``target`` only when the update commits), written where it is
        staged, never into ``target``: that is the model, which a failed update must leave as it was."""
        self._check_size(index, target)
        return 0xFF ^ self._lasts[index]

    def prime(self, index: int, target: torch.Tensor) -> None:
        """Before posting the receive of message ``index`` into ``target`` (contiguous): its last
        byte gets the complement of the announced one (``primed``)."""
        _flat(target)[-1:].fill_(self.primed(index, target))

    def check(self, index: int, target: torch.Tensor) -> None:
        """After the receive of message ``index`` into ``target``: it ends with the announced byte,
        i.e. every byte of it arrived. Raises MESSAGE_TRUNCATED."""
        self._check_size(index, target)
        if int(_flat(target)[-1].item()) != self._lasts[index]:
            raise WeightwireError(
                Reason.MESSAGE_TRUNCATED,
                f"{self.what}: message {index} of {self.sizes[index]} bytes arrived short (its last "
                "byte was never written); nothing from this update counts as received",
            )

    def _check_size(self, index: int, target: torch.Tensor) -> None:
        if target.numel() * target.element_size() != self.sizes[index]:
            raise ValueError(
                f"message {index} lands in {target.numel() * target.element_size()} bytes, "
                f"not the planned {self.sizes[index]}"
            )


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("a transfer-group message lands in a contiguous tensor")
    return t.reshape(-1).view(torch.uint8)
