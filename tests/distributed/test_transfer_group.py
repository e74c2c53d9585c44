"""Forming transfer groups between real processes over gloo on loopback TCP: bytes move only after
every member checked the group; duplicate ranks, wrong world sizes, unknown members, a missing
member and an unanswering store are refused with their reasons; a peer that dies or leaves makes
pending receives fail at once; nothing listens outside the address it was given; the default
process group is never touched.

The test process is the trainer (group rank 0, serving the store); three ``group_agent.py``
processes, started once for the module, are the workers.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import socket
import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from group_agent import listening_addresses, pattern
from group_agents import Agent, spec_of
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import ParallelRank
from weightwire.core.transports.transfer_group import TransferGroup
from weightwire.core.transports.transfer_group_plan import MemberIdentity, message_tag
from weightwire.core.transports.transfer_group_store import StoreServer
from weightwire.v1 import weight_transfer_pb2 as pb

HOST = "127.0.0.1"


def _rank(tp: int, pp: int, dp: int = 0) -> ParallelRank:
    return ParallelRank(tp_rank=tp, tp_size=2, pp_rank=pp, pp_size=2, dp_rank=dp, dp_size=1)


@pytest.fixture(scope="module")
def agents() -> Iterator[list[Agent]]:
    started = [Agent("tp0-pp0", _rank(0, 0)), Agent("tp1-pp0", _rank(1, 0)), Agent("tp0-pp1", _rank(0, 1))]
    yield started
    for a in started:
        a.stop()


@pytest.fixture(scope="module")
def store() -> Iterator[StoreServer]:
    server = StoreServer(HOST, 0)
    yield server
    server.close()


def trainer() -> MemberIdentity:
    return MemberIdentity.of_trainer(0, uuid.uuid4().hex)


def new_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def form_trainer(
    spec: pb.TransferGroupSpec, me: MemberIdentity, store: StoreServer
) -> concurrent.futures.Future[TransferGroup]:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    fut = pool.submit(TransferGroup.form, spec, me, listen_host=HOST, store=store.store)
    pool.shutdown(wait=False)
    return fut


def refusal(fut: concurrent.futures.Future[TransferGroup]) -> WeightwireError:
    err = fut.exception(timeout=60)
    assert isinstance(err, WeightwireError), f"expected a refusal, got {err!r}"
    return err


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def test_group_moves_point_to_point_and_broadcast_bytes(agents: list[Agent], store: StoreServer) -> None:
    me = trainer()
    members = [me, *(a.identity for a in agents)]
    # Ranks 1 and 2 (stage 0's two tensor ranks) share a broadcast; rank 3 gets its bytes alone.
    spec = spec_of(new_id(), store.address, members, subgroups=[[0, 1, 2]])
    fut = form_trainer(spec, me, store)
    for a in agents:
        a.form(spec)
    group = fut.result(timeout=60)
    try:
        assert [a.answer()["rank"] for a in agents] == [1, 2, 3]
        assert group.rank == 0 and group.world_size == 4

        p2p = pattern(300_000, seed=1)
        agents[2].send("recv", src=0, sequence=1, nbytes=p2p.numel())
        group.wait(group.send(p2p, 3, message_tag(1, 0)), "send to rank 3")
        assert agents[2].answer()["sha"] == sha(p2p)

        shared = pattern(200_000, seed=2)
        for a in agents[:2]:
            a.send("broadcast", subgroup=0, nbytes=shared.numel())
        group.wait(group.broadcast(shared, 0), "broadcast to subgroup 0")
        assert [a.answer()["sha"] for a in agents[:2]] == [sha(shared)] * 2

        # Workers also send to each other and to the trainer (every pair is connected).
        agents[0].send("send", dst=0, sequence=2, nbytes=1000, seed=3)
        back = torch.zeros(1000, dtype=torch.uint8)
        group.wait(group.recv(back, 1, message_tag(2, 0)), "recv from rank 1")
        assert agents[0].answer()["ok"] and torch.equal(back, pattern(1000, seed=3))

        for a in agents:
            assert a.call("default_group")["initialized"] is False
            # gloo's sockets listen only on the address the member was given.
            assert all(addr.startswith(f"{HOST}:") for addr in a.call("listening")["addresses"])
        assert not torch.distributed.is_initialized()
    finally:
        group.close()
        for a in agents:
            a.call("close")


def test_store_listens_only_on_its_host(store: StoreServer) -> None:
    mine = listening_addresses()
    assert f"{HOST}:{store.port}" in mine
    assert not any(a.endswith(f":{store.port}") and not a.startswith(f"{HOST}:") for a in mine)


def test_stage_local_ranks_are_refused_before_any_byte(agents: list[Agent], store: StoreServer) -> None:
    """The field bug: each stage's workers told ``rank_offset + tp_rank``, so stage 1's tensor rank 0
    claims the same group rank as stage 0's. Everyone refuses during the rendezvous."""
    me = trainer()
    stage0, stage1 = agents[:2], agents[2:]
    phantom = MemberIdentity(pb.TRANSFER_ROLE_WORKER, uuid.uuid4().hex, "tp1-pp1", _rank(1, 1))
    group_id = new_id()
    # What stage 0 was told: stage 0 first. What stage 1 was told: stage 1 first (stage-local).
    spec0 = spec_of(group_id, store.address, [me, *(a.identity for a in stage0), stage1[0].identity, phantom])
    spec1 = spec_of(group_id, store.address, [me, stage1[0].identity, phantom, *(a.identity for a in stage0)])
    fut = form_trainer(spec0, me, store)
    for a in stage0:
        a.form(spec0)
    stage1[0].form(spec1)
    answers = [a.answer() for a in agents]
    assert [a["reason"] for a in answers] == ["GROUP_DUPLICATE_RANK"] * 3, answers
    assert any("group rank 1 is claimed by" in a["message"] for a in answers)
    assert refusal(fut).reason == "GROUP_DUPLICATE_RANK"


