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
        with WeightPusher(
            addresses, transfer_group=TransferGroupOptions(host="127.0.0.1"), timeout_s=120
        ) as pusher:
            manifests: dict[str, ShardManifest] = pusher.manifests()
            groups = set()
            for version in (1, 2):
                full = full_checkpoint(spec, seed=version)
                results = pusher.push(full, version=version)
                groups.add(pusher.transfer_group_id)
                for address, r in results.items():
                    assert (r.state, r.transport) == ("CONSISTENT", "transfer_group")
                    assert r.bytes_received == manifests[address].total_bytes
                by_worker = {m.worker_id: m for m in manifests.values()}
                for rank in engine.ranks:
                    held = engine.dump(rank, version)
                    expected = expected_params(spec, full, rank.tp_rank, 2, rank.pp_rank, 2)
                    assert set(held) == set(expected)
                    for name, want in expected.items():
                        assert torch.equal(held[name], want), (
                            f"{rank.worker_id}: {name} differs from version {version}"
                        )
                    if version == 1:
                        check_geometry_against_loaded(by_worker[rank.worker_id], full, held)
            assert len(groups) == 1 and None not in groups
            statuses = pusher.status()
            assert {s.transfer_group.state for s in statuses.values()} == {pb.TRANSFER_GROUP_STATE_READY}
    finally:
        engine.stop()


# SGLang parameter -> the checkpoint modules fused into it, in the loaders' order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def check_geometry_against_loaded(
    manifest: ShardManifest, full: dict[str, torch.Tensor], held: dict[str, torch.Tensor]
) -> None:
    """The manifest's slice geometry is what SGLang's weight loaders kept: for every parameter the
    rank holds, the pieces its manifest states, cut from the checkpoint and concatenated in fused
    order, equal the parameter (bit for bit; rows of vocabulary padding past them excepted)."""
    sliced = [t for t in manifest.tensors.values() if t.pieces]
    assert sliced, f"{manifest.worker_id}: a TP2 rank states no slices"
    for param_name, value in held.items():
        module, _, leaf = param_name.rpartition(".")
        parent, _, attr = module.rpartition(".")
        names = [f"{parent}.{m}.{leaf}" for m in FUSED[attr]] if attr in FUSED else [param_name]
        if names == ["lm_head.weight"] and names[0] not in manifest.tensors:
            names = ["model.embed_tokens.weight"]  # a tied lm_head is filled from the embedding
        parts = []
        for name in names:
            owned = manifest.tensors[name]
            cut = full[name]
            if owned.pieces:
                cut = torch.cat(
                    [cut.narrow(p.dim, p.offset, p.length) for p in owned.pieces], dim=owned.pieces[0].dim
                )
            parts.append(cut)
        dim = next((manifest.tensors[n].pieces[0].dim for n in names if manifest.tensors[n].pieces), 0)
        kept = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
        assert torch.equal(value.narrow(0, 0, kept.shape[0]), kept), f"{manifest.worker_id}: {param_name}"
