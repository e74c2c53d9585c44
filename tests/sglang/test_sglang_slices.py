"""Every trainer rank a source, into a real SGLang engine (0.5.23 and 0.5.17, CPU, TP2, Qwen2 with
tied embeddings and q/k/v bias): 2 trainer ranks, each its own process of one gloo world, push their
DTensor shards of the checkpoint over a transfer group on loopback, and each engine worker receives
only its slices (fused q/k/v and gate/up, its vocabulary rows of the tied embedding).

One engine per release serves the module's tests, in order: a slices push before any push through
``load_weights`` is refused before a byte moves (the regions are not proven yet); a FULL push from
one rank, then two slices pushes, each followed by greedy tokens equal to transformers' on the pushed weights and
``bytes_received`` equal to the worker's manifest's kept bytes (less than the whole model), sent as
several buckets per worker (64 KiB each at most); a
trainer rank killed mid-push (after every worker began receiving and got the other rank's bytes)
leaves every worker CONSISTENT at its old version, serving its old tokens, and the restarted
trainer's next push forms a new group and lands. Slices into block-FP8 layers:
test_sglang_fp8.py.

This file is also the trainer rank (``python test_sglang_slices.py ADDR...``, started by
``helpers.TrainerRanks``): ``helpers.slice_trainer_main`` on this module's checkpoints.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from checkpoints import QWEN2, ModelSpec, full_checkpoint, reference_tokens, write_model_dir
from helpers import SLICE_RANK_DIED_EXIT_CODE as DIED_EXIT_CODE
from helpers import TrainerRanks, slice_trainer_main

SPEC = ModelSpec(QWEN2, tie=True)
# Each worker's part is several times this: it comes as several buckets, written into the engine
# together at the commit.
BUCKET_BYTES = 64 << 10
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
NEW_TOKENS = 8

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


def trainer_ranks(addresses: list[str]) -> TrainerRanks:
    """Two trainer ranks: this file as a script (``slice_trainer_main``)."""
    return TrainerRanks(__file__, addresses, drop_env=["WEIGHTWIRE_SGLANG_SOCKET_DIR"])


class Fleet:
    """The engine, its workers' addresses and manifests, the trainer ranks, what should be held."""

    def __init__(self, host: Any, addresses: list[str]) -> None:
        from weightwire.client import WeightPusher

        self.host = host
        self.addresses = addresses
        # A reader only (manifests and status); the trainer ranks push.
        self.reader = WeightPusher(addresses, timeout_s=60)
        self.ranks = trainer_ranks(addresses)
        self.version = 0
        self.weights = full_checkpoint(SPEC, seed=1)

    def push(self, version: int, seed: int, **cmd: Any) -> list[dict[str, Any]]:
        self.host.pause("abort")
        try:
            return self.ranks.push(version=version, seed=seed, **cmd)
        finally:
            self.host.resume()

    def landed(self, answers: list[dict[str, Any]], version: int, seed: int, *, slices: bool) -> None:
        assert all(a["ok"] for a in answers), answers
        results = answers[0]["results"]
        manifests = self.reader.refresh_manifests()
        assert set(results) == set(self.addresses)
        for address, r in results.items():
            assert (r["version"], r["state"], r["transport"]) == (version, "CONSISTENT", "transfer_group")
            m = manifests[address]
            if slices:
                assert m.receives_slices, address
                assert r["bytes_received"] == m.kept_bytes < m.total_bytes, (address, r)
                assert r["buckets"] >= m.kept_bytes // BUCKET_BYTES >= 2, (address, r)
        self.version, self.weights = version, full_checkpoint(SPEC, seed)

    def states(self) -> set[tuple[int, int]]:
        return {(st.weights_version, st.state) for st in self.reader.status().values()}

    def tokens_match(self) -> list[list[int]]:
        got = self.host.tokens(PROMPTS, NEW_TOKENS)
        assert got == reference_tokens(SPEC, self.weights, PROMPTS, NEW_TOKENS)
        return got

    def close(self) -> None:
        self.ranks.close()
        self.reader.close()