def test_wrong_world_size_is_refused(agents: list[Agent], store: StoreServer) -> None:
    me = trainer()
    members = [me, *(a.identity for a in agents)]
    group_id = new_id()
    spec = spec_of(group_id, store.address, members)
    phantom = MemberIdentity(pb.TRANSFER_ROLE_WORKER, uuid.uuid4().hex, "tp1-pp1", _rank(1, 1))
    bigger = spec_of(group_id, store.address, [*members, phantom])
    fut = form_trainer(spec, me, store)
    agents[0].form(spec)
    agents[1].form(spec)
    agents[2].form(bigger)
    answers = [a.answer() for a in agents]
    assert [a["reason"] for a in answers] == ["GROUP_WRONG_WORLD_SIZE"] * 3, answers
    err = refusal(fut)
    assert err.reason == "GROUP_WRONG_WORLD_SIZE" and "world size 5" in err.message


def test_unknown_member_is_refused(agents: list[Agent], store: StoreServer) -> None:
    """A process of another plan takes the rank the plan gives to a worker that did not come."""
    me = trainer()
    absent = MemberIdentity(
        pb.TRANSFER_ROLE_WORKER,
        uuid.uuid4().hex,
        "tp1-pp0-dp1",
        ParallelRank(tp_rank=1, tp_size=2, dp_rank=1, dp_size=2),
    )
    group_id = new_id()
    spec = spec_of(group_id, store.address, [me, agents[0].identity, absent])
    intruder = spec_of(group_id, store.address, [me, agents[0].identity, agents[1].identity])
    fut = form_trainer(spec, me, store)
    agents[0].form(spec)
    agents[1].form(intruder)
    mine, theirs = agents[0].answer(), agents[1].answer()
    assert mine["reason"] == "GROUP_UNKNOWN_MEMBER" and "group rank 2 is held by tp1-pp0" in mine["message"]
    assert theirs["ok"] is False and theirs["reason"] in ("GROUP_UNKNOWN_MEMBER", "GROUP_PLAN_MISMATCH")
    assert refusal(fut).reason == "GROUP_UNKNOWN_MEMBER"


def test_missing_member_times_out_with_its_rank(agents: list[Agent], store: StoreServer) -> None:
    me = trainer()
    spec = spec_of(new_id(), store.address, [me, agents[0].identity, agents[1].identity], timeout_ms=1500)
    fut = form_trainer(spec, me, store)
    agents[0].form(spec)
    answer = agents[0].answer()
    assert answer["reason"] == "GROUP_TIMEOUT" and "group rank 2 (tp1-pp0" in answer["message"], answer
    err = refusal(fut)
    assert err.reason == "GROUP_TIMEOUT" and err.metadata["missing_ranks"] == "2"


def test_unanswering_store_gives_a_reason(agents: list[Agent]) -> None:
    sock = socket.socket()
    sock.bind((HOST, 0))
    dead = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    spec = spec_of(new_id(), f"{HOST}:{dead}", [trainer(), agents[0].identity], timeout_ms=1000)
    agents[0].form(spec)
    answer = agents[0].answer(timeout=60)
    assert answer["reason"] == "GROUP_STORE_UNREACHABLE" and f"{HOST}:{dead}" in answer["message"], answer


