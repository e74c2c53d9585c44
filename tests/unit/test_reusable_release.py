"""A failed or cancelled update releases mappings that reusable importers (CUDA IPC) cache, so a
trainer that went away does not keep its GPU memory pinned by the worker; a good update keeps them."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch
from helpers import commit, full_update_requests, header
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model, full_checkpoint
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import ParallelRank
from weightwire.core.transports import table as transports
from weightwire.server.transports.importer import (
    ImportContext,
    ImportedPayload,
    PayloadImporter,
    make_importers,
)
from weightwire.server.worker.service import WorkerService
from weightwire.v1 import weight_transfer_pb2 as pb


class CountingReusableImporter(PayloadImporter):
    """Stands in for the CUDA IPC importer's cache (no GPU here): records release() calls."""

    reusable = True

    def __init__(self) -> None:
        self.released = 0

    def cache_key(self, payload: pb.Payload) -> Hashable | None:
        return None

    def open(self, payload: pb.Payload, ctx: ImportContext) -> tuple[ImportedPayload, bool]:
        raise NotImplementedError("no CUDA payload is sent in this test")

    def held_mappings(self) -> int:
        return 0

    def release(self) -> None:
        self.released += 1


def demo_adapter() -> TorchAdapter:
    config, rank = DemoConfig(), ParallelRank()
    return TorchAdapter(
        build_demo_model(config, rank, "cpu", 0),
        rank=rank,
        device=torch.device("cpu"),
        own_device=DeviceRef.host(),
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
    )


def _service() -> tuple[WorkerService, CountingReusableImporter]:
    importers = make_importers()
    fake = CountingReusableImporter()
    importers[transports.CUDA_IPC.handle_field] = fake
    return WorkerService(demo_adapter(), own_device=DeviceRef.host(), importers=importers), fake


def test_good_update_keeps_reusable_mappings() -> None:
    service, fake = _service()
    weights = full_checkpoint(DemoConfig(), seed=1)
    list(service.push(iter(full_update_requests(1, weights, None))))
    assert service.get_status().weights_version == 1
    assert fake.released == 0


def test_failed_update_releases_reusable_mappings() -> None:
    service, fake = _service()
    weights = full_checkpoint(DemoConfig(), seed=1)
    requests = full_update_requests(1, weights, None)
    # Drop the last bucket: FULL commit fails with INCOMPLETE_UPDATE after a load.
    broken = [*requests[:-2], commit(len(requests) - 3)]
    with pytest.raises(WeightwireError) as err:
        list(service.push(iter(broken)))
    assert err.value.reason == "INCOMPLETE_UPDATE"
    status = service.get_status()
    assert (status.weights_version, status.state) == (0, pb.WORKER_STATE_INCONSISTENT)
    assert fake.released == 1


def test_cancelled_update_releases_reusable_mappings() -> None:
    service, fake = _service()

    def gone() -> bool:
        return True

    with pytest.raises(WeightwireError) as err:
        list(service.push(iter([header(1)]), client_gone=gone))
    assert err.value.code == "CANCELLED"
    assert fake.released == 1
    assert service.get_status().weights_version == 0
