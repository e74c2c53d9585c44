"""The host staging an SGLang or vLLM worker's slices wait in until the commit (over gloo): a
buffer is reused from one update to the next only when nothing refers to it any more, so bytes an
engine's loader kept never change under it."""

from __future__ import annotations

import torch
from weightwire.server.transports.host_staging import HostStaging


def test_an_idle_buffer_is_taken_again_with_its_memory() -> None:
    staging = HostStaging()
    first = staging.take("w", (4, 8), torch.bfloat16)
    ptr = first.data_ptr()
    first.fill_(1)
    del first
    again = staging.take("w", (4, 8), torch.bfloat16)
    assert again.data_ptr() == ptr
    assert again.shape == (4, 8) and again.dtype == torch.bfloat16 and again.device.type == "cpu"
    assert staging.kept_bytes == 4 * 8 * 2


def test_a_buffer_still_held_is_left_to_its_holder() -> None:
    staging = HostStaging()
    held = staging.take("w", (16,), torch.float32)
    held.copy_(torch.arange(16, dtype=torch.float32))
    new = staging.take("w", (16,), torch.float32)
    assert new.data_ptr() != held.data_ptr()
    new.fill_(-1)
    assert torch.equal(held, torch.arange(16, dtype=torch.float32))
    # The new buffer took the old one's place: once dropped, it is the one taken again.
    ptr = new.data_ptr()
    del new
    assert staging.take("w", (16,), torch.float32).data_ptr() == ptr


def test_a_view_made_from_a_buffer_keeps_it_out_of_reuse() -> None:
    # An engine's loader may keep a narrow or reshaped view of what it was given.
    staging = HostStaging()
    given = staging.take("w", (8, 4), torch.float32)
    given.copy_(torch.ones(8, 4))
    kept_by_loader = given.narrow(0, 2, 3)
    ptr = given.data_ptr()
    del given
    nxt = staging.take("w", (8, 4), torch.float32)
    assert nxt.data_ptr() != ptr
    nxt.zero_()
    assert torch.equal(kept_by_loader, torch.ones(3, 4))


def test_another_shape_or_dtype_is_a_new_buffer() -> None:
    staging = HostStaging()
    a = staging.take("w", (8,), torch.float32)
    del a
    b = staging.take("w", (4, 2), torch.float32)
    assert b.shape == (4, 2)
    del b
    c = staging.take("w", (4, 2), torch.bfloat16)
    assert c.dtype == torch.bfloat16
    assert staging.kept_bytes == 4 * 2 * 2
    del c
    staging.take("v", (8,), torch.float32)
    assert staging.kept_bytes == 4 * 2 * 2 + 8 * 4  # one buffer per name
