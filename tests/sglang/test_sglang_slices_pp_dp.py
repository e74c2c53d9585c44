"""Every trainer rank a source, into real SGLang engines (0.5.23, CPU, Llama) over pipeline stages and
data-parallel replicas, over TCP as across machines: 2 trainer ranks, each its own process of one
gloo world, push their DTensor shards of the checkpoint over a transfer group on loopback, the
workers listen on TCP ports (``WEIGHTWIRE_SGLANG_BASE_PORT``), and each worker receives only its
slices (its pipeline stage's layers, its rows of fused q/k/v and gate/up, its columns of the
row-parallel weights).

Two fleets, one at a time (one fixture parameter each): one engine of TP=2 x PP=2 (four workers),
and two engines of TP=2 as two DP replicas of one trainer (four workers; a separate engine per
replica is how a trainer reaches replicas on different machines). In each: one FULL push from one
rank (it proves the direct-copy regions, which a slices bucket needs), then two slices pushes, each
followed by every engine's greedy tokens equal to transformers' on the pushed weights and every
worker's ``bytes_received`` equal to its manifest's kept bytes (less than the whole model). With
the two replicas, an engine worker of one of them is killed (SIGKILL) mid-push: the push fails on
both trainer ranks naming it, the other replica stays CONSISTENT at its old version serving its old
tokens, and once the lost replica's engine is started again the next pushes land on every worker.

This file is also the trainer rank (``python test_sglang_slices_pp_dp.py ADDR...``, started by
``helpers.TrainerRanks``): ``helpers.slice_trainer_main`` on this module's checkpoints.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from checkpoints import LLAMA, ModelSpec, full_checkpoint, reference_tokens, write_model_dir
from helpers import TrainerRanks, slice_trainer_main, wait_until
from ports import free_ports

SPEC = ModelSpec(LLAMA)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
NEW_TOKENS = 8
RELEASE = "0.5.23"

# name: (tp, pp, engines)
TOPOLOGIES = {"tp2-pp2": (2, 2, 1), "tp2-dp2": (2, 1, 2)}

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


class Fleet:
    """The engines (one per replica), their workers' TCP addresses, the trainer ranks."""

    def __init__(
        self,
        hosts: list[Any],
        addresses: list[str],
        stages: list[tuple[int, int]],
        start: Callable[[int], Any],
    ) -> None:
        from weightwire.client import WeightPusher

        self.hosts = hosts
        self.start = start  # starts replica i's engine again, on the same worker ports
        self.stages = stages  # (pp_rank, tp_rank) of each worker, in address order
        self.addresses = addresses
        # A reader only (manifests); the trainer ranks push.
        self.reader = WeightPusher(addresses, timeout_s=60)
        self.ranks = TrainerRanks(__file__, addresses, drop_env=["WEIGHTWIRE_SGLANG_SOCKET_DIR"])

    def push(self, **cmd: Any) -> list[dict[str, Any]]:
        for host in self.hosts:
            host.pause("abort")
        try:
            return self.ranks.push(**cmd)
        finally:
            for host in self.hosts:
                host.resume()

    def landed(self, answers: list[dict[str, Any]], version: int, *, slices: bool) -> None:
        assert all(a["ok"] for a in answers), answers
        results = answers[0]["results"]
        assert set(results) == set(self.addresses)
        manifests = self.reader.refresh_manifests()
        for address, r in results.items():
            assert (r["version"], r["state"], r["transport"]) == (version, "CONSISTENT", "transfer_group")
            if slices:
                m = manifests[address]
                assert m.receives_slices, address
                assert r["bytes_received"] == m.kept_bytes < m.total_bytes, (address, r)

    def tokens(self, seed: int) -> list[list[int]]:
        """Every engine's greedy tokens, all equal to transformers' on checkpoint ``seed``."""
        expected = reference_tokens(SPEC, full_checkpoint(SPEC, seed), PROMPTS, NEW_TOKENS)
        for host in self.hosts:
            assert host.tokens(PROMPTS, NEW_TOKENS) == expected
        return expected

    def close(self) -> None:
        self.ranks.close()
        self.reader.close()


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from real_engine import SGLANG_ENVS, EngineHost, engine_kwargs

    env = SGLANG_ENVS[RELEASE]
    if not env.available():
        pytest.skip(f"no SGLang {RELEASE} environment: `make install-sglang` makes it")
    tp, pp, engines = TOPOLOGIES[request.param]
    root = tmp_path_factory.mktemp(f"sglang-slices-{request.param}")
    model = write_model_dir(SPEC, str(root / "model"), full_checkpoint(SPEC, seed=1))
    hosts: list[Any] = []
    addresses: list[str] = []
    f: Fleet | None = None
    bases = [free_ports(tp * pp) for _ in range(engines)]

    def start(replica: int) -> Any:
        return EngineHost(
            env,
            engine_kwargs(model, tp=tp, pp=pp, dtype=SPEC.dtype_name, port=free_ports(1)),
            socket_dir="",  # TCP: the empty directory leaves WEIGHTWIRE_SGLANG_SOCKET_DIR unset
            log_path=str(root / f"engine{replica}-{len(hosts)}.log"),
            extra_env={"WEIGHTWIRE_SGLANG_BASE_PORT": str(bases[replica])},
        )

    try:
        for replica in range(engines):
            hosts.append(start(replica))
            addresses += [f"127.0.0.1:{bases[replica] + i}" for i in range(tp * pp)]
        stages = [(p, t) for _ in range(engines) for p in range(pp) for t in range(tp)]
        f = Fleet(hosts, addresses, stages, start)
        assert wait_until(lambda: _all_answer(f), timeout=120), addresses
        yield f
    finally:
        if f is not None:
            f.close()
        for host in hosts:
            host.stop()


