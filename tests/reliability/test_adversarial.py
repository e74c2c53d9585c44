"""Hostile input: property-based streams against an in-process worker through the raw stubs.

Every hostile stream must be answered with a status carrying exactly one ErrorInfo whose reason is
the documented one (and whose code is the reason's code); the worker must not load any tensor of
the hostile part (no read outside a buffer: the adapter records every view it is handed and compares
it with the bytes the test put there), must keep its weights version, release its mappings, and go
on serving: after the run a valid FULL update is accepted and lands bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import Reason
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.shm import new_shm_name
from weightwire.server import serve
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

from . import helpers, hostile
from .common import (
    CASES_RUN,
    CHANNEL_OPTIONS,
    MAX_MESSAGE_BYTES,
    assert_weightwire_error,
    demo_adapter,
    inline_update,
    push_raw,
)

# Bounded so the whole file stays well under a minute on two cores (deadline off: the first
# examples pay for imports and thread start-up).
STRUCTURED_EXAMPLES = 300
RANDOM_EXAMPLES = 150
CHECKPOINT_SEED = 7


class RecordingAdapter:
    """Wraps the real torch adapter; records every tensor handed to ``load`` and whether its bytes
    equal what the test wrote at that place (a view outside the intended bytes would differ)."""

    def __init__(self, inner: TorchAdapter, reference: dict[str, torch.Tensor]) -> None:
        self.inner = inner
        self.reference = reference
        self.loaded: list[str] = []
        self.wrong_bytes: list[str] = []

    def manifest(self) -> ShardManifest:
        return self.inner.manifest()

    def begin_update(self, version: int) -> None:
        self.inner.begin_update(version)

    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, t in named_tensors:
            self.loaded.append(name)
            ref = self.reference.get(name)
            if (
                ref is None
                or t.dtype != ref.dtype
                or tuple(t.shape) != tuple(ref.shape)
                or not torch.equal(t, ref)
            ):
                self.wrong_bytes.append(name)
        self.inner.load(named_tensors)

    def end_update(self, success: bool) -> None:
        self.inner.end_update(success)


class Harness:
    def __init__(self) -> None:
        self.config = DemoConfig()
        self.checkpoint = full_checkpoint(self.config, seed=CHECKPOINT_SEED)
        self.adapter = RecordingAdapter(demo_adapter(seed=0), self.checkpoint)
        self.server = serve(self.adapter, own_device=DeviceRef.host())  # default: private Unix socket
        self.channel = grpc.insecure_channel(self.server.address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.WeightTransferServiceStub(self.channel)
        manifest = self.adapter.manifest()
        probe = hostile.Target.build(manifest, self.checkpoint, shm_name="ww-unused")
        self.segments = helpers.ShmSegments()
        segment = self.segments.create(probe.blob, name=new_shm_name("adv"))
        self.target = hostile.Target.build(manifest, self.checkpoint, shm_name=segment.name)

    def status(self) -> pb.GetStatusResponse:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=30)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace=None)
        self.segments.close()

    def finish_with_valid_update(self, version: int) -> None:
        """The worker still serves: a full valid update lands bit for bit."""
        before = len(self.adapter.loaded)
        owned = self.adapter.manifest().tensors
        outcome = push_raw(self.stub, inline_update({n: self.checkpoint[n] for n in owned}, version))
        assert outcome.code == grpc.StatusCode.OK, outcome.describe()
        assert outcome.result is not None and outcome.result.version == version
        status = self.status()
        assert status.weights_version == version
        assert status.state == pb.WORKER_STATE_CONSISTENT
        assert status.open_mappings == 0
        assert sorted(self.adapter.loaded[before:]) == sorted(owned)
        assert not self.adapter.wrong_bytes
        state = self.adapter.inner.state()
        for name in owned:
            assert torch.equal(state[name], self.checkpoint[name]), name


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    try:
        yield h
    finally:
        h.close()


@pytest.mark.parametrize("rpc", ["stream", "whole"])
def test_hostile_streams_get_the_documented_reason(harness: Harness, rpc: str) -> None:
    """On PushWeights streams, and as the same messages in one PushUpdate call (whose failure
    carries no acks: the worker answers only once the whole update is through)."""
    seen = {"state": pb.WORKER_STATE_CONSISTENT}
    whole = rpc == "whole"

    @settings(
        max_examples=STRUCTURED_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(case=hostile.hostile_cases(harness.target))
    def run(case: hostile.Case) -> None:
        CASES_RUN["structured:" + case.label] += 1
        loaded_before = len(harness.adapter.loaded)
        outcome = push_raw(harness.stub, case.requests, whole=whole)
        assert outcome.code != grpc.StatusCode.OK, f"accepted: {case!r}"
        assert_weightwire_error(outcome, case.reasons)
        assert len(outcome.acks) == (0 if whole else case.acks), outcome.describe()
        assert outcome.result is None
        # nothing of the hostile part was read; what loaded is exactly the valid prefix, bit for bit
        assert harness.adapter.loaded[loaded_before:] == list(case.loaded), case.label
        assert not harness.adapter.wrong_bytes, harness.adapter.wrong_bytes
        status = harness.status()
        assert status.weights_version == 0
        assert status.open_mappings == 0
        # a failure after loading leaves the worker INCONSISTENT; a failure before keeps its state
        expected = pb.WORKER_STATE_INCONSISTENT if case.loaded else seen["state"]
        assert status.state == expected, (pb.WorkerState.Name(status.state), case.label)
        seen["state"] = status.state
        assert status.last_error.reason == outcome.reason

    run()
    harness.finish_with_valid_update(hostile.VERSION + 1)


@pytest.mark.parametrize("rpc", ["stream", "whole"])
def test_random_streams_never_crash_the_worker(harness: Harness, rpc: str) -> None:
    current = {"version": 0}
    whole = rpc == "whole"

    @settings(
        max_examples=RANDOM_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(requests=hostile.random_streams(harness.target))
    def run(requests: list[pb.PushWeightsRequest]) -> None:
        CASES_RUN["random"] += 1
        outcome = push_raw(harness.stub, requests, whole=whole)
        if outcome.result is not None:
            # an accidental valid update (e.g. an empty PARTIAL one) must be a proper one
            assert outcome.result.previous_version == current["version"]
            assert outcome.result.version > current["version"]
            current["version"] = outcome.result.version
        if outcome.code != grpc.StatusCode.OK:
            assert outcome.info is not None, outcome.describe()
            assert_weightwire_error(outcome, Reason.__members__)
        else:
            assert outcome.result is not None, (
                f"a stream ended OK without an UpdateResult: {outcome.describe()}"
            )
        status = harness.status()
        assert status.weights_version == current["version"]
        assert status.open_mappings == 0
        assert not harness.adapter.wrong_bytes, harness.adapter.wrong_bytes

    run()
    harness.finish_with_valid_update(current["version"] + 1)


@pytest.mark.parametrize("rpc", ["stream", "whole"])
def test_message_over_64_mib_is_refused_and_the_worker_goes_on(harness: Harness, rpc: str) -> None:
    """A single message over the 64 MiB limit (a stream's bucket, or a whole PushUpdate request) is
    cut off by gRPC itself (RESOURCE_EXHAUSTED, no ErrorInfo: our code never sees it); the worker
    keeps its version and serves the next update."""
    CASES_RUN["oversized"] += 1
    name = "model.norm.weight"
    blob = b"\0" * (MAX_MESSAGE_BYTES + 4096)
    requests = [
        pb.PushWeightsRequest(header=pb.UpdateHeader(version=3, scope=pb.UPDATE_SCOPE_PARTIAL)),
        pb.PushWeightsRequest(
            bucket=pb.Bucket(
                index=0,
                tensors=[
                    pb.TensorSpec(name=name, dtype=pb.DTYPE_FLOAT32, shape=[harness.config.hidden_size])
                ],
                payloads=[
                    pb.Payload(device=DeviceRef.host().to_proto(), size_bytes=len(blob), inline_data=blob)
                ],
            )
        ),
        pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=1)),
    ]
    outcome = push_raw(harness.stub, requests, whole=rpc == "whole")
    assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome.describe()
    assert outcome.result is None and not outcome.acks
    status = harness.status()
    assert status.weights_version == 0
    assert status.open_mappings == 0
    assert name not in harness.adapter.loaded
    harness.finish_with_valid_update(1)


@pytest.mark.parametrize("name", hostile.SHM_NAME_TRICKS, ids=repr)
def test_shm_names_with_path_tricks_are_refused_before_opening(harness: Harness, name: str) -> None:
    """Each listed trick by itself (the property test draws from these and from generated text)."""
    CASES_RUN["shm-name-trick"] += 1
    t = harness.target.tensors[0]
    b = harness.target.bucket(0, [t], "shm")
    b.payloads[0].host_shm.name = name
    outcome = push_raw(
        harness.stub, [hostile.header(1, pb.UPDATE_SCOPE_PARTIAL), hostile.bucket_msg(b), hostile.commit(1)]
    )
    assert_weightwire_error(outcome, "INVALID_SHM_NAME")
    assert outcome.info is not None and outcome.info.metadata.get("name") == name
    assert harness.status().weights_version == 0
    assert not harness.adapter.loaded
