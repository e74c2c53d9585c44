"""The layout cache's index of whole bucket messages: a faster way to a layout already checked, never
a way around the checks (a message finds only a layout that is still cached, under its fingerprint),
and bounded in bytes."""

from __future__ import annotations

import pytest
import torch
from helpers import ShmSegments, bucket, commit, header, pack, shm_payload
from weightwire.adapters.torch import TorchAdapter
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import ParallelRank
from weightwire.server.rules.layout import BucketLayout, LayoutCache
from weightwire.server.rules.validation import check_spec
from weightwire.server.worker.service import WorkerService
from weightwire.v1 import weight_transfer_pb2 as pb


def layout(name: str) -> BucketLayout:
    spec = check_spec(pb.TensorSpec(name=name, dtype=pb.DTYPE_FLOAT32, shape=[2], offset_bytes=0))
    assert spec.torch_dtype == torch.float32
    return BucketLayout.of([spec], [spec])


def test_a_message_finds_the_layout_it_resolved_to_under_its_fingerprint_only() -> None:
    cache = LayoutCache()
    key = (b"specs-a", "fp1")
    cache.put(key, layout("a"))
    cache.put_message(b"message-a", "fp1", key)
    assert cache.get_message(b"message-a", "fp1") is cache.get(key)
    assert cache.get_message(b"message-a", "fp2") is None  # another manifest: checked anew
    assert cache.get_message(b"message-b", "fp1") is None
    # Only a key that is cached can be indexed.
    cache.put_message(b"message-x", "fp1", (b"never-put", "fp1"))
    assert cache.get_message(b"message-x", "fp1") is None


def test_a_message_of_an_evicted_layout_finds_nothing() -> None:
    cache = LayoutCache(max_layouts=1)
    cache.put((b"a", "fp"), layout("a"))
    cache.put_message(b"message-a", "fp", (b"a", "fp"))
    cache.put((b"b", "fp"), layout("b"))  # evicts a
    assert cache.get((b"a", "fp")) is None
    assert cache.get_message(b"message-a", "fp") is None


def test_the_message_index_is_bounded_in_bytes_oldest_first_out() -> None:
    cache = LayoutCache(max_message_bytes=100)
    key = (b"a", "fp")
    cache.put(key, layout("a"))
    for i in range(5):
        cache.put_message(bytes([i]) * 40, "fp", key)
        cache.put_message(bytes([i]) * 40, "fp", key)  # the same message again counts once
    found = [i for i in range(5) if cache.get_message(bytes([i]) * 40, "fp") is not None]
    assert found == [3, 4]
    cache.put_message(b"x" * 101, "fp", key)  # larger than the bound: not kept, nothing evicted
    assert cache.get_message(b"x" * 101, "fp") is None
    assert cache.get_message(bytes([4]) * 40, "fp") is not None


# --- through a real worker service: byte-identical buckets across updates -----------------------


def _service() -> tuple[WorkerService, TorchAdapter]:
    module = torch.nn.Module()
    for name in ("a", "b"):
        module.register_parameter(name, torch.nn.Parameter(torch.zeros(3), requires_grad=False))
    adapter = TorchAdapter(
        module, rank=ParallelRank(), device=torch.device("cpu"), own_device=DeviceRef.host()
    )
    return WorkerService(adapter, own_device=DeviceRef.host()), adapter


def _shm_bucket(
    segments: ShmSegments, index: int, named: dict[str, torch.Tensor], name: str
) -> pb.PushWeightsRequest:
    packed = pack(named)
    seg = segments.create(packed.data, name=name)
    return bucket(index, packed.specs, [shm_payload(seg, len(packed.data))])


def test_repeated_messages_load_new_contents_and_keep_every_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightwire.server.worker import accepted as accepted_module

    keyed: list[int] = []
    full_key = accepted_module.layout_key
    monkeypatch.setattr(
        accepted_module,
        "layout_key",
        lambda msg, payloads: (keyed.append(msg.index), full_key(msg, payloads))[1],
    )
    service, adapter = _service()
    segments = ShmSegments()
    try:
        for version in (1, 2):
            value = float(version)
            # The same segment names every update: the bucket messages are byte for byte the same.
            for seg in segments.segments:
                seg.close()
                seg.unlink()
            segments.segments.clear()
            reqs = [
                header(version),
                _shm_bucket(segments, 0, {"a": torch.full((3,), value)}, "ww-test-layout-a"),
                _shm_bucket(segments, 1, {"b": torch.full((3,), -value)}, "ww-test-layout-b"),
                commit(2),
            ]
            list(service.push(iter(reqs)))
            assert (
                adapter.state()["a"].tolist() == [value] * 3 and adapter.state()["b"].tolist() == [-value] * 3
            )
        assert len(service.layouts) == 2
        assert keyed == [0, 1]  # update 2 found both layouts by their messages
        # Bucket 1 is again byte for byte the message seen before, but its tensor already came in
        # bucket 0 of this update: still DUPLICATE_TENSOR, and the version stays.
        first = _shm_bucket(segments, 0, {"b": torch.full((3,), 9.0)}, "ww-test-layout-c")
        again = pb.PushWeightsRequest(
            bucket=pb.Bucket(index=1, tensors=first.bucket.tensors, payloads=first.bucket.payloads)
        )
        replayed = _shm_bucket(segments, 1, {"b": torch.full((3,), -2.0)}, "ww-test-layout-b2")
        replayed.bucket.payloads[0].host_shm.name = "ww-test-layout-b"
        for reqs in ([header(3), first, replayed, commit(2)], [header(3), first, again, commit(2)]):
            with pytest.raises(WeightwireError) as info:
                list(service.push(iter(reqs)))
            assert info.value.reason == "DUPLICATE_TENSOR"
            assert service.weights_version == 2
    finally:
        segments.close()
        service.close()
