"""Delta updates over a transfer group (gloo on loopback TCP, one trainer process as the source)
into real ``weightwire serve`` worker processes: a TP2 x PP2 engine (four workers, shared by the
module), the trainer being this process.

After a FULL push and several sparse delta pushes, point-to-point and broadcast, every worker's
weights equal the trainer's bit for bit (digests of its dumps); the bytes that reached each worker
over the group are exactly the encodings of the tensors it owns, a small part of a FULL update. A
worker moved to another version, and a worker restarted, get the automatic FULL, and the results
say why; a delta against a base no worker ever had is refused by every worker with
DELTA_BASE_MISMATCH before anything is written (the version stays; the next delta against the
real base, which verifies every tensor's result checksum, lands).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping

import pytest
import torch
from group_fleet import CONFIG, Fleet, Member
from helpers import load_dump, wait_until
from weightwire.adapters.torch.demo import expected_shard, full_checkpoint
from weightwire.client import PushError, WeightPusher
from weightwire.client.transports.transfer_group import TransferGroupOptions
from weightwire.client.update import delta as delta_push
from weightwire.client.update.options import PushOptions
from weightwire.core.delta import BaseKeeper, encode, packed_size_bytes
from weightwire.core.errors import Reason
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

HOST = "127.0.0.1"
# Of every tensor's elements, the share a step changes: a sparse step, as at RL learning rates.
CHANGED = 0.005
pytestmark = pytest.mark.timeout(900)

Checkpoint = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("group-delta-fleet")
    (root / "sock").mkdir()
    f = Fleet(str(root / "sock"), str(root / "dump"), replicas=1)
    yield f
    f.stop()


def pusher_for(fleet: Fleet, *, broadcast: bool = True) -> WeightPusher:
    return WeightPusher(
        fleet.addresses(),
        transfer_group=TransferGroupOptions(host=HOST, broadcast=broadcast),
        timeout_s=120,
    )


def sparse_step(ckpt: Mapping[str, torch.Tensor], seed: int) -> Checkpoint:
    """``ckpt`` with ``CHANGED`` of each tensor's elements (at least one) moved a little."""
    gen = torch.Generator().manual_seed(seed)
    out: Checkpoint = {}
    for name, t in ckpt.items():
        new = t.clone()
        flat = new.view(-1)
        k = max(1, int(flat.numel() * CHANGED))
        at = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[at] += 1e-2
        out[name] = new
    return out


def digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {
        n: hashlib.blake2b(t.contiguous().view(-1).view(torch.uint8).numpy().data).hexdigest()
        for n, t in sorted(tensors.items())
    }


def assert_holds(fleet: Fleet, member: Member, version: int, full: Checkpoint) -> None:
    """The worker's dump of ``version`` has the digests of its shard of ``full``."""
    got = digests(load_dump(fleet.dump_dir, member.worker_id, version))
    want = digests(expected_shard(full, member.rank, CONFIG))
    assert got == want, f"{member.worker_id} v{version}: {sorted(n for n in want if got.get(n) != want[n])}"


def manifest_of(member: Member) -> ShardManifest:
    return ShardManifest.from_proto(member.stub().GetManifest(pb.GetManifestRequest()).manifest)


def encoded_bytes_owned(member: Member, old: Checkpoint, new: Checkpoint) -> int:
    """The bytes of the encodings of the changes of every tensor ``member`` owns."""
    return sum(packed_size_bytes(encode(old[n], new[n]), 0) for n in manifest_of(member).tensors)


def full_push(fleet: Fleet, pusher: WeightPusher, version: int, ckpt: Checkpoint) -> None:
    results = pusher.push(ckpt, version=version, delta=True)
    for m in fleet.members:
        r = results[m.address]
        assert (r.encoding, r.delta_fallback, r.transport) == ("FULL", "NO_BASE", "transfer_group")
        assert r.bytes_received == manifest_of(m).total_bytes
        assert_holds(fleet, m, version, ckpt)


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "point_to_point"])
def test_delta_pushes_over_a_group_are_bit_exact_and_send_only_the_encodings(
    fleet: Fleet, broadcast: bool
) -> None:
    version = fleet.next_version()
    ckpt = full_checkpoint(CONFIG, version)
    with pusher_for(fleet, broadcast=broadcast) as pusher:
        full_push(fleet, pusher, version, ckpt)
        for step in range(3):
            new = sparse_step(ckpt, seed=version * 10 + step)
            version += 1
            results = pusher.push(new, version=version, delta=True)
            for m in fleet.members:
                r = results[m.address]
                assert (r.encoding, r.delta_fallback, r.delta_refused) == ("DELTA", "NONE", 0)
                assert (r.state, r.transport, r.version) == ("CONSISTENT", "transfer_group", version)
                # Only the encodings of the worker's own tensors crossed the wire to it.
                assert r.bytes_received == encoded_bytes_owned(m, ckpt, new)
                assert 0 < r.bytes_received < manifest_of(m).total_bytes // 10
                assert_holds(fleet, m, version, new)
            ckpt = new
        link = pusher._group
        assert link is not None and link.formations == 1  # one group for the FULL and every delta
        plan = link.plan
        assert plan is not None and bool(plan.spec.subgroups) == broadcast


