"""FSDP2 trainers pushing with one ``push(...)`` line on every rank: real torch.distributed (gloo) ranks
in separate processes, the demo model sharded with ``fully_shard``, real workers in separate
processes, and the workers' dumped parameters compared bit for bit.

Fleets (shared by every test of this module): a TP2 and a TP2 x PP2 engine of real ``weightwire
serve`` workers (host devices of this machine); a TP2 x PP2 engine whose four workers sit on four
stand-in GPUs (``labelled_worker.py``: a host label per worker, standing for the GPU a real worker
would be on; trainer rank r labels its shared memory as stand-in GPU r), for the direct per-rank
pattern; a bf16 worker for the explicit dtype conversion; a worker of a model whose vocabulary and
MLP sizes do not divide by the number of ranks (FSDP2's uneven shards). Each group of ranks runs its scenarios in
one launch (``fsdp_rank.py``), and the tests read what every rank reported.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fsdp_ranks import Fleet, RankRun, labelled_fleet, run_ranks, serve_fleet
from weightwire.adapters.torch.demo import DemoConfig
from weightwire.v1 import weight_transfer_pb2 as pb

# Several worker fleets and rank launches on a machine that may be shared: the first test of a
# launch waits for it. Generous, because a slow machine must not fail these tests.
pytestmark = pytest.mark.timeout(900)

STAND_IN = [f"stand-in-gpu-{i}" for i in range(4)]
# 257 rows over 2 ranks are 129 + 128, over 4 ranks 65 + 64 + 64 + 64; 131 likewise.
ODD = {"vocab_size": 257, "intermediate_size": 131}


class Fleets:
    def __init__(self, base: str) -> None:
        self.tp2 = serve_fleet(2, 1, f"{base}/tp2")
        self.tp2pp2 = serve_fleet(2, 2, f"{base}/tp2pp2")
        # Worker (tp t, pp p) on stand-in GPU p * 2 + t: one engine worker per GPU, as colocated.
        self.gpus = labelled_fleet(2, 2, f"{base}/gpus", labels=STAND_IN)
        self.bf16 = labelled_fleet(1, 1, f"{base}/bf16", labels=[None], config_args=["--dtype", "bfloat16"])
        self.odd = labelled_fleet(
            1,
            1,
            f"{base}/odd",
            labels=[None],
            config_args=["--vocab-size", "257", "--intermediate-size", "131"],
            config=DemoConfig(**ODD),
        )

    def all(self) -> list[Fleet]:
        return [self.tp2, self.tp2pp2, self.gpus, self.bf16, self.odd]

    def versions(self) -> dict[str, list[int]]:
        return {name: [s.weights_version for s in f.statuses()] for name, f in self.named().items()}

    def named(self) -> dict[str, Fleet]:
        return {"tp2": self.tp2, "tp2pp2": self.tp2pp2, "gpus": self.gpus, "bf16": self.bf16, "odd": self.odd}


@pytest.fixture(scope="module")
def fleets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleets]:
    f = Fleets(str(tmp_path_factory.mktemp("fsdp-fleets")))
    yield f
    for fleet in f.all():
        fleet.stop()


class Launch:
    """One run of N ranks over some scenarios, with the version each scenario pushed and every
    fleet's versions before and after."""

    def __init__(
        self,
        run: RankRun,
        versions: dict[str, int],
        before: dict[str, list[int]],
        after: dict[str, list[int]],
    ) -> None:
        self.run = run
        self.versions = versions
        self.before = before
        self.after = after

    def records(self, scenario: str) -> list[dict[str, Any]]:
        recs = self.run.of(scenario)
        assert all("missing" not in r for r in recs), (
            f"{scenario}: a rank did not report\n{self.run.explain()}"
        )
        return recs

    def ok(self, scenario: str) -> dict[str, Any]:
        """The results every rank returned, checked to be the same on every rank."""
        recs = self.records(scenario)
        for r in recs:
            assert r["ok"], f"{scenario}: {r.get('error')}\n{self.run.explain()}"
        first = recs[0]["results"]
        for r in recs[1:]:
            assert _comparable(r["results"]) == _comparable(first), (
                f"{scenario}: ranks returned different results"
            )
        return first  # type: ignore[no-any-return]


def _comparable(results: dict[str, Any]) -> dict[str, Any]:
    # Client-side timings differ between ranks; everything the workers reported must not.
    return {
        a: {k: v for k, v in r.items() if k not in ("duration_s", "server_duration_s")}
        for a, r in results.items()
    }


def scenario(name: str, fleet: Fleet, version: int, **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "push",
        "endpoints": fleet.endpoints,
        "version": version,
        "seed": version,
        "bucket_size_bytes": 16 * 1024,
        "timeout_s": 120,
        **kw,
    }


