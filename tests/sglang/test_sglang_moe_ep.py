"""Expert parallelism in a real, running ``sglang.Engine`` on CPU (SGLang 0.5.23, TP=2, EP=2).

The tiny Qwen3-MoE of test_sglang_moe.py (4 experts), with ``ep_size=2``: each rank holds two
whole experts (``moe_ep_rank`` 0 holds experts 0-1, rank 1 experts 2-3) and no MoE-TP slice. Each
rank's manifest must list only its own experts, whole, and every other tensor as without EP; a
FULL push then sends each rank the tensors it owns, of the experts only its own, and commits.

SGLang 0.5.23 cannot run an EP forward pass on CPU (its standard MoE dispatcher asks for an
accelerator: ``get_device()`` raises "No accelerator ... is available" and the scheduler exits), so
this module checks the manifests and the routing against the real engine's EP layout, and no tokens.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest
from moe_checkpoints import QWEN3_MOE, MoESpec, checkpoint_shapes, full_checkpoint, write_model_dir
from real_engine import SGLANG_ENVS, EngineHost, engine_kwargs
from test_sglang_moe import Running
from weightwire.adapters.sglang import discover
from weightwire.client import WeightPusher

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

SPEC = MoESpec(arch=QWEN3_MOE)
TP = EP = 2


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    env = SGLANG_ENVS["0.5.23"]
    if not env.available():
        pytest.skip("no SGLang 0.5.23 environment: `make install-sglang` makes it")
    root = tmp_path_factory.mktemp("sglang-moe-ep")
    weights = full_checkpoint(SPEC, seed=1)
    model = write_model_dir(SPEC, str(root / "model"), weights)
    socket_dir = f"/tmp/ww-sgl-{uuid.uuid4().hex[:10]}"
    host = EngineHost(
        env,
        engine_kwargs(model, tp=TP, ep_size=EP),
        socket_dir=socket_dir,
        log_path=str(root / "engine.log"),
    )
    try:
        endpoints = discover(socket_dir, count=TP, timeout_s=60)
        with WeightPusher(endpoints, transport="host_shm", timeout_s=120) as pusher:
            yield Running(host, pusher, weights)
    finally:
        host.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_each_ep_rank_lists_only_its_experts_whole(running: Running) -> None:
    manifests = sorted(running.pusher.manifests().values(), key=lambda m: m.rank.tp_rank)
    shapes = checkpoint_shapes(SPEC)
    per_rank = SPEC.num_experts // EP
    for m in manifests:
        mine = range(m.rank.tp_rank * per_rank, (m.rank.tp_rank + 1) * per_rank)
        experts = {n for n in m.tensors if ".experts." in n}
        assert experts == {
            f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
            for layer in range(SPEC.num_layers)
            for e in mine
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
        assert all(m.tensors[n].pieces == () for n in experts)  # whole experts: no MoE-TP slice
        assert {n for n in m.tensors if ".experts." not in n} == {n for n in shapes if ".experts." not in n}


def test_a_full_push_sends_each_ep_rank_only_its_experts(running: Running) -> None:
    manifests = running.pusher.manifests()
    results = running.pusher.push(full_checkpoint(SPEC, seed=2), version=1)
    assert {(r.version, r.state) for r in results.values()} == {(1, "CONSISTENT")}
    total = sum(t.numel() * t.element_size() for t in full_checkpoint(SPEC, seed=2).values())
    experts_elsewhere = {
        a: sum(t.nbytes for n, t in m.tensors.items() if ".experts." in n) for a, m in manifests.items()
    }
    for address, r in results.items():
        # One source sends whole checkpoint tensors: every tensor this rank owns, and of the
        # experts only its own (the other rank's experts never reach it).
        assert r.bytes_loaded == manifests[address].total_bytes
        other = next(a for a in manifests if a != address)
        assert r.bytes_loaded == total - experts_elsewhere[other]
