"""Fresh tensors on a GPU: a trainer whose every parameter is in a new storage before each push (a
gather, a conversion, a ``state_dict()`` copy) packs them into the CUDA IPC exporter's pool, which
each worker opens once; ``WeightPusher.tensor_buffers`` lets the producer write into buffers that
are then sent where they live.

``weightwire serve --model demo --device cuda`` workers (their own processes); this test process is
the trainer (CUDA IPC needs only that the worker is another process). Contents are checked through
the workers' safetensors dumps of every version.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_procs import WorkerSpec, expect_dump, needs_gpus, workers

DEVICE = torch.device("cuda", 0)


def checkpoint(version: int) -> dict[str, torch.Tensor]:
    """Version ``version`` in new GPU storages (what a gather or a conversion hands over)."""
    from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint

    return {name: t.to(DEVICE) for name, t in full_checkpoint(DemoConfig(), version).items()}


def exporter_of(pusher):  # type: ignore[no-untyped-def]
    # Test-only look into the pusher: its CUDA IPC exporter.
    from weightwire.client.transports.cuda_ipc import CudaIpcExporter

    return next(e for e in pusher._staging._exporters.values() if isinstance(e, CudaIpcExporter))


@pytest.mark.gpu
@needs_gpus(1)
def test_fresh_storages_go_through_the_pool_and_buffers_where_they_live(tmp_path: Path) -> None:
    from weightwire.client import WeightPusher

    dumps = tmp_path / "dumps"
    specs = [WorkerSpec("0", "tp0-pp0"), WorkerSpec("0", "tp1-pp0", tp_rank=1, tp_size=2)]
    with workers(specs, tmp_path, dump_dir=dumps) as ws, WeightPusher([w.address for w in ws]) as pusher:
        opened: dict[int, list[int]] = {}
        for version in (1, 2, 3, 4):
            tensors = checkpoint(version)
            results = pusher.push(tensors, version=version)
            # The trainer may overwrite its tensors once push returned.
            for t in tensors.values():
                t.zero_()
            opened[version] = [results[w.address].handles_opened for w in ws]
            for w in ws:
                r = results[w.address]
                assert r.version == version and r.transport == "cuda_ipc", r
                expect_dump(dumps, w.spec, version)
        exporter = exporter_of(pusher)
        n = len(checkpoint(1))
        # The first push shares every storage (nothing says yet that the trainer makes new ones);
        # from the second on, each is packed into the pool, which each worker opened once.
        assert exporter.tensors_packed == 3 * n, exporter.tensors_packed
        assert opened[2] == [1, 1] and opened[3] == [0, 0] and opened[4] == [0, 0], opened
        pool_bytes = sum(c.nbytes for _, e in exporter._pooled.values() for c in e.region.chunks)
        model_bytes = sum(t.nbytes for t in checkpoint(1).values())
        assert pool_bytes <= model_bytes + 256 * n + 2 * 1024 * 1024

        # The producer writes into the library's buffers: one storage, packed at its first push (one
        # new storage of a small model copies faster than it opens), then a kept one sent where it
        # lives, with nothing packed and nothing opened from then on.
        bufs = pusher.tensor_buffers(checkpoint(1))
        for version in (5, 6, 7):
            for name, t in checkpoint(version).items():
                bufs[name].copy_(t)
            results = pusher.push(bufs, version=version)
            opened[version] = [results[w.address].handles_opened for w in ws]
            for w in ws:
                assert results[w.address].version == version
                expect_dump(dumps, w.spec, version)
        assert exporter.tensors_packed == 4 * n
        assert opened[6] == [1, 1] and opened[7] == [0, 0], opened
        assert exporter._pooled == {}  # nothing packed any more: the pool was let go

        # Fresh tensors again: packed from the first such push on (this group was pushed to before).
        for version in (8, 9):
            pusher.push(checkpoint(version), version=version)
            for w in ws:
                expect_dump(dumps, w.spec, version)
        assert exporter.tensors_packed == 6 * n
