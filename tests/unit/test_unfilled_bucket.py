"""A bucket only an importer that fills the model could load (no tensor specs: a slices bucket of
every trainer rank a source) is refused by a worker that has no such importer, instead of being
acked with nothing loaded: a PARTIAL update must never commit a version none of whose bytes arrived."""

from __future__ import annotations

import pytest
import torch
from helpers import header
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import ParallelRank
from weightwire.core.transports import table as transports
from weightwire.server.transports.importer import make_importers
from weightwire.server.worker.service import WorkerService
from weightwire.v1 import weight_transfer_pb2 as pb

NORM = "model.norm.weight"


def _service_without_groups() -> WorkerService:
    config, rank = DemoConfig(), ParallelRank()
    adapter = TorchAdapter(
        build_demo_model(config, rank, "cpu", 0),
        rank=rank,
        device=torch.device("cpu"),
        own_device=DeviceRef.host(),
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
    )
    importers = make_importers()
    importers.pop(transports.TRANSFER_GROUP.handle_field)
    return WorkerService(adapter, own_device=DeviceRef.host(), importers=importers)


def _slices_bucket(service: WorkerService) -> pb.PushWeightsRequest:
    owned = service.manifest.tensors[NORM]
    request = pb.PushWeightsRequest()
    payload = request.bucket.payloads.add()
    payload.device.CopyFrom(DeviceRef.host().to_proto())
    h = payload.transfer_group
    h.group_id, h.mode = "g", pb.TRANSFER_MODE_SLICES
    h.plan_fingerprint, h.max_message_bytes = "0" * 32, 1 << 20
    s = h.slices.add(tensor=NORM, source_rank=0)
    s.start.extend(0 for _ in owned.shape)
    s.stop.extend(owned.shape)
    payload.size_bytes = owned.nbytes
    return request


def test_a_slices_bucket_without_a_filling_importer_is_refused_and_the_version_stays() -> None:
    service = _service_without_groups()
    before = service.get_status()
    requests = [
        header(before.weights_version + 1, scope=pb.UPDATE_SCOPE_PARTIAL),
        _slices_bucket(service),
        pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=1)),
    ]
    with pytest.raises(WeightwireError) as err:
        list(service.push(iter(requests)))
    assert err.value.reason == "TRANSPORT_UNAVAILABLE", err.value
    assert "transfer group" in str(err.value), err.value
    st = service.get_status()
    assert (st.weights_version, st.state) == (before.weights_version, before.state)


def test_an_inline_bucket_without_specs_is_refused_and_the_version_stays() -> None:
    """The inline importer is there but fills nothing by itself: bytes without specs load nowhere."""
    service = _service_without_groups()
    before = service.get_status()
    request = pb.PushWeightsRequest()
    payload = request.bucket.payloads.add(inline_data=b"\0" * 64, size_bytes=64)
    payload.device.CopyFrom(DeviceRef.host().to_proto())
    requests = [
        header(before.weights_version + 1, scope=pb.UPDATE_SCOPE_PARTIAL),
        request,
        pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=1)),
    ]
    with pytest.raises(WeightwireError) as err:
        list(service.push(iter(requests)))
    assert err.value.reason == "TRANSPORT_UNAVAILABLE" and "no tensor specs" in str(err.value), err.value
    st = service.get_status()
    assert (st.weights_version, st.state) == (before.weights_version, before.state)
