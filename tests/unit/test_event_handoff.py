"""The producer-event hand-off of CUDA IPC, on CPU: the manifest says whether a worker waits for a
payload's event, and a pushing thread lets staging buffers skip their host wait only inside a push
to workers that all do (``exporters.consumers_wait_for_events``).

The hand-off itself between real processes is in tests/gpu (``test_kept_mapping_waits_for_the_producer_event``
and the colocated pushes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from pathlib import Path

import grpc
import pytest
import torch
from weightwire.adapters.torch import TorchAdapter
from weightwire.client.push.pusher import WeightPusher
from weightwire.client.transports import exporter as exporters
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest
from weightwire.server.rpc.servicer import WeightTransferServicer
from weightwire.server.transports.importer import PayloadImporter, make_importers
from weightwire.server.worker.service import WorkerService
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc


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
    assert (
        ShardManifest.from_proto(
            pb.ShardManifest.FromString(old.SerializeToString())
        ).waits_for_cuda_ipc_events
        is False
    )
    assert (
        waits.fingerprint
        == plain.fingerprint
        == dataclasses.replace(plain, waits_for_cuda_ipc_events=True).fingerprint
    )


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


# --- the worker says it, the pusher acts on it (real gRPC servers in this process) ---------------


class _Worker:
    """A real worker service over a real gRPC server on a Unix socket, with the importers given."""

    def __init__(self, path: str, importers: dict[str, PayloadImporter] | None) -> None:
        module = torch.nn.Module()
        module.register_parameter("w", torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False))
        self.adapter = TorchAdapter(
            module, rank=ParallelRank(), device=torch.device("cpu"), own_device=DeviceRef.host()
        )
        self.service = WorkerService(self.adapter, own_device=DeviceRef.host(), importers=importers)
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        pb_grpc.add_WeightTransferServiceServicer_to_server(WeightTransferServicer(self.service), self.server)
        self.address = f"unix:{path}"
        self.server.add_insecure_port(self.address)
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)
        self.service.close()


def _push_and_see_readiness(
    tmp_path: Path, importer_sets: list[dict[str, PayloadImporter] | None]
) -> tuple[list[bool], list[bool]]:
    """Push once to workers with these importers; returns their manifests' flags and, for every
    staging buffer made ready during the push, whether its thread was told its consumers wait."""
    workers = [_Worker(str(tmp_path / f"w{i}.sock"), imps) for i, imps in enumerate(importer_sets)]
    seen: list[bool] = []
    original = exporters.StagingBuffer.ready
    monkey = pytest.MonkeyPatch()
    try:
        monkey.setattr(
            exporters.StagingBuffer,
            "ready",
            lambda self: (seen.append(exporters.consumers_wait()), original(self))[1],
        )
        with WeightPusher([w.address for w in workers], transport="host_shm") as pusher:
            flags = [m.waits_for_cuda_ipc_events for m in pusher.manifests().values()]
            full = torch.arange(16.0).view(4, 4)
            results = pusher.push([("w", full)], version=1)
            assert all(r.version == 1 for r in results.values())
            assert all(torch.equal(w.adapter.state()["w"], full) for w in workers)
        assert exporters.consumers_wait() is False
    finally:
        monkey.undo()
        for w in workers:
            w.close()
    return flags, seen


def test_a_worker_with_the_cuda_importer_says_it_waits_and_the_push_skips_its_own_wait(
    tmp_path: Path,
) -> None:
    flags, seen = _push_and_see_readiness(tmp_path, [None])
    assert flags == [True] and seen and all(seen)


def test_one_worker_that_does_not_wait_keeps_every_buffer_waiting(tmp_path: Path) -> None:
    without_cuda = {k: v for k, v in make_importers().items() if k != "cuda_ipc"}
    flags, seen = _push_and_see_readiness(tmp_path, [None, without_cuda])
    assert sorted(flags) == [False, True] and seen and not any(seen)
