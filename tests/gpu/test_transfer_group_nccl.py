"""The transfer group's NCCL path on two GPUs of one host: this test process is the trainer (GPU 0,
tensors and staging on it), a ``weightwire serve --device cuda`` worker pinned to GPU 1 receives
over NCCL into its GPU staging buffers, twice over one group, bit-exact.

Needs two GPUs (marker gpu2; ``make test-gpu``). NCCL refuses two ranks on one GPU, so there is no
CPU stand-in for this; on CPU the refusal of the NCCL backend is tested in
tests/distributed/test_transfer_group.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_procs import needs_gpus

pytestmark = [pytest.mark.gpu2, needs_gpus(2)]


def test_push_over_nccl_into_a_worker_on_another_gpu(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import demo_args, load_dump, spawn_worker
    from weightwire.adapters.torch.demo import DemoConfig, expected_shard, full_checkpoint
    from weightwire.client import WeightPusher
    from weightwire.client.transports.transfer_group import TransferGroupOptions
    from weightwire.core.manifest import ParallelRank

    dumps = tmp_path / "dumps"
    worker = spawn_worker(
        *demo_args(dump_dir=dumps, extra=["--device", "cuda"]), env={"CUDA_VISIBLE_DEVICES": "1"}
    )
    try:
        torch.cuda.set_device(0)
        options = TransferGroupOptions(host="127.0.0.1", backend="nccl")
        with WeightPusher([worker.address], transfer_group=options, timeout_s=120) as pusher:
            groups = set()
            for version in (1, 2):
                full = full_checkpoint(DemoConfig(), version)
                results = pusher.push({n: t.to("cuda:0") for n, t in full.items()}, version=version)
                groups.add(pusher.transfer_group_id)
                (r,) = results.values()
                assert (r.state, r.transport) == ("CONSISTENT", "transfer_group")
                assert r.bytes_received == r.bytes_loaded
                got = load_dump(dumps, "tp0-pp0", version)
                want = expected_shard(full, ParallelRank(), DemoConfig())
                assert all(torch.equal(got[n], t) for n, t in want.items())
            assert len(groups) == 1
    finally:
        worker.stop()
