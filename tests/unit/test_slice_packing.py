"""A transfer group's packed slices message: regions of several dtypes one after another, so a
float32 region may start at an offset that is not a multiple of 4 (after an FP8 region of an odd
byte count). Both sides' copies (``_packed``) must carry its bytes there and back."""

from __future__ import annotations

import torch
from weightwire.core.transports.transfer_group_slices import _packed
from weightwire.core.transports.transfer_plan import Transfer


def test_regions_off_their_alignment_travel_as_bytes() -> None:
    fp8 = torch.randn(3, 5).to(torch.float8_e4m3fn)[1:2]  # 5 bytes
    scale = torch.randn(4, 3)[:, 1:]  # float32, a strided region; at offset 5
    bf16 = torch.randn(3, dtype=torch.bfloat16)  # at offset 37
    regions = [fp8, scale, bf16]
    transfers = [
        Transfer(f"t{i}", tuple((0, n) for n in r.shape), 0, ("w",), r.numel() * r.element_size())
        for i, r in enumerate(regions)
    ]
    buf = torch.zeros(sum(t.nbytes for t in transfers), dtype=torch.uint8)
    received = [torch.zeros_like(r) for r in regions]
    offset = 0
    for t, sent, into in zip(transfers, regions, received, strict=True):
        to, frm = _packed(buf, offset, t, sent, sent.dtype)  # the sender's copy into the message
        to.copy_(frm)
        frm, to = _packed(buf, offset, t, into, into.dtype)  # the receiver's copy out of it
        to.copy_(frm)
        offset += t.nbytes
    for sent, got in zip(regions, received, strict=True):
        assert torch.equal(got.view(torch.uint8), sent.contiguous().view(torch.uint8))