def test_not_in_plan_is_refused_locally(agents: list[Agent], store: StoreServer) -> None:
    spec = spec_of(new_id(), store.address, [trainer(), agents[1].identity])
    agents[0].form(spec)
    answer = agents[0].answer()
    assert answer["reason"] == "GROUP_UNKNOWN_MEMBER" and "is not in the plan" in answer["message"]


def test_leaving_fails_a_pending_receive_at_once(agents: list[Agent], store: StoreServer) -> None:
    me = trainer()
    spec = spec_of(new_id(), store.address, [me, agents[0].identity], timeout_ms=60_000)
    fut = form_trainer(spec, me, store)
    agents[0].form(spec)
    group = fut.result(timeout=60)
    assert agents[0].answer()["ok"]
    agents[0].send("recv", src=0, sequence=7, nbytes=1000)
    group.close()  # the trainer goes away mid-bucket: the worker must not wait out its 60 s timeout
    answer = agents[0].answer(timeout=30)
    # "Connection closed by peer" or "Connection reset by peer", depending on timing.
    assert answer["reason"] == "TRANSFER_FAILED" and "by peer" in answer["message"], answer
    agents[0].call("close")


def test_receive_fails_when_the_sender_process_dies(store: StoreServer) -> None:
    """A worker waiting for a peer that is killed mid-bucket fails at once with TRANSFER_FAILED."""
    sender = Agent("tp0-pp0", _rank(0, 0))
    receiver = Agent("tp1-pp0", _rank(1, 0))
    me = trainer()
    try:
        spec = spec_of(new_id(), store.address, [me, sender.identity, receiver.identity], timeout_ms=60_000)
        fut = form_trainer(spec, me, store)
        sender.form(spec)
        receiver.form(spec)
        group = fut.result(timeout=60)
        assert sender.answer()["ok"] and receiver.answer()["ok"]
        receiver.send("recv", src=1, sequence=1, nbytes=1 << 20)
        sender.kill()
        answer = receiver.answer(timeout=30)
        assert answer["reason"] == "TRANSFER_FAILED", answer
        group.close()
    finally:
        sender.stop()
        receiver.stop()


def test_a_receive_posted_after_the_sender_died_fails_with_transfer_failed(store: StoreServer) -> None:
    """The other order of the test above: the sender is gone before the receive is posted, and the
    backend may refuse the post itself; that is TRANSFER_FAILED too, not a crash of the member."""
    sender = Agent("tp0-pp0", _rank(0, 0))
    receiver = Agent("tp1-pp0", _rank(1, 0))
    me = trainer()
    try:
        spec = spec_of(new_id(), store.address, [me, sender.identity, receiver.identity], timeout_ms=60_000)
        fut = form_trainer(spec, me, store)
        sender.form(spec)
        receiver.form(spec)
        group = fut.result(timeout=60)
        assert sender.answer()["ok"] and receiver.answer()["ok"]
        sender.kill()
        time.sleep(1.0)  # the receiver's connection to it has closed by now
        answer = receiver.call("recv", timeout=30, src=1, sequence=1, nbytes=1 << 20)
        assert answer["reason"] == "TRANSFER_FAILED", answer
        group.close()
    finally:
        sender.stop()
        receiver.stop()


def test_nccl_needs_a_gpu(agents: list[Agent], store: StoreServer) -> None:
    if torch.cuda.is_available():
        pytest.skip("this process has a GPU; the NCCL run is in tests/gpu")
    spec = spec_of(new_id(), store.address, [trainer(), agents[0].identity], backend=pb.TRANSFER_BACKEND_NCCL)
    agents[0].form(spec)
    answer = agents[0].answer()
    assert answer["reason"] == "TRANSPORT_UNAVAILABLE" and "NCCL" in answer["message"]


def test_a_member_whose_address_does_not_answer_gives_a_reason(
    agents: list[Agent], store: StoreServer
) -> None:
    """A worker told to listen on an address that is not this machine's (192.0.2.1, TEST-NET-1)
    cannot open its group sockets: it refuses, and so does everyone waiting for it."""
    me = trainer()
    spec = spec_of(new_id(), store.address, [me, agents[0].identity, agents[1].identity], timeout_ms=5000)
    fut = form_trainer(spec, me, store)
    agents[0].form(spec, listen_host="192.0.2.1")
    agents[1].form(spec)
    bad, good = agents[0].answer(), agents[1].answer()
    assert bad["ok"] is False and bad["reason"] in ("TRANSFER_FAILED", "GROUP_TIMEOUT"), bad
    assert good["ok"] is False and good["reason"] in ("TRANSFER_FAILED", "GROUP_TIMEOUT"), good
    assert refusal(fut).reason in ("TRANSFER_FAILED", "GROUP_TIMEOUT")
