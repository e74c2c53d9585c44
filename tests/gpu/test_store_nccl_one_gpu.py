"""NCCL forms its communicator through weightwire's own bounded store (the Python ``Store`` that
``connect_store`` returns): the NCCL unique id is set and read through it. One GPU holds one NCCL
rank only, so this forms a world of one over the store (a world of two needs two GPUs:
tests/gpu/test_transfer_group_nccl.py); the collective's result is checked.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from gpu_procs import needs_gpus

pytestmark = [pytest.mark.gpu, needs_gpus(1)]


def test_nccl_forms_through_the_bounded_store_and_reduces() -> None:
    from weightwire.core.transports.transfer_group_store import StoreServer, connect_store

    server = StoreServer("127.0.0.1", 0)
    try:
        store = connect_store(server.address, 30.0)
        prefixed = dist.PrefixStore("ww-nccl-check", store)
        group = dist.ProcessGroupNCCL(prefixed, 0, 1, dist.ProcessGroupNCCL.Options())
        t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        group.allreduce([t]).wait(datetime.timedelta(seconds=60))
        torch.cuda.synchronize()
        assert torch.equal(t.cpu(), torch.arange(1 << 20, dtype=torch.float32))
        # the store served the communicator's keys: a peer of this world could read them
        assert store.num_keys() >= 1
        if hasattr(group, "shutdown"):
            group.shutdown()
    finally:
        server.close()
