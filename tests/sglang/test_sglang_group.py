"""SGLang's real Qwen2 classes, under SGLang's real parallel state (its own gloo default group in
every rank process), receiving weights over a weightwire transfer group (gloo on loopback).

A TP2 x PP2 engine of rank processes (``rank_worker.py``, the plugin's own ``start_worker``; a fake
scheduler loop drives the update steps, see cpu_engine.py) is pushed to by this process with
``WeightPusher(transfer_group=...)``: the SGLang adapter needs no code for the transport, each
rank's parameters (fused qkv/gate_up, TP slices) are bit-exact after every update, each worker
receives exactly its manifest's bytes, and the group formed at the first push is reused by the
second, next to SGLang's own default process group in the same processes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from checkpoints import QWEN2, ModelSpec, full_checkpoint
from cpu_engine import CpuEngine, expected_params
from weightwire.adapters.sglang import discover
from weightwire.client import WeightPusher
from weightwire.client.transports.transfer_group import TransferGroupOptions
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="sglang is not installed in this environment: `make install-sglang` adds its CPU test stack",
    ),
]


def test_sglang_ranks_receive_over_a_transfer_group(tmp_path: Path) -> None:
    spec = ModelSpec(QWEN2)
    engine = CpuEngine(spec, tp=2, pp=2, socket_dir=str(tmp_path / "sock"), dump_dir=str(tmp_path / "dump"))
    try:
        addresses = discover(engine.socket_dir, count=4, timeout_s=120)
        with WeightPusher(addresses, transfer_group=TransferGroupOptions(host="127.0.0.1"), timeout_s=120) as pusher:
            manifests: dict[str, ShardManifest] = pusher.manifests()
            groups = set()
            for version in (1, 2):
                full = full_checkpoint(spec, seed=version)
                results = pusher.push(full, version=version)
                groups.add(pusher.transfer_group_id)
                for address, r in results.items():
                    assert (r.state, r.transport) == ("CONSISTENT", "transfer_group")
                    assert r.bytes_received == manifests[address].total_bytes
                for rank in engine.ranks:
                    held = engine.dump(rank, version)
                    expected = expected_params(spec, full, rank.tp_rank, 2, rank.pp_rank, 2)
                    assert set(held) == set(expected)
                    for name, want in expected.items():
                        assert torch.equal(held[name], want), f"{rank.worker_id}: {name} differs from version {version}"
            assert len(groups) == 1 and None not in groups
            statuses = pusher.status()
            assert {s.transfer_group.state for s in statuses.values()} == {pb.TRANSFER_GROUP_STATE_READY}
    finally:
        engine.stop()
