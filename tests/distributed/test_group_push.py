"""Weights over a transfer group (gloo on loopback TCP) into real ``weightwire serve`` worker
processes: a TP2 x PP2 engine and a second data-parallel replica of it (eight workers, shared by the
module), the trainer being this process or a ``group_trainer.py`` process.

Every worker's dump is bit-exact and its bytes received equal its manifest's bytes; a stage-1 worker
receives no byte of a stage-0 layer even when a bucket lists both; the group is formed once and
reused, with at most two staging buffers per worker; two workers claiming one group rank are
refused before any byte moves; two trainer processes push to disjoint replicas in parallel; a
trainer killed mid-bucket leaves every worker with a reason and the next update succeeds; a worker
killed mid-update is named, the others cancelled, and after its restart the group is re-formed
without restarting anything else.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch
from group_fleet import CONFIG, Fleet, Member, Trainer
from helpers import error_info, wait_until
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.client import (
    FlatBucket,
    PushError,
    PushProgress,
    WeightPusher,
    layout_flat,
    pack_into,
)
from weightwire.client.transports.transfer_group import TransferGroupOptions
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.transfer_group import TransferGroup
from weightwire.core.transports.transfer_group_plan import MemberIdentity, plan_group
from weightwire.core.transports.transfer_group_store import StoreServer
from weightwire.v1 import weight_transfer_pb2 as pb

HOST = "127.0.0.1"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("group-fleet")
    (root / "sock").mkdir()
    f = Fleet(str(root / "sock"), str(root / "dump"))
    yield f
    f.stop()


def pusher_for(fleet: Fleet, members: list[Member] | None = None, **options: object) -> WeightPusher:
    return WeightPusher(
        fleet.addresses(members),
        transfer_group=TransferGroupOptions(host=HOST, **options),
        timeout_s=30,  # type: ignore[arg-type]
    )


def manifest_bytes(member: Member) -> int:
    manifest = ShardManifest.from_proto(member.stub().GetManifest(pb.GetManifestRequest()).manifest)
    return manifest.total_bytes


def test_push_over_a_group_is_bit_exact_and_shard_aware(fleet: Fleet) -> None:
    version = fleet.next_version()
    full = full_checkpoint(CONFIG, version)
    with pusher_for(fleet) as pusher:
        results = pusher.push(full, version=version)
        group_id = pusher.transfer_group_id
    by_id = {r.worker_id: r for r in results.values()}
    for m in fleet.members:
        r = by_id[m.worker_id]
        fleet.assert_holds(m, version, full)
        # Each worker got exactly the bytes of the tensors its manifest owns, no more.
        assert (r.state, r.transport) == ("CONSISTENT", "transfer_group")
        assert r.bytes_received == r.bytes_loaded == manifest_bytes(m)
    assert group_id is not None


def test_a_stage_never_receives_another_stages_layers(fleet: Fleet) -> None:
    """One flat bucket holding the whole checkpoint (both stages' layers interleaved) goes to every
    worker as a layout; over point-to-point transfers each worker is sent only its own tensors."""
    version = fleet.next_version()
    full = full_checkpoint(CONFIG, version)
    items = list(full.items())
    specs, size = layout_flat(items)
    flat = torch.empty(size, dtype=torch.uint8)
    pack_into(flat, specs, [t for _, t in items])
    with pusher_for(fleet, broadcast=False) as pusher:
        results = pusher.push_flat([FlatBucket(flat, specs)], version=version)
    for m in fleet.members:
        r = results[m.address]
        fleet.assert_holds(m, version, full)
        # The bucket lists every tensor of both stages; each worker receives only its own stage's.
        assert r.bytes_received == manifest_bytes(m) < size
        assert r.buckets == 1


def test_group_is_formed_once_and_reused_with_bounded_staging(fleet: Fleet) -> None:
    members = fleet.replica(0)
    with pusher_for(fleet, members) as pusher:
        staged: list[list[tuple[int, int]]] = []
        for _ in range(3):
            version = fleet.next_version(members)
            full = full_checkpoint(CONFIG, version)
            # Small buckets: many per update, so both staging buffers are in use.
            pusher.push(full, version=version)
            statuses = [m.status().transfer_group for m in members]
            assert {s.group_id for s in statuses} == {pusher.transfer_group_id}
            assert all(s.state == pb.TRANSFER_GROUP_STATE_READY for s in statuses)
            staged.append([(s.staging_buffers, s.staging_bytes) for s in statuses])
            for m in members:
                fleet.assert_holds(m, version, full)
        assert pusher._group is not None and pusher._group.formations == 1  # type: ignore[union-attr]
    for per_worker in staged:
        assert all(1 <= n <= 2 for n, _ in per_worker)
    assert staged[0] == staged[-1]  # nothing grows across updates


def test_leaving_on_request_tears_the_group_down_everywhere(fleet: Fleet) -> None:
    members = fleet.replica(0)
    with pusher_for(fleet, members) as pusher:
        version = fleet.next_version(members)
        pusher.push(full_checkpoint(CONFIG, version), version=version)
        first = pusher.transfer_group_id
        pusher.leave_transfer_group()
        assert pusher.transfer_group_id is None
        for m in members:
            st = m.status().transfer_group
            assert (
                st.state == pb.TRANSFER_GROUP_STATE_NONE and st.last_teardown == f"{first}: left on request"
            )
        # The next push forms a new group by itself.
        full = full_checkpoint(CONFIG, version + 1)
        pusher.push(full, version=version + 1)
        assert pusher.transfer_group_id not in (None, first)
    for m in members:
        fleet.assert_holds(m, version + 1, full)


def test_small_buckets_use_both_staging_buffers_and_no_more(fleet: Fleet) -> None:
    members = fleet.replica(1)
    version = fleet.next_version(members)
    full = full_checkpoint(CONFIG, version)
    with WeightPusher(
        fleet.addresses(members),
        transfer_group=TransferGroupOptions(host=HOST),
        timeout_s=30,
        bucket_size_bytes=32 << 10,
    ) as pusher:
        pusher.push(full, version=version)
        largest = max(t.numel() * t.element_size() for t in full.values())
        for m in members:
            fleet.assert_holds(m, version, full)
            st = m.status().transfer_group
            assert st.state == pb.TRANSFER_GROUP_STATE_READY and st.max_staging_buffers == 2
            assert 1 <= st.staging_buffers <= 2 and st.staging_bytes <= 2 * max(largest, 32 << 10)


def _stage_local_spec(
    store: StoreServer, group_id: str, trainer: MemberIdentity, stage_first: list[ShardManifest]
) -> pb.TransferGroupSpec:
    plan = plan_group(
        {m.worker_id: m for m in stage_first},
        trainer=trainer,
        group_id=group_id,
        backend=pb.TRANSFER_BACKEND_GLOO,
        store_address=store.address,
        timeout_ms=10_000,
        max_bucket_bytes=1 << 20,
        broadcast=False,
    )
    # The field bug: ranks 1.. in the order this stage sees the workers (its own first).
    spec = plan.spec
    del spec.members[1:]
    for i, m in enumerate(stage_first, start=1):
        spec.members.append(MemberIdentity.of_worker(m).to_proto(i))
    return spec


def test_two_workers_claiming_one_group_rank_are_refused_before_any_byte(fleet: Fleet) -> None:
    members = fleet.replica(0)
    manifests = {
        m.worker_id: ShardManifest.from_proto(m.stub().GetManifest(pb.GetManifestRequest()).manifest)
        for m in members
    }
    stage0 = [manifests[m.worker_id] for m in members if m.rank.pp_rank == 0]
    stage1 = [manifests[m.worker_id] for m in members if m.rank.pp_rank == 1]
    before = {m.worker_id: m.status() for m in members}
    trainer = MemberIdentity.of_trainer(0, uuid.uuid4().hex)
    store = StoreServer(HOST)
    group_id = f"bug-{uuid.uuid4().hex[:8]}"
    # Each stage was told its own TP ranks are group ranks 1 and 2: stage-local, so they collide.
    spec0 = _stage_local_spec(store, group_id, trainer, stage0 + stage1)
    spec1 = _stage_local_spec(store, group_id, trainer, stage1 + stage0)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(members) + 1) as pool:
            mine = pool.submit(TransferGroup.form, spec0, trainer, listen_host=HOST, store=store.store)
            calls = {
                m.worker_id: pool.submit(
                    m.stub().JoinTransferGroup,
                    pb.JoinTransferGroupRequest(spec=spec0 if m.rank.pp_rank == 0 else spec1),
                    timeout=60,
                )
                for m in members
            }
            refusals = {}
            for wid, fut in calls.items():
                with pytest.raises(grpc.RpcError) as err:
                    fut.result()
                refusals[wid] = (err.value.code(), error_info(err.value)[0])
            assert isinstance(mine.exception(timeout=60), Exception)
    finally:
        store.close()
    assert set(refusals.values()) == {(grpc.StatusCode.FAILED_PRECONDITION, "GROUP_DUPLICATE_RANK")}, refusals
    for m in members:
        st = m.status()
        # Nothing moved: same version, no group, no byte received.
        assert st.weights_version == before[m.worker_id].weights_version
        assert (
            st.transfer_group.state == pb.TRANSFER_GROUP_STATE_NONE and st.transfer_group.bytes_received == 0
        )
        assert "GROUP_DUPLICATE_RANK" in st.transfer_group.last_teardown


def test_join_needs_the_workers_token_and_an_answering_store(worker_process) -> None:  # type: ignore[no-untyped-def]
    from helpers import demo_args

    worker = worker_process(*demo_args(listen="127.0.0.1:0", extra=["--token", "tok-1"]))
    stub = worker.stub()
    manifest = stub.GetManifest(
        pb.GetManifestRequest(), metadata=[("authorization", "Bearer tok-1")]
    ).manifest
    dead = StoreServer(HOST)
    address = dead.address
    dead.close()  # nothing listens there any more
    spec = plan_group(
        {"w": ShardManifest.from_proto(manifest)},
        trainer=MemberIdentity.of_trainer(0, uuid.uuid4().hex),
        group_id="g-dead",
        backend=pb.TRANSFER_BACKEND_GLOO,
        store_address=address,
        timeout_ms=1000,
        max_bucket_bytes=1 << 20,
    ).spec
    with pytest.raises(grpc.RpcError) as no_token:
        stub.JoinTransferGroup(pb.JoinTransferGroupRequest(spec=spec), timeout=30)
    assert (no_token.value.code(), error_info(no_token.value)[0]) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "MISSING_TOKEN",
    )
    with pytest.raises(grpc.RpcError) as unreachable:
        stub.JoinTransferGroup(
            pb.JoinTransferGroupRequest(spec=spec), timeout=60, metadata=[("authorization", "Bearer tok-1")]
        )
    assert (unreachable.value.code(), error_info(unreachable.value)[0]) == (
        grpc.StatusCode.UNAVAILABLE,
        "GROUP_STORE_UNREACHABLE",
    )
    assert address in unreachable.value.details()


def test_two_trainer_processes_push_to_disjoint_replicas_in_parallel(fleet: Fleet) -> None:
    version = fleet.next_version()
    trainers = [Trainer(fleet.addresses(fleet.replica(d)), version, "--trainer-rank", str(d)) for d in (0, 1)]
    for t in trainers:
        t.go()
    outcomes = [t.result() for t in trainers]
    full = full_checkpoint(CONFIG, version)
    for d, out in enumerate(outcomes):
        assert "failures" not in out, out
        assert set(out["results"]) == {m.worker_id for m in fleet.replica(d)}  # type: ignore[arg-type]
        for m in fleet.replica(d):
            fleet.assert_holds(m, version, full)
    assert outcomes[0]["group_id"] != outcomes[1]["group_id"]


def _settled(member: Member) -> bool:
    return member.status().state != pb.WORKER_STATE_UPDATING


def test_trainer_killed_mid_bucket(fleet: Fleet) -> None:
    members = fleet.replica(1)
    before = fleet.next_version(members) - 1
    trainer = Trainer(
        fleet.addresses(members),
        before + 1,
        "--bucket-bytes",
        str(16 << 10),
        "--die-after-acks",
        "2",
        "--timeout-s",
        "60",
    )
    trainer.go()
    assert trainer.wait() == -signal.SIGKILL
    # Every worker ends the update with a reason, well before the 60 s group timeout: the dead
    # trainer's sockets closed, so pending receives failed at once.
    assert all(wait_until(lambda m=m: _settled(m), timeout=30) for m in members)
    for m in members:
        st = m.status()
        assert st.weights_version == before
        assert st.last_error.reason in ("TRANSFER_FAILED", "CANCELLED"), st.last_error
        assert st.state in (pb.WORKER_STATE_INCONSISTENT, pb.WORKER_STATE_CONSISTENT)
        assert st.transfer_group.state == pb.TRANSFER_GROUP_STATE_NONE
    assert any(m.status().state == pb.WORKER_STATE_INCONSISTENT for m in members)
    # The next update (a new trainer process: this one) forms a new group and succeeds.
    version = before + 2
    full = full_checkpoint(CONFIG, version)
    with pusher_for(fleet, members) as pusher:
        results = pusher.push(full, version=version)
    assert {r.state for r in results.values()} == {"CONSISTENT"}
    for m in members:
        fleet.assert_holds(m, version, full)


def test_worker_killed_mid_update_is_named_and_the_group_reforms_after_its_restart(fleet: Fleet) -> None:
    members = fleet.replica(0)
    victim = next(m for m in members if m.rank.pp_rank == 1 and m.rank.tp_rank == 1)
    version = fleet.next_version(members)

    def kill_victim(p: PushProgress) -> None:
        if p.buckets_done == 1:
            victim.process.proc.send_signal(signal.SIGKILL)

    with WeightPusher(
        fleet.addresses(members),
        transfer_group=TransferGroupOptions(host=HOST),
        timeout_s=30,
        bucket_size_bytes=16 << 10,
    ) as pusher:
        pusher.push(full_checkpoint(CONFIG, version), version=version)
        first_group = pusher.transfer_group_id
        with pytest.raises(PushError) as failed:
            pusher.push(full_checkpoint(CONFIG, version + 1), version=version + 1, progress=kill_victim)
        failures = failed.value.failures
        assert failures[victim.address].reason in ("UNAVAILABLE", "TRANSFER_FAILED"), failures
        for m in members:
            if m is not victim:
                assert (
                    failures[m.address].reason == "CANCELLED"
                    and victim.worker_id in failures[m.address].message
                )
                assert wait_until(lambda m=m: _settled(m), timeout=30)
                assert m.status().weights_version == version
        fleet.restart(victim)
        # The pusher finds the restarted worker (new instance) and refuses before sending anything
        # (after UNAVAILABLE while its channel reconnects); the next push reads the manifests again
        # and forms a new group with it. Nothing else was restarted.
        full = full_checkpoint(CONFIG, version + 1)
        seen: list[str] = []
        for _ in range(50):
            try:
                results = pusher.push(full, version=version + 1)
                break
            except PushError as e:
                seen.append(e.failures[victim.address].reason)
                assert set(seen) <= {"UNAVAILABLE", "MANIFEST_CHANGED"}, e
                time.sleep(0.1)
        assert "MANIFEST_CHANGED" in seen
        assert {r.state for r in results.values()} == {"CONSISTENT"}
        assert pusher.transfer_group_id not in (None, first_group)
    for m in members:
        fleet.assert_holds(m, version + 1, full)


def test_a_multi_rank_push_without_torch_distributed_is_refused_before_anything_is_sent(fleet: Fleet) -> None:
    # A multi-rank push over a transfer group makes every trainer rank a source
    # (tests/distributed/test_push_from_every_rank.py); without an initialised process group there
    # are no ranks to agree with, which is said before any call reaches a worker.
    members = fleet.replica(0)
    before = [m.status().weights_version for m in members]
    with pusher_for(fleet, members) as pusher:
        with pytest.raises(ValueError, match=r"torch\.distributed to be initialised"):
            pusher.push(full_checkpoint(CONFIG, 99), version=99, group=object())
    assert [m.status().weights_version for m in members] == before
