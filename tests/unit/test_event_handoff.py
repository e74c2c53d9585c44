"""The producer-event hand-off of CUDA IPC, on CPU: the manifest says whether a worker waits for a
payload's event, and a pushing thread lets staging buffers skip their host wait only inside a push
to workers that all do (``exporters.consumers_wait_for_events``).

The hand-off itself between real processes is in tests/gpu (``test_kept_mapping_waits_for_the_producer_event``
and the colocated pushes).
"""

from __future__ import annotations

import dataclasses
import threading

from weightwire.client import exporters
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb


def manifest(waits: bool) -> ShardManifest:
    return ShardManifest.build(
        DeviceRef.cuda("GPU-12345678-0000-0000-0000-000000000000"),
        ParallelRank(),
        [OwnedTensor("w", pb.DTYPE_BFLOAT16, (4, 4))],
        instance_id="i",
        waits_for_cuda_ipc_events=waits,
    )


def test_manifest_carries_the_wait_and_keeps_its_fingerprint() -> None:
    waits, plain = manifest(True), manifest(False)
    assert ShardManifest.from_proto(waits.to_proto()).waits_for_cuda_ipc_events is True
    assert ShardManifest.from_proto(plain.to_proto()).waits_for_cuda_ipc_events is False
    # A manifest from a worker that predates the field reads as "does not wait".
    old = plain.to_proto()
    old.ClearField("waits_for_cuda_ipc_events")
    assert ShardManifest.from_proto(pb.ShardManifest.FromString(old.SerializeToString())).waits_for_cuda_ipc_events is False
    assert waits.fingerprint == plain.fingerprint == dataclasses.replace(plain, waits_for_cuda_ipc_events=True).fingerprint


def test_consumers_wait_only_inside_the_block_on_its_thread() -> None:
    assert exporters.consumers_wait() is False
    seen: list[bool] = []
    with exporters.consumers_wait_for_events(True):
        assert exporters.consumers_wait() is True
        other = threading.Thread(target=lambda: seen.append(exporters.consumers_wait()))
        other.start()
        other.join()
        with exporters.consumers_wait_for_events(False):
            assert exporters.consumers_wait() is False
        assert exporters.consumers_wait() is True
    assert exporters.consumers_wait() is False
    assert seen == [False]  # another thread (say one calling export_payload) never skips its wait
    try:
        with exporters.consumers_wait_for_events(True):
            raise RuntimeError("the push failed")
    except RuntimeError:
        pass
    assert exporters.consumers_wait() is False
