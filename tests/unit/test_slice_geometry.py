"""Slice geometry in manifests: what each worker states it keeps of every checkpoint tensor is what
its loader really keeps (the torch adapter here; SGLang's real loaders in
tests/sglang/test_sglang_group.py), the pieces of a stage's TP ranks tile every tensor, and the
pieces travel through the contract and the fingerprint."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model, checkpoint_shapes
from weightwire.core import layer_geometry
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest, TensorPiece
from weightwire.v1 import weight_transfer_pb2 as pb

CONFIG = DemoConfig()
HOST = DeviceRef.host("b0070000-0000-0000-0000-000000000000")


def adapter_for(rank: ParallelRank) -> TorchAdapter:
    model = build_demo_model(CONFIG, rank, "cpu", 0)
    return TorchAdapter(
        model,
        rank=rank,
        device=torch.device("cpu"),
        own_device=HOST,
        tp_rules=DEMO_TP_RULES,
        num_layers=CONFIG.num_layers,
    )


def index_checkpoint() -> dict[str, torch.Tensor]:
    """Every element a distinct value (its position across the checkpoint), so a slice taken from
    the wrong place can never equal the right one."""
    out, start = {}, 0
    for name, shape in checkpoint_shapes(CONFIG).items():
        n = 1
        for d in shape:
            n *= d
        out[name] = torch.arange(start, start + n, dtype=torch.float32).reshape(shape)
        start += n
    assert start < 1 << 24  # float32 holds every such integer exactly
    return out


def cut(full: torch.Tensor, owned: OwnedTensor) -> torch.Tensor:
    if not owned.pieces:
        return full
    return torch.cat([full.narrow(p.dim, p.offset, p.length) for p in owned.pieces], dim=owned.pieces[0].dim)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_torch_adapter_states_the_slice_its_load_keeps(tp_size: int) -> None:
    full = index_checkpoint()
    for pp_rank in (0, 1):
        stage = [
            adapter_for(ParallelRank(tp_rank=r, tp_size=tp_size, pp_rank=pp_rank, pp_size=2))
            for r in range(tp_size)
        ]
        for adapter in stage:
            owned = adapter.manifest().tensors
            adapter.load([(k, v) for k, v in full.items() if k in owned])
            for name, t in owned.items():
                assert torch.equal(adapter.state()[name], cut(full[name], t)), name
                assert t.kept_bytes == adapter.state()[name].numel() * 4
        # The stage's ranks together keep every element of each tensor exactly once (or all of
        # it each, for a replicated one).
        for name, t in stage[0].manifest().tensors.items():
            counts = torch.zeros(t.shape, dtype=torch.int32)
            for adapter in stage:
                mine = adapter.manifest().tensors[name]
                if not mine.pieces:
                    counts += 1
                for p in mine.pieces:
                    counts.narrow(p.dim, p.offset, p.length).add_(1)
            assert set(counts.unique().tolist()) == ({tp_size} if t.whole else {1}), name
            if tp_size > 1 and name.endswith(("q_proj.weight", "o_proj.weight", "down_proj.weight")):
                assert not t.whole, name


def test_pieces_survive_the_contract_and_change_the_fingerprint() -> None:
    manifest = adapter_for(ParallelRank(tp_rank=1, tp_size=2)).manifest()
    back = ShardManifest.from_proto(pb.ShardManifest.FromString(manifest.to_proto().SerializeToString()))
    assert back.tensors == manifest.tensors
    assert back.fingerprint == manifest.fingerprint
    assert back.kept_bytes == manifest.total_bytes // 2 + sum(
        t.nbytes // 2 for t in manifest.tensors.values() if t.whole
    )
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    assert manifest.tensors[o_proj].pieces == (TensorPiece(1, 32, 32),)
    moved = dict(manifest.tensors)
    moved[o_proj] = OwnedTensor(
        o_proj, pb.DTYPE_FLOAT32, manifest.tensors[o_proj].shape, (TensorPiece(1, 0, 32),)
    )
    other = ShardManifest.build(
        manifest.device,
        manifest.rank,
        moved.values(),
        instance_id=manifest.instance_id,
        num_layers=manifest.num_layers,
        layer_start=manifest.layer_start,
        layer_end=manifest.layer_end,
    )
    assert other.fingerprint != manifest.fingerprint


def test_a_manifest_without_pieces_keeps_its_fingerprint() -> None:
    """Workers of earlier versions publish no pieces; their fingerprints must not move."""
    t = OwnedTensor("w", pb.DTYPE_FLOAT32, (4, 4))
    m = ShardManifest.build(HOST, ParallelRank(), [t], instance_id="i")
    h = hashlib.sha256()
    h.update(f"{HOST.kind}:{HOST.uuid}|{ParallelRank()}|0:0:0|i".encode())
    h.update(f"\nw|{pb.DTYPE_FLOAT32}|4,4".encode())
    assert m.fingerprint == h.hexdigest()[:32]


@pytest.mark.parametrize(
    ("pieces", "why"),
    [
        ((TensorPiece(2, 0, 1),), "dimension 2"),
        ((TensorPiece(0, 3, 2),), "outside size 4"),
        ((TensorPiece(0, 0, 0),), "outside"),
        ((TensorPiece(0, 0, 2), TensorPiece(0, 1, 2)), "overlap"),
        ((TensorPiece(0, 0, 1), TensorPiece(1, 1, 1)), "one dimension"),
        (tuple(TensorPiece(0, i, 1) for i in range(65)), "at most 64"),
    ],
)
def test_malformed_pieces_are_refused(pieces: tuple[TensorPiece, ...], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        OwnedTensor("w", pb.DTYPE_FLOAT32, (4, 4) if len(pieces) < 65 else (65, 4), pieces)


def test_qkv_with_fewer_kv_heads_than_ranks_replicates_kv() -> None:
    """TP4 over 2 k/v heads: ranks 0-1 keep k/v head 0, ranks 2-3 head 1 (the loaders'
    ``tp_rank // num_kv_head_replicas``); q is split four ways. The layer here carries the
    attribute names SGLang's and vLLM's QKVParallelLinear record (plain values: arithmetic only)."""
    head = 8

    def layer() -> SimpleNamespace:
        return SimpleNamespace(
            head_size=head,
            v_head_size=head,
            total_num_heads=8,
            total_num_kv_heads=2,
            num_heads=2,
            num_kv_heads=1,
            num_kv_head_replicas=2,
            input_size=64,
        )

    got = [layer_geometry.qkv(layer(), "weight", r, r) for r in range(4)]
    assert [g.local for g in got] == [(32, 64)] * 4
    assert [g.feeds[0].pieces for g in got] == [(TensorPiece(0, 16 * r, 16),) for r in range(4)]
    assert [g.feeds[1].pieces for g in got] == [(TensorPiece(0, 0, 8),)] * 2 + [(TensorPiece(0, 8, 8),)] * 2
    assert [g.feeds[2].shape for g in got] == [(16, 64)] * 4
    assert [f.shard_id for f in got[0].feeds] == ["q", "k", "v"]
