"""Every trainer rank a source over gloo into torch-adapter workers whose weights are on the GPU:
gloo moves host memory, so each worker receives its slices into host copies of its kept tensors
(kept from one update to the next) that land in its CUDA tensors at the commit. 2 CPU trainer
ranks (``slice_trainer.py``) into a TP2 x PP2 engine on one GPU, several pushes in a row: every
worker holds its shard of each pushed checkpoint bit for bit and received exactly its kept bytes."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from gpu_procs import needs_gpus

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "distributed"))

from group_fleet import CONFIG, Fleet
from slice_ranks import Ranks
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = [pytest.mark.gpu, needs_gpus(1), pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("slices-cuda")
    (root / "sock").mkdir()
    f = Fleet(str(root / "sock"), str(root / "dump"), replicas=1, extra=["--device", "cuda"])
    yield f
    f.stop()


def test_slices_over_gloo_land_in_cuda_weights_push_after_push(fleet: Fleet) -> None:
    ranks = Ranks(2, fleet.addresses())
    try:
        for step in range(3):
            version = fleet.next_version()
            answers = ranks.push(version=version, seed=version + 7 * step)
            assert all(a["ok"] for a in answers), answers
            results = answers[0]["results"]
            full = full_checkpoint(CONFIG, version + 7 * step)
            for m in fleet.members:
                r = results[m.address]
                assert (r["version"], r["state"], r["transport"]) == (version, "CONSISTENT", "transfer_group")
                manifest = m.stub().GetManifest(pb.GetManifestRequest()).manifest
                assert r["bytes_received"] == ShardManifest.from_proto(manifest).kept_bytes, m.worker_id
                fleet.assert_holds(m, version, full)
    finally:
        ranks.close()