@pytest.fixture(scope="module", params=["0.5.23", "0.5.17"])
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from real_engine import SGLANG_ENVS, EngineHost, engine_kwargs
    from weightwire.adapters.sglang import discover

    env = SGLANG_ENVS[request.param]
    if not env.available():
        pytest.skip(f"no SGLang {request.param} environment: `make install-sglang-0517` makes it")
    root = tmp_path_factory.mktemp("sglang-slices")
    model = write_model_dir(SPEC, str(root / "model"), full_checkpoint(SPEC, seed=1))
    socket_dir = f"/tmp/ww-sgs-{uuid.uuid4().hex[:10]}"  # Unix socket paths are limited to 107 bytes
    host = EngineHost(
        env,
        engine_kwargs(model, tp=2, dtype=SPEC.dtype_name),
        socket_dir=socket_dir,
        log_path=str(root / "engine.log"),
    )
    f: Fleet | None = None
    try:
        f = Fleet(host, discover(socket_dir, count=2, timeout_s=60))
        yield f
    finally:
        if f is not None:
            f.close()
        host.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_slices_before_any_load_through_load_weights_are_refused_before_a_byte(fleet: Fleet) -> None:
    from weightwire.v1 import weight_transfer_pb2 as pb

    assert all(m.receives_slices for m in fleet.reader.manifests().values())
    answers = fleet.push(version=1, seed=2)
    assert [a["ok"] for a in answers] == [False, False], answers
    failures = answers[0]["failures"]
    assert "TRANSPORT_UNAVAILABLE" in {f["reason"] for f in failures.values()}, failures
    assert any("load_weights" in f["message"] for f in failures.values()), failures
    assert fleet.states() == {(0, pb.WORKER_STATE_CONSISTENT)}
    fleet.tokens_match()


def test_full_push_then_slices_from_both_ranks_generate_transformers_tokens(fleet: Fleet) -> None:
    answers = fleet.push(version=1, seed=2, single=True)
    fleet.landed(answers[:1], 1, 2, slices=False)
    before = fleet.tokens_match()
    for version, seed in ((2, 3), (3, 4)):
        fleet.landed(fleet.push(version=version, seed=seed), version, seed, slices=True)
        after = fleet.tokens_match()
        assert after != before, "consecutive checkpoints must give different tokens, or this shows nothing"
        before = after


def test_a_trainer_rank_killed_mid_push_leaves_every_worker_at_its_old_weights(fleet: Fleet) -> None:
    from helpers import wait_until
    from weightwire.v1 import weight_transfer_pb2 as pb

    old_version, old_tokens = fleet.version, fleet.host.tokens(PROMPTS, NEW_TOKENS)
    ranks = fleet.ranks
    fleet.host.pause("abort")
    try:
        ranks.send(0, json.dumps({"op": "push", "version": old_version + 1, "seed": 9}))
        ranks.send(1, json.dumps({"op": "push", "version": old_version + 1, "seed": 9, "pause": True}))
        assert ranks.read(1) == {"paused": True}
        ranks.send(1, "die")
        assert ranks.procs[1].wait(timeout=60) == DIED_EXIT_CODE
        answer = ranks.read(0)
        assert not answer["ok"], answer
        deadline = time.monotonic() + 60
        assert wait_until(
            lambda: {s for _, s in fleet.states()} == {pb.WORKER_STATE_CONSISTENT},
            timeout=deadline - time.monotonic(),
        ), fleet.reader.status()
    finally:
        fleet.host.resume()
    assert fleet.states() == {(old_version, pb.WORKER_STATE_CONSISTENT)}
    # Each worker's own record names the victim: its receive from the lost rank failed.
    for st in fleet.reader.status().values():
        assert (st.last_error.version, st.last_error.reason) == (old_version + 1, "TRANSFER_FAILED"), st
        assert "trainer rank 1" in st.last_error.message, st.last_error
    assert fleet.host.tokens(PROMPTS, NEW_TOKENS) == old_tokens
    fleet.tokens_match()
    # The trainer restarted (both ranks, as after a crash): its first push forms a new group and lands.
    ranks.close()
    fleet.ranks = trainer_ranks(fleet.addresses)
    fleet.landed(fleet.push(version=old_version + 1, seed=10), old_version + 1, 10, slices=True)
    assert fleet.tokens_match() != old_tokens


if __name__ == "__main__":
    sys.exit(slice_trainer_main(sys.argv[1:], lambda seed: full_checkpoint(SPEC, seed), BUCKET_BYTES))
