"""Which pushes send a trainer's tensors where they live and which pack them, and how large packed
GPU buckets are by default. Pure planning: the exporter is a stand-in (named so) that says it can
export whatever it is given, as the CUDA IPC exporter does for dense tensors on its GPU."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from weightwire.client.inputs import plan
from weightwire.client.transports.exporter import Exporter, InlineExporter, StagingBuffer
from weightwire.client.update import jobs
from weightwire.client.update.options import PushOptions
from weightwire.client.update.staging import Staging
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest
from weightwire.core.transports import table as transports
from weightwire.v1 import weight_transfer_pb2 as pb

GPU = DeviceRef.cuda("GPU-12345678-0000-0000-0000-000000000000")


class StandInCudaExporter(Exporter):
    """Stand-in for ``CudaIpcExporter`` (no GPU here): the CUDA IPC row, and every tensor exportable."""

    TRANSPORT = transports.CUDA_IPC

    def can_export_tensors(self, tensors: Sequence[torch.Tensor]) -> bool:
        return True

    def allocate(self, capacity_bytes: int) -> StagingBuffer:
        raise NotImplementedError

    def export(self, buffer: StagingBuffer, size_bytes: int, label: DeviceRef) -> pb.Payload:
        raise NotImplementedError


def manifests(reads_storages: bool) -> dict[str, ShardManifest]:
    m = ShardManifest.build(
        GPU,
        ParallelRank(),
        [OwnedTensor("w", pb.DTYPE_FLOAT32, (4, 4))],
        instance_id="i",
        waits_for_cuda_ipc_events=True,
        imports_cuda_ipc_storages=reads_storages,
    )
    return {"w0": m}


ITEMS = [("w", torch.zeros(4, 4))]


def options(**kw: object) -> PushOptions:
    return PushOptions(1, pb.UPDATE_SCOPE_FULL, **kw)  # type: ignore[arg-type]


def test_in_place_when_every_worker_reads_storages_and_nothing_converts_or_checks() -> None:
    assert jobs.exports_in_place(ITEMS, manifests(True), StandInCudaExporter(), options())


@pytest.mark.parametrize(
    ("case", "reads", "opts"),
    [
        ("a worker of an earlier version", False, {}),
        ("verify_checksums (the worker checksums one buffer)", True, {"verify_checksums": True}),
        ("cast_to that converts", True, {"cast_to": torch.bfloat16}),
    ],
)
def test_packed_otherwise(case: str, reads: bool, opts: dict[str, object]) -> None:
    assert not jobs.exports_in_place(ITEMS, manifests(reads), StandInCudaExporter(), options(**opts)), case


def test_a_cast_to_that_changes_nothing_stays_in_place() -> None:
    assert jobs.exports_in_place(
        ITEMS, manifests(True), StandInCudaExporter(), options(cast_to={torch.float16: torch.bfloat16})
    )


def test_a_transport_without_tensor_export_packs() -> None:
    assert not jobs.exports_in_place(ITEMS, manifests(True), InlineExporter(), options())


def test_default_gpu_buckets_are_large_but_never_larger_than_the_update() -> None:
    big = [(f"t{i}", torch.empty(0)) for i in range(3)]
    default = Staging(plan.DEFAULT_BUCKET_BYTES, 2, bucket_size_given=False)
    given = Staging(8 * 1024 * 1024, 2, bucket_size_given=True)
    cuda = StandInCudaExporter()
    # A small update: buckets sized to it (rounded to 2 MiB), not 1 GiB of staging.
    assert jobs._packing_bucket_bytes(ITEMS, cuda, default, 256) == 2 * 1024 * 1024
    # A large one: the GPU default.
    huge = [("w", torch.empty((3 * 1024 * 1024 * 1024) // 4 // 1024, 1024, device="meta"))]
    assert jobs._packing_bucket_bytes(huge, cuda, default, 256) == plan.DEFAULT_CUDA_BUCKET_BYTES
    # A size the caller gave, and host transports, keep the pusher's size.
    assert jobs._packing_bucket_bytes(huge, cuda, given, 256) == 8 * 1024 * 1024
    assert jobs._packing_bucket_bytes(big, InlineExporter(), default, 256) == min(
        plan.DEFAULT_BUCKET_BYTES, InlineExporter.bucket_bytes_limit or 0
    )
