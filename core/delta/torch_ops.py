"""The element operations of encode and apply with torch kernels: any device, and the base of the host's.

``weightwire.core.delta.encoding`` picks these for a CUDA tensor and its numpy subclass
(``NumpyOps``) for a host one; both give the same results (the tests run both).
"""

from __future__ import annotations

import torch
from weightwire.core.delta.record import Delta, Encoding, choose_encoding, index_dtype_for

_BIT_WEIGHTS_CACHE: dict[torch.device, torch.Tensor] = {}


class TorchOps:
    """The element operations of encode and apply, with torch kernels (any device)."""

    def ne(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.ne(a, b)

    def count(self, mask: torch.Tensor) -> int:
        return int(torch.count_nonzero(mask))

    def flatnonzero(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(mask).view(-1)

    def pack(self, mask: torch.Tensor) -> torch.Tensor:
        n = mask.numel()
        padded = torch.zeros(((n + 7) // 8) * 8, dtype=torch.uint8, device=mask.device)
        padded[:n] = mask.view(torch.uint8)
        lanes = padded.view(-1, 8)
        out = lanes[:, 0].clone()
        for bit in range(1, 8):
            out |= lanes[:, bit] << bit
        return out

    def unpack(self, bitmap: torch.Tensor) -> torch.Tensor:
        shifts = _BIT_WEIGHTS_CACHE.get(bitmap.device)
        if shifts is None:
            shifts = _BIT_WEIGHTS_CACHE.setdefault(
                bitmap.device, torch.arange(8, dtype=torch.uint8, device=bitmap.device)
            )
        return ((bitmap.unsqueeze(1) >> shifts) & 1).view(-1).view(torch.bool)

    def take(self, flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return flat[indices]

    def compress(self, mask: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        return flat[mask]

    def put(self, flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
        flat.index_copy_(0, indices.to(torch.int64), values)

    def place(self, flat: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> None:
        flat[mask] = values

    def ascending(self, indices: torch.Tensor) -> bool:
        """Strictly ascending (no index twice)."""
        return indices.numel() < 2 or bool(torch.all(indices[1:] > indices[:-1]))

    def popcount(self, bitmap: torch.Tensor) -> int:
        return self.count(self.unpack(bitmap))

    def encode_flat(self, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> Delta:
        """``encode`` of two flat, contiguous raw-bit tensors: one mask of the whole tensor."""
        numel = b.numel()
        mask = self.ne(a, b)
        changed = self.count(mask)
        encoding = choose_encoding(numel, changed, b.element_size())
        if encoding is Encoding.DENSE:
            return Delta(encoding, numel, dtype, numel, values=b)
        if encoding is Encoding.BITMAP:
            return Delta(
                encoding, numel, dtype, changed, values=self.compress(mask, b), bitmap=self.pack(mask)
            )
        indices = self.flatnonzero(mask)
        values = self.take(b, indices)
        return Delta(
            encoding, numel, dtype, changed, values=values, indices=indices.to(index_dtype_for(numel))
        )

    def place_bitmap(self, flat: torch.Tensor, bitmap: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` at the set bits of ``bitmap`` into ``flat`` (checked before)."""
        self.place(flat, self.unpack(bitmap)[: flat.numel()], values)
