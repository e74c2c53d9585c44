"""Names from the wire are matched as a whole: a final newline (which `$` lets through) is refused."""

from __future__ import annotations

import pytest
from weightwire.core.errors import WeightwireError
from weightwire.core.transports.cuda_ipc import check_ref_counter
from weightwire.core.transports.shm import check_shm_name


@pytest.mark.parametrize("name", ["ww-abc\n", "/ww-abc\n", "ww-abc\r\n", "ww-abc\n\n", "\nww-abc"])
def test_shm_name_with_a_newline_is_refused(name: str) -> None:
    with pytest.raises(WeightwireError) as err:
        check_shm_name(name)
    assert err.value.reason == "INVALID_SHM_NAME"


@pytest.mark.parametrize("name", ["ww-abc", "/ww-1234-0a1b2c-7"])
def test_shm_name_of_ours_is_accepted(name: str) -> None:
    assert check_shm_name(name) == name.removeprefix("/")


@pytest.mark.parametrize("handle", [b"/torch_1_2_3\n", b"/torch_1_2_3\r\n", b"\n/torch_1_2_3"])
def test_ref_counter_name_with_a_newline_is_refused(handle: bytes) -> None:
    with pytest.raises(WeightwireError) as err:
        check_ref_counter(handle, 0)
    assert err.value.reason == "INVALID_SHM_NAME"