def _all_answer(f: Fleet) -> bool:
    try:
        return len(f.reader.refresh_manifests()) == len(f.addresses)
    except Exception:  # a worker not listening yet
        return False


def test_full_push_then_slices_from_both_ranks_generate_transformers_tokens(fleet: Fleet) -> None:
    manifests = fleet.reader.manifests()
    assert all(m.receives_slices for m in manifests.values()), manifests
    # Each address is the worker of its (replica, stage, tensor rank): every stage of every replica.
    assert [(manifests[a].rank.pp_rank, manifests[a].rank.tp_rank) for a in fleet.addresses] == fleet.stages
    before = fleet.tokens(1)
    fleet.landed(fleet.push(version=1, seed=2, single=True)[:1], 1, slices=False)
    for version, seed in ((2, 3), (3, 4)):
        fleet.landed(fleet.push(version=version, seed=seed), version, slices=True)
        after = fleet.tokens(seed)
        assert after != before, "consecutive checkpoints must give different tokens, or this shows nothing"
        before = after


def _listening_pid(address: str) -> int:
    """The process listening on ``address`` (host:port): an engine worker's scheduler process."""
    import psutil  # an SGLang dependency

    port = int(address.rsplit(":", 1)[1])
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    raise AssertionError(f"nothing listens on {address}")


@pytest.mark.parametrize("fleet", ["tp2-dp2"], indirect=True)  # a replica must be left serving
def test_an_engine_worker_killed_mid_push_is_named_and_the_other_replica_keeps_its_weights(
    fleet: Fleet,
) -> None:
    from weightwire.client import WeightPusher
    from weightwire.v1 import weight_transfer_pb2 as pb

    assert len(fleet.hosts) == 2
    per_replica = len(fleet.addresses) // len(fleet.hosts)
    survivors, lost = fleet.addresses[:per_replica], fleet.addresses[per_replica:]
    victim = lost[0]
    old_version = max(s.weights_version for s in fleet.reader.status().values())
    old_tokens = fleet.hosts[0].tokens(PROMPTS, NEW_TOKENS)
    for host in fleet.hosts:
        host.pause("abort")
    try:
        # Rank 1 waits just before its sends: every worker holds its bucket and waits for bytes.
        fleet.ranks.send(0, json.dumps({"op": "push", "version": old_version + 1, "seed": 7}))
        fleet.ranks.send(1, json.dumps({"op": "push", "version": old_version + 1, "seed": 7, "pause": True}))
        assert fleet.ranks.read(1) == {"paused": True}
        os.kill(_listening_pid(victim), signal.SIGKILL)
        fleet.ranks.send(1, "go")
        answers = [fleet.ranks.read(0), fleet.ranks.read(1)]
    finally:
        fleet.hosts[0].resume()
    assert [a["ok"] for a in answers] == [False, False], answers
    assert answers[0]["failures"] == answers[1]["failures"], json.dumps(answers, indent=1)
    failures = answers[0]["failures"]
    assert failures[victim]["reason"] in ("UNAVAILABLE", "TRANSFER_FAILED"), failures
    for address in survivors:
        # Cancelled because of the victim, or its own receive that still involved it failed.
        assert failures[address]["reason"] in ("CANCELLED", "TRANSFER_FAILED"), failures[address]
    reader = WeightPusher(survivors, timeout_s=30)
    try:
        states = lambda: {(s.weights_version, s.state) for s in reader.status().values()}  # noqa: E731
        assert wait_until(lambda: states() == {(old_version, pb.WORKER_STATE_CONSISTENT)}, timeout=60), (
            states()
        )
    finally:
        reader.close()
    assert fleet.hosts[0].tokens(PROMPTS, NEW_TOKENS) == old_tokens

    # The lost replica's engine started again (its weights are the model directory's): a FULL push
    # proves its direct-copy regions, and the next slices push lands on every worker.
    fleet.hosts[1].stop()
    fleet.hosts[1] = fleet.start(1)
    assert wait_until(lambda: _all_answer(fleet), timeout=120), fleet.addresses
    # Until its channels reconnect, UNAVAILABLE; then MANIFEST_CHANGED once (another instance: nothing
    # is sent, and the next push reads the manifests again).
    for _ in range(30):
        answers = fleet.push(version=old_version + 1, seed=8, single=True)[:1]
        if answers[0]["ok"]:
            break
        reasons = {f["reason"] for f in answers[0]["failures"].values()}
        assert reasons <= {"UNAVAILABLE", "MANIFEST_CHANGED"}, answers
    fleet.landed(answers, old_version + 1, slices=False)
    fleet.landed(fleet.push(version=old_version + 2, seed=9), old_version + 2, slices=True)
    assert fleet.tokens(9) != old_tokens


if __name__ == "__main__":
    sys.exit(slice_trainer_main(sys.argv[1:], lambda seed: full_checkpoint(SPEC, seed)))
