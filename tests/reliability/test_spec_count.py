"""A bucket with more tensor specs than an update may hold is refused on its count, before any work
per spec: a bucket of 2^20+1 specs used to cost seconds of CPU (every spec checked, the bucket keyed
for the layout cache) before the count was looked at.

The order shows it: the first spec is itself invalid (unspecified dtype), so a worker that looks at
specs before the count refuses with DTYPE_UNSPECIFIED; the count's refusal is MALFORMED_STREAM and
names the limit. A real in-process gRPC worker, both RPCs; the message is built from serialized
bytes (one spec repeated), which protobuf parses in well under a second.
"""

from __future__ import annotations

import grpc
import pytest
from helpers import header, push
from weightwire.server.worker.accepted import MAX_TENSORS_PER_UPDATE
from weightwire.v1 import weight_transfer_pb2 as pb

from .common import CHANNEL_OPTIONS


def _huge_bucket(count: int) -> pb.PushWeightsRequest:
    spec = pb.TensorSpec(name="t", shape=[1], offset_bytes=0).SerializeToString()  # dtype left unspecified
    field = pb.Bucket.DESCRIPTOR.fields_by_name["tensors"].number
    tag = bytes([(field << 3) | 2, len(spec)])
    req = pb.PushWeightsRequest()
    req.bucket.MergeFromString(
        (tag + spec) * count
    )  # parsed in place (a copy of a million specs costs seconds)
    return req


@pytest.mark.parametrize("rpc", ["PushWeights", "PushUpdate"])
def test_too_many_specs_in_a_bucket_are_refused_on_their_count(inproc_worker, rpc: str) -> None:
    worker = inproc_worker()
    stub = type(worker.stub())(grpc.insecure_channel(worker.address, options=CHANNEL_OPTIONS))
    huge = _huge_bucket(MAX_TENSORS_PER_UPDATE + 1)
    assert len(huge.bucket.tensors) == MAX_TENSORS_PER_UPDATE + 1
    out = push(
        stub,
        [header(1), huge, pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=1))],
        whole=rpc == "PushUpdate",
    )
    assert (out.code, out.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_STREAM"), (
        out.code,
        out.reason,
        out.message,
    )
    assert str(MAX_TENSORS_PER_UPDATE) in out.message and out.metadata.get("bucket") == "0"
    st = stub.GetStatus(pb.GetStatusRequest())
    assert (st.weights_version, st.state, st.open_mappings) == (0, pb.WORKER_STATE_CONSISTENT, 0)
