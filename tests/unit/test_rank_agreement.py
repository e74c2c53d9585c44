"""The pure parts of a multi-rank push's agreement (``weightwire.client.ranks.rank_agreement``): which part
of an update differs between ranks and how it is said, which rank sends to which worker, what a
rank's failure looks like to the others, and the round trip of results through JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from weightwire.client import PushResult
from weightwire.client.inputs.plan import PlanError, TensorSpec
from weightwire.client.ranks.rank_agreement import (
    UpdateDigest,
    disagreement,
    error_record,
    failure_of,
    failure_record,
    label_of,
    label_text,
    peer_failed,
    rank_for_device,
    result_of,
    result_record,
    unplaced_workers,
)
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import PushError, Reason, WeightwireError
from weightwire.core.manifest import ParallelRank, ShardManifest

SPECS = [TensorSpec("a.weight", torch.float32, (4, 2)), TensorSpec("b.weight", torch.bfloat16, (3,))]


def digest(**changes: object) -> dict:
    kw: dict = dict(
        version=5,
        scope="1",
        routing="own_device",
        sender_rank=0,
        specs=SPECS,
        layouts=["(2,):Shard(dim=0)", "local"],
        endpoints=["unix:/a", "unix:/b"],
        fingerprints={"unix:/a": "f1", "unix:/b": "f2"},
        settings={"bucket": 1024},
    )
    kw.update(changes)
    return json.loads(json.dumps(UpdateDigest.of(**kw).to_json()))


def test_the_same_update_on_every_rank_agrees() -> None:
    assert disagreement([digest(), digest(), digest()]) is None
    # Endpoint order does not matter; the set does.
    assert disagreement([digest(), digest(endpoints=["unix:/b", "unix:/a"])]) is None


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"version": 6}, "the version: rank 0 = 5, rank 1 = 6"),
        ({"routing": "gathered"}, "the routing: rank 0 = own_device, rank 1 = gathered"),
        (
            {"specs": [SPECS[0], TensorSpec("b.weight", torch.float32, (3,))]},
            "the tensors' names, dtypes or full shapes",
        ),
        ({"layouts": ["local", "local"]}, "how the tensors are sharded"),
        ({"fingerprints": {"unix:/a": "f1", "unix:/b": "f3"}}, "the workers' manifests"),
        ({"settings": {"bucket": 2048}}, "the pusher settings"),
    ],
)
def test_each_differing_part_is_named_with_every_ranks_value(change: dict, words: str) -> None:
    message = disagreement([digest(), digest(**change)])
    assert message is not None and words in message and "nothing was sent" in message


def test_another_order_of_the_same_tensors_is_only_an_order_difference() -> None:
    message = disagreement(
        [digest(), digest(specs=list(reversed(SPECS)), layouts=["local", "(2,):Shard(dim=0)"])]
    )
    assert message is not None and "the order of the tensors" in message and "names, dtypes" not in message
    # With other tensors as well, the order is not reported on top.
    message = disagreement([digest(), digest(specs=[SPECS[1]], layouts=["local"])])
    assert (
        message is not None
        and "the order" not in message
        and "the number of tensors: rank 0 = 2, rank 1 = 1" in message
    )


def test_rank_for_device_prefers_the_named_rank_then_the_lowest() -> None:
    gpu0, gpu1, gpu2 = DeviceRef.cuda("0" * 8), DeviceRef.cuda("1" * 8), DeviceRef.cuda("2" * 8)
    labels = [gpu0, gpu1, gpu1]
    assert rank_for_device(gpu1, labels) == 1
    assert rank_for_device(gpu1, labels, prefer=2) == 2
    assert rank_for_device(gpu1, labels, prefer=0) == 1
    assert rank_for_device(gpu2, labels) is None
    assert rank_for_device(gpu2, [None, gpu0]) == 0  # a rank sending inline bytes fits any worker


def test_unplaced_workers_names_each_worker_and_every_rank() -> None:
    gpu = [DeviceRef.host(f"stand-in-gpu-{i}") for i in range(3)]
    manifests = {
        f"unix:/w{i}": ShardManifest(worker_id=f"w{i}", device=gpu[i], rank=ParallelRank(), tensors={})
        for i in range(3)
    }
    assert unplaced_workers(manifests, gpu, "own_device") is None
    message = unplaced_workers(manifests, gpu[:1], "gathered")
    assert message is not None
    assert "w1 (unix:/w1) is on host:stand-in-gpu-1" in message and "w2 (unix:/w2)" in message
    assert "rank 0 on host:stand-in-gpu-0" in message and "routing='gathered'" in message


def test_a_ranks_failure_as_the_others_see_it() -> None:
    own = PlanError(Reason.UNKNOWN_TENSOR, "x.weight is owned by no worker")
    rec = error_record(own)
    assert rec == {
        "reason": "UNKNOWN_TENSOR",
        "code": "INVALID_ARGUMENT",
        "message": "x.weight is owned by no worker",
    }
    before = peer_failed(1, rec, before_sending=True)
    assert (
        isinstance(before, PlanError)
        and before.kind is Reason.TRAINER_RANK_FAILED
        and before.code == "ABORTED"
    )
    assert (
        "trainer rank 1 failed: UNKNOWN_TENSOR: x.weight" in before.message
        and "nothing was sent" in before.message
    )
    pushed = PushError({"unix:/a": WeightwireError(Reason.MANIFEST_CHANGED, "restarted", worker="unix:/a")})
    assert error_record(pushed)["reason"] == "MANIFEST_CHANGED" and error_record(pushed)[
        "message"
    ].startswith("unix:/a: ")
    assert error_record(RuntimeError("boom"))["reason"] == "INTERNAL"


def test_results_and_failures_survive_the_exchange() -> None:
    r = PushResult(
        "unix:/a", "tp0-pp0", 5, 4, 39, 1024, 3, 1, 0.01, 0.005, "host_shm", "CONSISTENT", 0, ("host:abc",)
    )
    assert result_of(json.loads(json.dumps(result_record(r)))) == r
    err = WeightwireError(Reason.STALE_VERSION, "version 5 is not above 7", worker="unix:/a", current="7")
    back = failure_of(json.loads(json.dumps(failure_record(err))))
    assert (back.kind, back.code, back.message, back.worker, back.metadata) == (
        Reason.STALE_VERSION,
        "FAILED_PRECONDITION",
        err.message,
        "unix:/a",
        {"current": "7"},
    )
    assert dataclasses.asdict(r)["source_devices"] == ("host:abc",)


def test_labels_round_trip() -> None:
    for label in (DeviceRef.cuda("GPU-1A2B"), DeviceRef.host("boot-id"), None):
        assert label_of(label_text(label)) == label


def test_a_lost_rank_is_a_push_error_with_its_reason() -> None:
    """docs/distributed.md promises a ``PushError`` for every failed push, a lost rank included: a
    caller's ``except PushError`` must catch it and still read its reason."""
    from weightwire.client.inputs.dtensor_gather import RankLostError

    try:
        raise RankLostError("trainer rank 1: the ranks' exchange failed", rank="1")
    except PushError as e:
        assert isinstance(e, WeightwireError)
        assert (e.reason, e.code, e.metadata, e.failures, e.results) == (
            "TRAINER_RANK_LOST",
            "UNAVAILABLE",
            {"rank": "1"},
            {},
            {},
        )
        assert str(e) == "UNAVAILABLE/TRAINER_RANK_LOST: trainer rank 1: the ranks' exchange failed"