def test_a_worker_moved_elsewhere_or_restarted_gets_the_automatic_full(fleet: Fleet) -> None:
    version = fleet.next_version()
    ckpt = full_checkpoint(CONFIG, version)
    moved, restarted = fleet.members[1], fleet.members[2]
    with pusher_for(fleet) as pusher:
        full_push(fleet, pusher, version, ckpt)
        # Another trainer's FULL update of one worker: its version is not the pusher's base.
        version += 1
        other = sparse_step(ckpt, seed=1)
        with WeightPusher([moved.address], transport="inline", timeout_s=120) as elsewhere:
            elsewhere.push(other, version=version, allow_unowned=True)
        version += 1
        ckpt = sparse_step(ckpt, seed=2)
        results = pusher.push(ckpt, version=version, delta=True)
        for m in fleet.members:
            r = results[m.address]
            assert (r.encoding, r.delta_fallback, r.state) == ("FULL", "BASE_MISMATCH", "CONSISTENT")
            assert r.bytes_received == manifest_of(m).total_bytes
            assert_holds(fleet, m, version, ckpt)
        # That FULL is the next base: deltas again.
        version += 1
        ckpt = sparse_step(ckpt, seed=3)
        results = pusher.push(ckpt, version=version, delta=True)
        assert {r.encoding for r in results.values()} == {"DELTA"}
        for m in fleet.members:
            assert_holds(fleet, m, version, ckpt)

        # A worker restarted mid-run: back at version 0 as a new instance, in no group.
        before = restarted.status().instance_id
        fleet.restart(restarted)
        # (its channel in this pusher reconnects first; waiting for that is not what is tested)
        assert wait_until(lambda: _answers(pusher, restarted.address, before), timeout=120, interval=0.2)
        version += 1
        ckpt = sparse_step(ckpt, seed=4)
        results = pusher.push(ckpt, version=version, delta=True)
        for m in fleet.members:
            r = results[m.address]
            assert (r.encoding, r.delta_fallback, r.state) == ("FULL", "BASE_MISMATCH", "CONSISTENT")
            assert_holds(fleet, m, version, ckpt)
        assert results[restarted.address].previous_version == 0
        link = pusher._group
        assert link is not None and link.formations == 2  # formed anew with the restarted worker
        version += 1
        ckpt = sparse_step(ckpt, seed=5)
        results = pusher.push(ckpt, version=version, delta=True)
        assert {r.encoding for r in results.values()} == {"DELTA"}
        for m in fleet.members:
            assert_holds(fleet, m, version, ckpt)


def _answers(pusher: WeightPusher, address: str, old_instance: str) -> bool:
    try:
        return pusher.status()[address].instance_id not in ("", old_instance)
    except PushError:
        return False


def test_a_delta_against_a_base_no_worker_had_is_refused_before_anything_is_written(fleet: Fleet) -> None:
    version = fleet.next_version()
    ckpt = full_checkpoint(CONFIG, version)
    with pusher_for(fleet) as pusher:
        full_push(fleet, pusher, version, ckpt)
        held = version
        # A trainer that believes the workers hold a version none of them ever had: the same
        # tensors as base, but labelled ``never``. What push(delta=True) sends, without the
        # status check or the fallback that would make it FULL.
        never = held + 1000
        confused = BaseKeeper()
        confused.begin(never)
        for n, t in ckpt.items():
            confused.record(n, t)
        confused.commit(never)
        stepped = sparse_step(ckpt, seed=7)
        options = dataclasses.replace(
            PushOptions(version=never + 1, scope=pb.UPDATE_SCOPE_FULL), delta_base=never
        )
        with pytest.raises(PushError) as refused:
            delta_push._send_delta(
                pusher, confused, list(stepped.items()), options, pusher.manifests(), never, "transfer_group"
            )
        failures = refused.value.failures
        # Every worker refuses at the header; one whose refusal came first may have the others'
        # update cancelled before their header was read (CANCELLED: nothing begun there either).
        mismatched = [a for a, err in failures.items() if err.kind is Reason.DELTA_BASE_MISMATCH]
        assert mismatched and {err.kind for err in failures.values()} <= {
            Reason.DELTA_BASE_MISMATCH,
            Reason.CANCELLED,
        }, failures
        for a in mismatched:
            # (a refusal the cancel overtook is read back from the worker's status: no metadata)
            meta = failures[a].metadata
            if meta:
                assert (meta["base_version"], meta["worker_version"]) == (str(never), str(held)), meta
            assert f"against version {never} reached a worker at version {held}" in failures[a].message
        for m in fleet.members:
            st = m.status()
            assert (st.weights_version, st.state) == (held, pb.WORKER_STATE_CONSISTENT)
            if m.address in mismatched:
                assert (st.last_error.reason, st.last_error.version) == ("DELTA_BASE_MISMATCH", never + 1)
        # Nothing was written: a delta against the base they do hold, whose result checksums cover
        # every tensor (unchanged ones as empty deltas), lands and verifies on every worker.
        version = held + 1
        results = pusher.push(stepped, version=version, delta=True)
        for m in fleet.members:
            r = results[m.address]
            assert (r.encoding, r.delta_fallback, r.state) == ("DELTA", "NONE", "CONSISTENT")
            assert_holds(fleet, m, version, stepped)