@pytest.fixture(scope="module")
def two_ranks(fleets: Fleets, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    v = {
        "tp2": fleets.tp2.next_version(),
        "tp2pp2": fleets.tp2pp2.next_version(),
        "gpus": fleets.gpus.next_version(),
        "bf16": fleets.bf16.next_version(),
        "odd": fleets.odd.next_version(),
    }
    versions = {
        "odd_shapes": v["odd"],
        "tp2_own_device": v["tp2"],
        "tp2_named_parameters_gathered": v["tp2"] + 1,
        "tp2pp2_gathered": v["tp2pp2"],
        "bf16_without_cast": v["bf16"],
        "bf16_cast": v["bf16"],
        "gpus_unreachable": v["gpus"],
        "disagree": v["tp2"] + 2,
        "not_pushing": v["tp2"] + 2,
    }
    scenarios = [
        {"name": "gather_checks", "kind": "gather_checks"},
        {
            "name": "flat_dtensor",
            "kind": "flat_dtensor",
            "endpoints": fleets.tp2.endpoints,
            "version": versions["tp2_own_device"],
        },
        scenario("tp2_own_device", fleets.tp2, versions["tp2_own_device"]),
        scenario(
            "tp2_named_parameters_gathered",
            fleets.tp2,
            versions["tp2_named_parameters_gathered"],
            source="named_parameters",
            routing="gathered",
            sender_rank=1,
        ),
        scenario("tp2pp2_gathered", fleets.tp2pp2, versions["tp2pp2_gathered"], routing="gathered"),
        scenario("odd_shapes", fleets.odd, versions["odd_shapes"], config=ODD),
        scenario("bf16_without_cast", fleets.bf16, versions["bf16_without_cast"]),
        scenario("bf16_cast", fleets.bf16, versions["bf16_cast"], cast_to="bfloat16"),
        scenario(
            "gpus_unreachable",
            fleets.gpus,
            versions["gpus_unreachable"],
            stand_in_gpu=True,
            transport="host_shm",
        ),
        scenario(
            "disagree", fleets.tp2, versions["disagree"], version_by_rank={"1": versions["disagree"] + 1}
        ),
        # Last: rank 1 never calls push, so rank 0's agreement times out on a group of its own.
        scenario("not_pushing", fleets.tp2, versions["not_pushing"], skip_ranks=[1], timeout_s=3),
    ]
    before = fleets.versions()
    run = run_ranks(2, scenarios, str(tmp_path_factory.mktemp("two-ranks")))
    assert run.returncodes == [0, 0], run.explain()
    return Launch(run, versions, before, fleets.versions())


@pytest.fixture(scope="module")
def four_ranks(fleets: Fleets, two_ranks: Launch, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    v = {
        "tp2": fleets.tp2.next_version(),
        "tp2pp2": fleets.tp2pp2.next_version(),
        "gpus": fleets.gpus.next_version(),
        "odd": fleets.odd.next_version(),
    }
    versions = {
        "odd_shapes": v["odd"],
        "tp2_own_device": v["tp2"],
        "tp2pp2_gathered": v["tp2pp2"],
        "tp2pp2_own_device": v["tp2pp2"] + 1,
        "gpus_own_device": v["gpus"],
        "gpus_gathered": v["gpus"] + 1,
        "gpus_one_worker_refuses": v["gpus"] + 2,
        "raised": v["gpus"] + 10,
    }
    scenarios = [
        {"name": "gather_checks", "kind": "gather_checks"},
        scenario("tp2_own_device", fleets.tp2, versions["tp2_own_device"]),
        scenario("tp2pp2_gathered", fleets.tp2pp2, versions["tp2pp2_gathered"], routing="gathered"),
        scenario(
            "tp2pp2_own_device", fleets.tp2pp2, versions["tp2pp2_own_device"], source="named_parameters"
        ),
        scenario("odd_shapes", fleets.odd, versions["odd_shapes"], config=ODD, routing="gathered"),
        scenario(
            "gpus_own_device",
            fleets.gpus,
            versions["gpus_own_device"],
            stand_in_gpu=True,
            transport="host_shm",
        ),
        scenario(
            "gpus_gathered",
            fleets.gpus,
            versions["gpus_gathered"],
            stand_in_gpu=True,
            transport="host_shm",
            routing="gathered",
            sender_rank=2,
        ),
        # The worker on GPU 1 is moved past the next version, so it refuses it (STALE_VERSION) while
        # the workers of the other ranks accept every bucket: none of them may commit.
        {
            "name": "raise",
            "kind": "raise_version",
            "endpoint": fleets.gpus.endpoints[1],
            "version": versions["raised"],
        },
        scenario(
            "gpus_one_worker_refuses",
            fleets.gpus,
            versions["gpus_one_worker_refuses"],
            stand_in_gpu=True,
            transport="host_shm",
        ),
    ]
    before = fleets.versions()
    run = run_ranks(4, scenarios, str(tmp_path_factory.mktemp("four-ranks")))
    assert run.returncodes == [0, 0, 0, 0], run.explain()
    return Launch(run, versions, before, fleets.versions())


def launch(request: pytest.FixtureRequest, world: int) -> Launch:
    return request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------
# Gathers, and pushes that commit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_full_values_of_every_dtensor_layout(request: pytest.FixtureRequest, world: int) -> None:
    for rec in launch(request, world).records("gather_checks"):
        assert rec["ok"], rec["cases"]


@pytest.mark.parametrize(
    ("world", "name", "fleet_name"),
    [
        (2, "tp2_own_device", "tp2"),
        (2, "tp2pp2_gathered", "tp2pp2"),
        (4, "tp2_own_device", "tp2"),
        (4, "tp2pp2_gathered", "tp2pp2"),
        (4, "tp2pp2_own_device", "tp2pp2"),
        (2, "odd_shapes", "odd"),
        (4, "odd_shapes", "odd"),
    ],
)
def test_fsdp2_into_real_serve_fleets_bit_exact(
    request: pytest.FixtureRequest, fleets: Fleets, world: int, name: str, fleet_name: str
) -> None:
    run = launch(request, world)
    fleet = fleets.named()[fleet_name]
    version = run.versions[name]
    results = run.ok(name)
    assert sorted(results) == sorted(fleet.endpoints)
    for r in results.values():
        assert (r["version"], r["state"]) == (version, "CONSISTENT")
    fleet.assert_dumps(version, seed=version)


def test_named_parameters_from_another_sending_rank(two_ranks: Launch, fleets: Fleets) -> None:
    version = two_ranks.versions["tp2_named_parameters_gathered"]
    results = two_ranks.ok("tp2_named_parameters_gathered")
    assert {r["version"] for r in results.values()} == {version}
    fleets.tp2.assert_dumps(version, seed=version)


def test_direct_per_rank_each_worker_gets_its_own_gpus_payload(four_ranks: Launch, fleets: Fleets) -> None:
    """Four ranks on four stand-in GPUs, one worker per GPU: each rank streams only to the worker on
    its own GPU, so each worker imported only from its own GPU."""
    version = four_ranks.versions["gpus_own_device"]
    results = four_ranks.ok("gpus_own_device")
    for address, label in zip(fleets.gpus.endpoints, STAND_IN, strict=True):
        assert results[address]["version"] == version
        assert results[address]["source_devices"] == [f"host:{label}"]
        assert results[address]["transport"] == "host_shm"
    fleets.gpus.assert_dumps(version, seed=version)


def test_gathered_every_worker_imports_from_its_own_gpu(four_ranks: Launch, fleets: Fleets) -> None:
    """One rank (2) streams every bucket; each bucket carries the payloads exported by the ranks on
    the GPUs of its workers, and each worker takes the one labelled with its own GPU."""
    version = four_ranks.versions["gpus_gathered"]
    results = four_ranks.ok("gpus_gathered")
    for address, label in zip(fleets.gpus.endpoints, STAND_IN, strict=True):
        assert results[address]["version"] == version
        assert results[address]["source_devices"] == [f"host:{label}"]
    fleets.gpus.assert_dumps(version, seed=version)


def test_no_worker_commits_a_version_another_ranks_worker_refused(four_ranks: Launch, fleets: Fleets) -> None:
    """Direct per-rank: rank 1's worker refuses the version; ranks 0, 2 and 3 had their own workers
    accept every bucket, and still none of them commits. Every rank raises the same PushError: the
    refusing worker first, with its reason, the others cancelled because of rank 1."""
    refused = fleets.gpus.endpoints[1]
    for rec in four_ranks.records("gpus_one_worker_refuses"):
        assert not rec["ok"] and rec["error"]["type"] == "PushError", rec
        failures = rec["error"]["failures"]
        assert next(iter(failures)) == refused and failures[refused]["reason"] == "STALE_VERSION"
        for a in fleets.gpus.endpoints:
            if a != refused:
                assert failures[a]["reason"] == "CANCELLED" and "trainer rank 1" in failures[a]["message"], (
                    failures[a]
                )
        assert rec["error"]["results"] == []
    raised, last_good = four_ranks.versions["raised"], four_ranks.versions["gpus_gathered"]
    assert four_ranks.after["gpus"] == [last_good, raised, last_good, last_good]


def test_explicit_dtype_conversion(two_ranks: Launch, fleets: Fleets) -> None:
    """fp32 FSDP2 weights into a bf16 engine: refused on every rank without cast_to (nothing sent),
    converted with it."""
    for rec in two_ranks.records("bf16_without_cast"):
        assert not rec["ok"] and rec["error"]["reason"] == "DTYPE_MISMATCH"
        assert "cast_to=torch.bfloat16" in rec["error"]["message"]
    version = two_ranks.versions["bf16_cast"]
    results = two_ranks.ok("bf16_cast")
    assert [r["version"] for r in results.values()] == [version]
    fleets.bf16.assert_dumps(version, seed=version, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Updates refused on every rank before anything is sent
# ---------------------------------------------------------------------------------------------


def test_two_ranks_cannot_serve_four_gpus(two_ranks: Launch) -> None:
    for rec in two_ranks.records("gpus_unreachable"):
        assert not rec["ok"] and rec["error"]["reason"] == "NO_PAYLOAD_FOR_DEVICE"
        assert (
            "host:stand-in-gpu-2" in rec["error"]["message"]
            and "host:stand-in-gpu-3" in rec["error"]["message"]
        )
    assert two_ranks.after["gpus"] == two_ranks.before["gpus"]


def test_dtensors_in_flat_entry_points_are_refused_with_a_reason(two_ranks: Launch) -> None:
    """push_flat and export_payload take local flat buffers: a DTensor shard gets SHARDED_BUFFER and
    a pointer to push(), not an error from inside torch."""
    for rec in two_ranks.records("flat_dtensor"):
        for what in ("push_flat", "export_payload"):
            case = rec["cases"][what]
            assert not case["ok"] and case["error"]["reason"] == "SHARDED_BUFFER", case
            assert "push()" in case["error"]["message"]


def test_ranks_pushing_different_versions_are_refused(two_ranks: Launch) -> None:
    version = two_ranks.versions["disagree"]
    for rec in two_ranks.records("disagree"):
        assert not rec["ok"] and rec["error"]["reason"] == "TRAINER_RANKS_DISAGREE", rec
        assert f"the version: rank 0 = {version}, rank 1 = {version + 1}" in rec["error"]["message"]
    # Nothing was sent: the TP2 workers are still at the version of the last good update.
    assert two_ranks.after["tp2"] == [two_ranks.versions["tp2_named_parameters_gathered"]] * 2


def test_a_rank_that_does_not_push_fails_the_others_with_a_reason(two_ranks: Launch) -> None:
    pushing, skipping = two_ranks.records("not_pushing")
    assert skipping == {"ok": True, "skipped": True}
    assert not pushing["ok"] and pushing["error"]["reason"] == "TRAINER_RANK_LOST"
    assert "not calling push" in pushing["error"]["message"]


# ---------------------------------------------------------------------------------------------
# A rank that dies mid-push
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "fleet_name", "routing", "dying"), [(4, "gpus", "own_device", 3), (2, "tp2", "gathered", 0)]
)
def test_a_rank_dying_mid_push_fails_the_update_everywhere(
    four_ranks: Launch,
    fleets: Fleets,
    tmp_path_factory: pytest.TempPathFactory,
    world: int,
    fleet_name: str,
    routing: str,
    dying: int,
) -> None:
    """A rank exits once its first bucket was acked: every other rank fails with TRAINER_RANK_LOST
    (no hang: every process ended by itself), and no worker commits the version."""
    fleet = fleets.named()[fleet_name]
    before = [s.weights_version for s in fleet.statuses()]
    version = max(before) + 1
    sc = scenario(
        "dies",
        fleet,
        version,
        routing=routing,
        die_rank=dying,
        die_after_buckets=1,
        stand_in_gpu=fleet_name == "gpus",
        transport="host_shm",
    )
    run = run_ranks(world, [sc], str(tmp_path_factory.mktemp(f"dies-{world}")), timeout_s=600)
    assert run.returncodes == [17 if r == dying else 0 for r in range(world)], run.explain()
    for r, rec in enumerate(run.of("dies")):
        if r == dying:
            assert "missing" in rec
            continue
        assert not rec["ok"] and rec["error"]["reason"] == "TRAINER_RANK_LOST", rec
    statuses = fleet.statuses()
    assert [s.weights_version for s in statuses] == before
    assert all(s.state in (pb.WORKER_STATE_CONSISTENT, pb.WORKER_STATE_INCONSISTENT) for s in statuses)
    assert any(s.last_error.reason == "CANCELLED" for s in statuses)
