"""The host shared-memory importer reads exactly the owned bytes of a real segment, also in the two
halves a large batch is split into, and a segment shorter than the bytes a batch needs is refused."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator

import pytest
import torch
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.transports.shm import SHM_DIR, new_shm_name
from weightwire.server.rules.views import ViewItem, copy_plan, views_over
from weightwire.server.transports.importer import ImportContext
from weightwire.server.transports.shm import COPY_CHUNK_BYTES, HostShmImporter
from weightwire.v1 import weight_transfer_pb2 as pb

SIZE = 40 * 1024 * 1024  # several batches of the split (two-thread) read


@pytest.fixture
def segment() -> Iterator[tuple[str, torch.Tensor]]:
    name = new_shm_name("unit")
    data = torch.randint(0, 256, (SIZE,), dtype=torch.uint8)
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    try:
        yield name, data
    finally:
        os.unlink(path)


def _open(name: str, size: int):  # type: ignore[no-untyped-def]
    payload = pb.Payload(
        device=DeviceRef.host().to_proto(), size_bytes=size, host_shm=pb.HostShmHandle(name=name)
    )
    host = DeviceRef.host()
    mapping, opened = HostShmImporter().open(
        payload, ImportContext(own_device=host, source=host, peer=False, target=torch.device("cpu"))
    )
    assert opened and mapping.size_bytes == size
    return mapping


@pytest.mark.parametrize("chunk", [COPY_CHUNK_BYTES, 9 * 1024 * 1024, 1024 * 1024])
def test_owned_ranges_come_back_byte_for_byte(segment: tuple[str, torch.Tensor], chunk: int) -> None:
    name, data = segment
    items = [
        ViewItem.of(0, torch.float32, (3 * 1024 * 1024,)),  # 12 MiB: a split read of its own
        ViewItem.of(13 * 1024 * 1024 + 6, torch.bfloat16, (1000, 7)),  # misaligned
        ViewItem.of(20 * 1024 * 1024, torch.int64, (2 * 1024 * 1024,)),  # 16 MiB
        ViewItem.of(SIZE - 4096, torch.uint8, (4096,)),  # the very end
    ]
    names = [f"t{i}" for i in range(len(items))]
    mapping = _open(name, SIZE)
    try:
        seen = {}
        for batch in copy_plan(names, items, chunk):
            for n, view in zip(
                batch.names, views_over(mapping.fetch(batch), batch.positions, batch.items), strict=True
            ):
                seen[n] = view.contiguous().view(-1).view(torch.uint8).clone()
        for n, item in zip(names, items, strict=True):
            assert torch.equal(seen[n], data[item.offset_bytes : item.offset_bytes + item.nbytes]), n
        assert mapping.crc32(SIZE) == zlib.crc32(data.numpy().tobytes())
    finally:
        mapping.close()


def test_a_segment_shorter_than_a_batch_needs_is_invalid_size(segment: tuple[str, torch.Tensor]) -> None:
    name, _ = segment
    mapping = _open(name, SIZE)
    try:
        os.truncate(os.path.join(SHM_DIR, name), 30 * 1024 * 1024)  # the sender shrinks it
        (batch,) = copy_plan(["big"], [ViewItem.of(0, torch.uint8, (SIZE,))], COPY_CHUNK_BYTES)
        with pytest.raises(WeightwireError) as err:
            mapping.fetch(batch)
        assert err.value.reason == "INVALID_SIZE" and "shrank" in err.value.message
    finally:
        mapping.close()
