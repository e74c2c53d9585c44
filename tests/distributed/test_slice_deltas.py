"""Delta updates with every trainer rank a source (issue 38), between real processes over gloo on
loopback: 2 FSDP2 trainer ranks (``slice_trainer.py``) into real ``weightwire serve`` workers of a
TP2 x PP2 engine in two replicas (eight workers; one fleet for the module), so regions go to
several workers (a replicated norm to both TP ranks of a stage, every region to both replicas).

After a FULL push, each sparse delta push leaves every worker bit for bit at its shard of the
trainer's checkpoint, each worker having received only the encodings of the regions it keeps
(``bytes_received`` = the trainer's streams to it, far below its kept bytes; ``changed_elements``
= the elements of its shard that changed). A restarted worker is brought back by the FULL every
rank falls back to together; a delta against a base no worker had is refused by the workers with
DELTA_BASE_MISMATCH before anything is written (version and state unchanged, and the next delta
against the real base, whose region checksums cover every kept element, lands).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from group_fleet import CONFIG, Fleet, Member
from helpers import wait_until
from slice_ranks import Ranks
from sparse_checkpoint import stepped
from weightwire.adapters.torch.demo import expected_shard
from weightwire.core.delta.record import as_bits
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("slice-delta-fleet")
    (root / "sock").mkdir()
    f = Fleet(str(root / "sock"), str(root / "dump"), replicas=2)
    yield f
    f.stop()


@pytest.fixture(scope="module")
def ranks(fleet: Fleet) -> Iterator[Ranks]:
    # A restarted worker starts its gloo receiving process (an interpreter importing torch) while
    # the group forms: on a loaded 2-core machine that outlasts the default 20 s.
    r = Ranks(2, fleet.addresses(), "--group-timeout", "60")
    yield r
    r.close()


def kept_bytes(member: Member) -> int:
    return ShardManifest.from_proto(member.stub().GetManifest(pb.GetManifestRequest()).manifest).kept_bytes


def changed_in_shard(member: Member, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """Elements of ``member``'s shard that differ between ``old`` and ``new``."""
    a, b = expected_shard(old, member.rank, CONFIG), expected_shard(new, member.rank, CONFIG)
    return sum(int((as_bits(a[n]) != as_bits(b[n])).sum()) for n in a)


def results_of(answers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank returned the same results: those."""
    assert all(a["ok"] for a in answers), answers
    assert all(a["results"] == answers[0]["results"] for a in answers)
    return answers[0]["results"]  # type: ignore[no-any-return]


def full_push(fleet: Fleet, ranks: Ranks, version: int, seed: int, steps: list[int], why: str) -> None:
    results = results_of(ranks.push(version=version, seed=seed, steps=steps, delta=True))
    for m in fleet.members:
        r = results[m.address]
        assert (r["encoding"], r["delta_fallback"], r["state"]) == ("FULL", why, "CONSISTENT"), r
        assert r["bytes_received"] == kept_bytes(m)
        fleet.assert_holds(m, version, stepped(CONFIG, seed, steps))


def base_push(fleet: Fleet, ranks: Ranks, version: int, seed: int) -> None:
    """A new checkpoint every worker holds afterwards (a delta from the module's last push: every
    test starts from a base every rank and every worker share)."""
    results = results_of(ranks.push(version=version, seed=seed, delta=True))
    for m in fleet.members:
        assert results[m.address]["state"] == "CONSISTENT"
        fleet.assert_holds(m, version, stepped(CONFIG, seed))


def delta_push(fleet: Fleet, ranks: Ranks, version: int, seed: int, steps: list[int]) -> None:
    old, new = stepped(CONFIG, seed, steps[:-1]), stepped(CONFIG, seed, steps)
    results = results_of(ranks.push(version=version, seed=seed, steps=steps, delta=True))
    for m in fleet.members:
        r = results[m.address]
        assert (r["encoding"], r["delta_fallback"], r["delta_refused"]) == ("DELTA", "NONE", 0), r
        assert (r["state"], r["version"], r["transport"]) == ("CONSISTENT", version, "transfer_group")
        fleet.assert_holds(m, version, new)
        # Only the encodings of the regions it keeps crossed the wire to it, every change counted.
        assert r["bytes_received"] == r["encoded_bytes"]
        assert 0 < r["bytes_received"] < kept_bytes(m) // 10, (m.worker_id, r["bytes_received"])
        last = m.status().last_result
        assert (last.encoding, last.base_version) == (pb.UPDATE_ENCODING_DELTA, version - 1)
        assert last.changed_elements == changed_in_shard(m, old, new) > 0
        # One region checksum verified per region applied (the regions tile the kept pieces).
        assert last.result_checksums_verified == last.delta_tensors > 0


def test_sparse_deltas_from_every_rank_are_bit_exact_and_send_only_the_encodings(
    fleet: Fleet, ranks: Ranks
) -> None:
    version = fleet.next_version()
    seed = version
    full_push(fleet, ranks, version, seed, [], "NO_BASE")
    steps: list[int] = []
    for k in range(3):
        steps.append(seed * 10 + k)
        version += 1
        delta_push(fleet, ranks, version, seed, steps)


def _restarted(member: Member, old_instance: str) -> bool:
    try:
        return member.status().instance_id not in ("", old_instance)
    except Exception:
        return False


def test_a_restarted_worker_is_brought_back_by_the_full_of_every_rank(fleet: Fleet, ranks: Ranks) -> None:
    version = fleet.next_version()
    seed = version
    base_push(fleet, ranks, version, seed)
    restarted = fleet.members[1]
    before = restarted.status().instance_id
    fleet.restart(restarted)
    assert wait_until(lambda: _restarted(restarted, before), timeout=120, interval=0.2)
    version += 1
    full_push(fleet, ranks, version, seed, [1], "BASE_MISMATCH")
    # That FULL is every rank's base again.
    version += 1
    delta_push(fleet, ranks, version, seed, [1, 2])


def test_a_delta_against_a_base_no_worker_had_is_refused_before_anything_is_written(
    fleet: Fleet, ranks: Ranks
) -> None:
    held = fleet.next_version()
    seed = held
    base_push(fleet, ranks, held, seed)
    never = held + 1000
    answers = ranks.push(version=never + 1, seed=seed, steps=[7], forge_base=never)
    assert not any(a["ok"] for a in answers), answers
    failures = answers[0]["error"]["failures"]
    assert all(a["error"]["failures"] == failures for a in answers)
    # Every worker refuses at the header; one whose refusal came first may have the others'
    # update cancelled before their header was read (CANCELLED: nothing begun there either).
    mismatched = [a for a, f in failures.items() if f["reason"] == "DELTA_BASE_MISMATCH"]
    assert mismatched and {f["reason"] for f in failures.values()} <= {"DELTA_BASE_MISMATCH", "CANCELLED"}
    for a in mismatched:
        assert f"against version {never} reached a worker at version {held}" in failures[a]["message"]
    for m in fleet.members:
        st = m.status()
        assert (st.weights_version, st.state) == (held, pb.WORKER_STATE_CONSISTENT)
        fleet.assert_holds(m, held, stepped(CONFIG, seed))
    # Nothing was written, and every rank kept its base: the next delta lands and verifies.
    delta_push(fleet, ranks, held + 1, seed, [7])
