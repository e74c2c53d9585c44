"""The worker remembers bucket layouts it validated; a remembered layout must never let through
what the full checks would refuse, and must never serve stale contents."""

from __future__ import annotations

import pytest
import torch
from helpers import bucket, commit, header, inline_payload, pack, split_buckets
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import (
    DEMO_TP_RULES,
    DemoConfig,
    build_demo_model,
    expected_shard,
    full_checkpoint,
)
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import ParallelRank
from weightwire.server.worker.service import WorkerService
from weightwire.v1 import weight_transfer_pb2 as pb

CONFIG = DemoConfig()
RANK = ParallelRank(tp_rank=1, tp_size=2)


def _service() -> tuple[WorkerService, TorchAdapter]:
    adapter = TorchAdapter(
        build_demo_model(CONFIG, RANK, "cpu", 0),
        rank=RANK,
        device=torch.device("cpu"),
        own_device=DeviceRef.host(),
        tp_rules=DEMO_TP_RULES,
        num_layers=CONFIG.num_layers,
    )
    return WorkerService(adapter, own_device=DeviceRef.host()), adapter


def _buckets(seed: int, n: int = 3) -> list[pb.PushWeightsRequest]:
    groups = split_buckets(full_checkpoint(CONFIG, seed=seed), n)
    out = []
    for i, group in enumerate(groups):
        packed = pack(group)
        out.append(bucket(i, packed.specs, [inline_payload(packed.data)]))
    return out


def _check_holds(adapter: TorchAdapter, seed: int) -> None:
    want = expected_shard(full_checkpoint(CONFIG, seed=seed), RANK, CONFIG)
    got = dict(adapter.module.named_parameters())
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].detach(), tensor), name


def test_same_layout_new_contents_are_loaded() -> None:
    service, adapter = _service()
    for version in (1, 2, 3):
        reqs = [header(version), *_buckets(seed=version), commit(3)]
        list(service.push(iter(reqs)))
        _check_holds(adapter, version)
        remembered = len(service.layouts)
    # Three layouts, checked once: versions 2 and 3 were served from the cache.
    assert remembered == 3
    assert service.get_status().weights_version == 3


def test_remembered_layout_twice_in_one_update_is_duplicate_tensor() -> None:
    service, _ = _service()
    first = _buckets(seed=1)
    list(service.push(iter([header(1), *first, commit(3)])))
    again = _buckets(seed=2)
    replay = pb.PushWeightsRequest()
    replay.CopyFrom(again[0])
    replay.bucket.index = 3
    with pytest.raises(WeightwireError) as err:
        list(service.push(iter([header(2), again[0], replay, *again[1:], commit(4)])))
    assert err.value.reason == "DUPLICATE_TENSOR"
    status = service.get_status()
    assert (status.weights_version, status.state) == (1, pb.WORKER_STATE_INCONSISTENT)


def test_remembered_specs_with_smaller_payload_are_out_of_bounds() -> None:
    service, adapter = _service()
    first = _buckets(seed=1)
    list(service.push(iter([header(1), *first, commit(3)])))
    short = pb.PushWeightsRequest()
    short.CopyFrom(first[0])
    data = short.bucket.payloads[0].inline_data[:-8]
    short.bucket.payloads[0].CopyFrom(inline_payload(data))
    with pytest.raises(WeightwireError) as err:
        list(service.push(iter([header(2), short, *first[1:], commit(3)])))
    assert err.value.reason == "TENSOR_OUT_OF_BOUNDS"
    assert service.get_status().weights_version == 1
    _check_holds(adapter, 1)


def test_remembered_layouts_still_need_full_coverage() -> None:
    service, _ = _service()
    first = _buckets(seed=1)
    list(service.push(iter([header(1), *first, commit(3)])))
    with pytest.raises(WeightwireError) as err:
        list(service.push(iter([header(2), *_buckets(seed=2)[:2], commit(2)])))
    assert err.value.reason == "INCOMPLETE_UPDATE"
    assert service.get_status().weights_version == 1
