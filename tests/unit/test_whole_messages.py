"""A transfer-group message is counted only when every byte of it arrived.

gloo completes the receive of a shorter message as if it were whole, leaving the rest of the buffer
as it was. A short arrival is reproduced here the same way: only a prefix of what was sent is
copied into the posted buffer.
"""

from __future__ import annotations

import pytest
import torch
from weightwire.core.errors import WeightwireError
from weightwire.core.transports.whole_messages import Arrivals, announce, announcement_nbytes, last_byte


def _arrive(sent: torch.Tensor, into: torch.Tensor, nbytes: int | None = None) -> None:
    """What a gloo receive does: the bytes that came, at the start of the buffer, nothing else."""
    src, dst = sent.reshape(-1).view(torch.uint8), into.reshape(-1).view(torch.uint8)
    n = src.numel() if nbytes is None else nbytes
    dst[:n].copy_(src[:n])


def _messages() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(5, 7, generator=g).to(torch.bfloat16),
        torch.randint(0, 255, (1,), generator=g, dtype=torch.uint8),
        torch.randn(3, generator=g),
    ]


def _receive(sent: list[torch.Tensor], landing: list[torch.Tensor], short: int | None = None) -> Arrivals:
    sizes = [m.numel() * m.element_size() for m in sent]
    arrivals = Arrivals(sizes, torch.device("cpu"), "trainer rank 1")
    _arrive(
        announce([(s, last_byte(m)) for s, m in zip(sizes, sent, strict=True)], torch.device("cpu")),
        arrivals.buffer,
    )
    arrivals.open()
    for i, (m, t) in enumerate(zip(sent, landing, strict=True)):
        arrivals.prime(i, t)
        _arrive(m, t, sizes[i] - 1 if i == short else None)
    return arrivals


def test_whole_messages_pass_and_land_exactly() -> None:
    sent = _messages()
    # The landing zones hold what an earlier update left there: here, the same bytes.
    landing = [m.clone() for m in sent]
    arrivals = _receive(sent, landing)
    for i, t in enumerate(landing):
        arrivals.check(i, t)
    assert all(torch.equal(a, b) for a, b in zip(sent, landing, strict=True))


@pytest.mark.parametrize("short", [0, 1, 2])
def test_a_message_one_byte_short_is_refused_even_over_identical_old_bytes(short: int) -> None:
    sent = _messages()
    landing = [m.clone() for m in sent]  # the missing byte would read "right" without priming
    arrivals = _receive(sent, landing, short=short)
    for i in range(short):
        arrivals.check(i, landing[i])
    with pytest.raises(WeightwireError) as err:
        arrivals.check(short, landing[short])
    assert err.value.reason_name == "MESSAGE_TRUNCATED"
    assert "trainer rank 1" in err.value.message and f"message {short}" in err.value.message


def test_a_short_announcement_is_refused() -> None:
    sent = _messages()
    sizes = [m.numel() * m.element_size() for m in sent]
    arrivals = Arrivals(sizes, torch.device("cpu"), "trainer rank 0")
    note = announce([(s, last_byte(m)) for s, m in zip(sizes, sent, strict=True)], torch.device("cpu"))
    assert note.numel() == announcement_nbytes(len(sent))
    _arrive(note, arrivals.buffer, note.numel() - 1)
    with pytest.raises(WeightwireError) as err:
        arrivals.open()
    assert err.value.reason_name == "MESSAGE_TRUNCATED"


def test_an_announcement_of_other_sizes_is_a_plan_mismatch() -> None:
    sent = _messages()
    arrivals = Arrivals([70, 1, 13], torch.device("cpu"), "trainer rank 0")
    _arrive(
        announce(
            [(70, last_byte(sent[0])), (1, last_byte(sent[1])), (12, last_byte(sent[2]))], torch.device("cpu")
        ),
        arrivals.buffer,
    )
    with pytest.raises(WeightwireError) as err:
        arrivals.open()
    assert err.value.reason_name == "GROUP_PLAN_MISMATCH"
    assert "message 2" in err.value.message


def test_last_byte_of_a_strided_region_is_what_its_message_ends_with() -> None:
    t = torch.arange(48, dtype=torch.int16).reshape(6, 8)
    region = t[1:4, 2:5]  # not contiguous: a message made of it is its copy
    assert not region.is_contiguous()
    assert torch.equal(last_byte(region), region.contiguous().view(torch.uint8).reshape(-1)[-1:])
    assert last_byte(region).data_ptr() != region.contiguous().data_ptr()  # a view, not a copy
