"""Delta updates into a real SGLang engine (0.5.23, CPU, TP2, Qwen2 with tied embeddings and q/k/v
bias): the adapter applies each delta in place into the regions its direct copy proved.

One engine serves the module's tests, in order: a delta to a tensor never loaded through
``load_weights`` (the engine holds version 1 from a PARTIAL push of another tensor) is refused by
every worker with DELTA_BASE_MISMATCH before anything is written, each worker CONSISTENT at its
version and serving its tokens; then a trainer in this process pushes over a transfer group
(gloo, loopback) a FULL update and three sparse deltas (``push(..., delta=True)``), each landing as
a delta with a small fraction of the FULL bytes received, and the engine's greedy tokens equal
transformers' on the pushed weights; then every trainer rank a source: 2 trainer ranks, each its own
process of one gloo world, push their FSDP-style ``Shard(0)`` DTensor shards with ``delta=True``
(a FULL, then two deltas): each worker holds the checked region deltas until the commit and applies
them into its proven regions (``server/worker/staged_deltas.py``), its ``bytes_received`` equal to
its deltas' encoded bytes, and the tokens equal transformers'.

This file is also the trainer rank (``python test_sglang_deltas.py ADDR...``, started by
``helpers.TrainerRanks``): ``helpers.slice_trainer_main`` on this module's checkpoints.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from checkpoints import QWEN2, ModelSpec, full_checkpoint, reference_tokens, write_model_dir
from helpers import TrainerRanks, delta_update_requests, push, slice_trainer_main, sparse_step

SPEC = ModelSpec(QWEN2, tie=True)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
NEW_TOKENS = 8
UNPROVEN = "model.layers.1.mlp.down_proj.weight"  # split along dim 1 over the two TP ranks

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


class Engine:
    """The running engine, its workers, and the weights it should hold now."""

    def __init__(self, host: Any, addresses: list[str]) -> None:
        self.host = host
        self.addresses = addresses
        self.weights = full_checkpoint(SPEC, seed=1)

    def tokens_match(self) -> list[list[int]]:
        got = self.host.tokens(PROMPTS, NEW_TOKENS)
        assert got == reference_tokens(SPEC, self.weights, PROMPTS, NEW_TOKENS)
        return got


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from real_engine import SGLANG_ENVS, EngineHost, engine_kwargs
    from weightwire.adapters.sglang import discover

    env = SGLANG_ENVS["0.5.23"]
    if not env.available():
        pytest.skip("no SGLang 0.5.23 environment")
    root = tmp_path_factory.mktemp("sglang-deltas")
    model = write_model_dir(SPEC, str(root / "model"), full_checkpoint(SPEC, seed=1))
    socket_dir = f"/tmp/ww-sgd-{uuid.uuid4().hex[:10]}"  # Unix socket paths are limited to 107 bytes
    host = EngineHost(
        env,
        engine_kwargs(model, tp=2, dtype=SPEC.dtype_name),
        socket_dir=socket_dir,
        log_path=str(root / "engine.log"),
    )
    try:
        yield Engine(host, discover(socket_dir, count=2, timeout_s=60))
    finally:
        host.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_a_delta_to_a_tensor_no_load_proved_is_refused_before_anything_is_written(engine: Engine) -> None:
    from weightwire.client import WeightPusher
    from weightwire.v1 import weight_transfer_pb2 as pb
    from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

    norm = {"model.norm.weight": full_checkpoint(SPEC, seed=2)["model.norm.weight"]}
    with WeightPusher(engine.addresses, timeout_s=60) as pusher:
        engine.host.pause("abort")
        try:
            pusher.push(norm, version=1, scope="partial")
        finally:
            engine.host.resume()
        engine.weights = {**engine.weights, **norm}
        manifests = pusher.manifests()
        before = engine.tokens_match()

        old = engine.weights[UNPROVEN]
        new = sparse_step({UNPROVEN: old}, seed=5)[UNPROVEN]
        requests = delta_update_requests(manifests.values(), UNPROVEN, old, new, 1)
        engine.host.pause("abort")
        try:
            for address in engine.addresses:
                with grpc.insecure_channel(address) as channel:
                    out = push(pb_grpc.WeightTransferServiceStub(channel), requests)
                assert (out.code, out.reason) == (
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "DELTA_BASE_MISMATCH",
                ), out
                assert out.metadata["tensor"] == UNPROVEN, out.metadata
                assert "load_weights" in out.message, out.message
        finally:
            engine.host.resume()
        states = {(s.weights_version, s.state) for s in pusher.status().values()}
        assert states == {(1, pb.WORKER_STATE_CONSISTENT)}
    assert engine.tokens_match() == before


def test_a_full_push_then_three_deltas_land_as_deltas_with_the_tokens_of_the_weights(engine: Engine) -> None:
    from weightwire.client import WeightPusher
    from weightwire.client.transports.transfer_group import TransferGroupOptions

    weights = full_checkpoint(SPEC, seed=3)
    with WeightPusher(
        engine.addresses, transfer_group=TransferGroupOptions(host="127.0.0.1"), timeout_s=120
    ) as pusher:

        def push_step(version: int, w: dict[str, torch.Tensor]) -> dict[str, Any]:
            engine.host.pause("abort")
            try:
                results = pusher.push(w, version=version, delta=True)
            finally:
                engine.host.resume()
            assert set(results) == set(engine.addresses)
            assert {(r.version, r.state) for r in results.values()} == {(version, "CONSISTENT")}
            engine.weights = w
            return results

        full = push_step(2, weights)
        assert {(r.encoding, r.delta_fallback) for r in full.values()} == {("FULL", "NO_BASE")}
        full_bytes = {a: r.bytes_received for a, r in full.items()}
        assert all(b > 0 for b in full_bytes.values()), full_bytes
        before = engine.tokens_match()
        for version in (3, 4, 5):
            weights = sparse_step(weights, seed=version)
            results = push_step(version, weights)
            for address, r in results.items():
                assert (r.encoding, r.delta_fallback, r.delta_refused) == ("DELTA", "NONE", 0), r
                assert 0 < r.bytes_received < full_bytes[address] / 10, (
                    r.bytes_received,
                    full_bytes[address],
                )
            after = engine.tokens_match()
            assert after != before, "consecutive weights must give different tokens, or this shows nothing"
            before = after


def test_deltas_from_every_trainer_rank_land_in_the_proven_regions(engine: Engine) -> None:
    from weightwire.client import WeightPusher

    ranks = TrainerRanks(__file__, engine.addresses, drop_env=["WEIGHTWIRE_SGLANG_SOCKET_DIR"])
    try:
        with WeightPusher(engine.addresses, timeout_s=60) as reader:
            manifests = reader.manifests()
            version = max(s.weights_version for s in reader.status().values())
        seed, steps = 10, []

        def ranks_push() -> dict[str, dict[str, Any]]:
            nonlocal version
            version += 1
            engine.host.pause("abort")
            try:
                answers = ranks.push(version=version, seed=seed, sparse=steps, delta=True)
            finally:
                engine.host.resume()
            assert all(a["ok"] for a in answers), answers
            results: dict[str, dict[str, Any]] = answers[0]["results"]
            assert {(r["version"], r["state"]) for r in results.values()} == {(version, "CONSISTENT")}
            weights = full_checkpoint(SPEC, seed)
            for step in steps:
                weights = sparse_step(weights, step)
            engine.weights = weights
            return results

        full = ranks_push()
        for address, r in full.items():
            assert (r["encoding"], r["delta_fallback"]) == ("FULL", "NO_BASE"), r
            assert r["bytes_received"] == manifests[address].kept_bytes, (address, r)
        before = engine.tokens_match()
        for step in (11, 12):
            steps.append(step)
            for address, r in ranks_push().items():
                assert (r["encoding"], r["delta_fallback"], r["delta_refused"]) == ("DELTA", "NONE", 0), r
                assert 0 < r["bytes_received"] == r["encoded_bytes"] < full[address]["bytes_received"] / 10, r
            after = engine.tokens_match()
            assert after != before, "consecutive weights must give different tokens, or this shows nothing"
            before = after
    finally:
        ranks.close()


if __name__ == "__main__":
    sys.exit(slice_trainer_main(sys.argv[1:], lambda seed: full_checkpoint(SPEC, seed)))
