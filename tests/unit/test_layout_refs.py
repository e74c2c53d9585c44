"""A bucket that names tensor specs the worker kept (``Bucket.layout_id``) instead of sending them:
new contents load through the kept layout, and every way a reference can be stale (another
manifest, a restarted worker, other payload sizes, a delta update, an id never kept) is refused with
LAYOUT_UNKNOWN before anything is written, the version unchanged."""

from __future__ import annotations

import pytest
import torch
from helpers import ShmSegments, bucket, commit, header, pack, shm_payload
from weightwire.adapters.torch import TorchAdapter
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import ParallelRank
from weightwire.server.rules import layout as layout_rules
from weightwire.server.rules.layout import BucketLayout, LayoutCache
from weightwire.server.rules.validation import check_spec
from weightwire.server.worker.service import WorkerService
from weightwire.v1 import weight_transfer_pb2 as pb


def _layout(*names: str) -> BucketLayout:
    specs = [
        check_spec(pb.TensorSpec(name=n, dtype=pb.DTYPE_FLOAT32, shape=[2], offset_bytes=0)) for n in names
    ]
    return BucketLayout.of(specs, specs)


def test_a_kept_layout_is_found_under_its_id_and_fingerprint_only() -> None:
    cache = LayoutCache()
    assert cache.keep_ref(b"id-a", "fp1", "8:host_shm", _layout("a"))
    found = cache.by_ref(b"id-a", "fp1")
    assert found is not None and found[0] == "8:host_shm" and found[1].names == {"a"}
    assert cache.by_ref(b"id-a", "fp2") is None  # another manifest
    assert cache.by_ref(b"id-b", "fp1") is None
    cache.keep_ref(b"id-a", "fp1", "8:host_shm", _layout("b"))  # the id now names other specs
    found = cache.by_ref(b"id-a", "fp1")
    assert found is not None and found[1].names == {"b"}


def test_kept_layouts_are_bounded_oldest_first_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout_rules, "MAX_LAYOUT_REFS", 2)
    monkeypatch.setattr(layout_rules, "MAX_LAYOUT_REF_SPECS", 4)
    cache = LayoutCache()
    for i in range(3):
        cache.keep_ref(bytes([i]), "fp", "", _layout(f"t{i}"))
    assert [cache.by_ref(bytes([i]), "fp") is not None for i in range(3)] == [False, True, True]
    cache.keep_ref(b"big", "fp", "", _layout("w", "x", "y"))  # 1 + 3 specs fit, 2 + 3 do not
    assert cache.by_ref(bytes([1]), "fp") is None and cache.by_ref(bytes([2]), "fp") is not None
    assert not cache.keep_ref(b"huge", "fp", "", _layout("a", "b", "c", "d", "e"))  # over the whole bound
    assert cache.by_ref(b"huge", "fp") is None and cache.by_ref(b"big", "fp") is not None


# --- through a real worker service ---------------------------------------------------------------


def _service() -> tuple[WorkerService, TorchAdapter]:
    module = torch.nn.Module()
    for name in ("a", "b"):
        module.register_parameter(name, torch.nn.Parameter(torch.zeros(3), requires_grad=False))
    adapter = TorchAdapter(
        module, rank=ParallelRank(), device=torch.device("cpu"), own_device=DeviceRef.host()
    )
    return WorkerService(adapter, own_device=DeviceRef.host()), adapter


class Rig:
    """One worker service and the host segments of its buckets."""

    def __init__(self) -> None:
        self.service, self.adapter = _service()
        self.segments = ShmSegments()

    def bucket(
        self, index: int, value: float, *, refer: bytes = b"", keep: bytes = b""
    ) -> pb.PushWeightsRequest:
        """Bucket ``index`` of tensors a and b at ``value`` and -``value``: with its specs (kept
        under ``keep`` if given), or naming only ``refer``."""
        packed = pack({"a": torch.full((3,), value), "b": torch.full((3,), -value)})
        seg = self.segments.create(packed.data)
        if refer:
            return bucket(index, [], [shm_payload(seg, len(packed.data))], layout_id=refer)
        return bucket(index, packed.specs, [shm_payload(seg, len(packed.data))], layout_id=keep)

    def push(
        self, version: int, *buckets: pb.PushWeightsRequest, **header_kw: object
    ) -> list[pb.PushWeightsResponse]:
        return list(self.service.push(iter([header(version, **header_kw), *buckets, commit(len(buckets))])))

    def refused(self, version: int, *buckets: pb.PushWeightsRequest, **header_kw: object) -> WeightwireError:
        before, state = self.service.weights_version, self.adapter.state()
        kept = {k: v.clone() for k, v in state.items()}
        with pytest.raises(WeightwireError) as info:
            self.push(version, *buckets, **header_kw)
        assert self.service.weights_version == before
        for name, t in self.adapter.state().items():
            assert torch.equal(t, kept[name]), name
        return info.value

    def holds(self, value: float) -> bool:
        state = self.adapter.state()
        return state["a"].tolist() == [value] * 3 and state["b"].tolist() == [-value] * 3

    def close(self) -> None:
        self.segments.close()
        self.service.close()


@pytest.fixture
def rig() -> object:
    r = Rig()
    yield r
    r.close()


def test_a_bucket_naming_kept_specs_loads_new_contents(rig: Rig) -> None:
    (ack, _) = rig.push(1, rig.bucket(0, 1.0, keep=b"L1"))
    assert ack.ack.layout_kept and rig.holds(1.0)
    (ack, result) = rig.push(2, rig.bucket(0, 2.0, refer=b"L1"))
    assert ack.ack.tensors_loaded == 2 and not ack.ack.layout_kept
    assert result.result.version == 2 and rig.holds(2.0)
    # Without an id nothing is kept or acked as kept.
    (ack, _) = rig.push(3, rig.bucket(0, 3.0))
    assert not ack.ack.layout_kept and rig.holds(3.0)


def test_stale_references_are_refused_before_anything_is_written(rig: Rig) -> None:
    rig.push(1, rig.bucket(0, 1.0, keep=b"L1"))
    err = rig.refused(2, rig.bucket(0, 2.0, refer=b"never-kept"))
    assert err.reason == "LAYOUT_UNKNOWN" and "send the bucket with its tensor specs" in str(err)
    # The payload's size differs from the one the specs were checked against (a bounds check).
    packed = pack({"a": torch.full((3,), 2.0), "b": torch.full((3,), -2.0)})
    seg = rig.segments.create(packed.data, size=4096)
    smaller = bucket(0, [], [shm_payload(seg, len(packed.data) - 4)], layout_id=b"L1")
    assert rig.refused(2, smaller).reason == "LAYOUT_UNKNOWN"
    # Another manifest (the worker's fingerprint changed): the header's own check refuses first,
    # and a reference is looked up under the worker's current fingerprint only.
    assert rig.refused(2, rig.bucket(0, 2.0, refer=b"L1"), manifest_fingerprint="other").reason == (
        "MANIFEST_CHANGED"
    )
    # A delta update never refers to kept specs.
    rig.push(2, rig.bucket(0, 2.0))
    delta = rig.refused(3, rig.bucket(0, 3.0, refer=b"L1"), delta_base=pb.DeltaBase(base_version=2))
    assert delta.reason == "LAYOUT_UNKNOWN"
    # An id too long for the contract.
    assert rig.refused(3, rig.bucket(0, 3.0, keep=b"x" * 65)).reason == "MALFORMED_STREAM"
    # The kept layout still serves, and names still count once per update (bucket 0 was loaded
    # before bucket 1 repeated its names, as with specs sent: the worker is INCONSISTENT, version 2).
    with pytest.raises(WeightwireError) as info:
        rig.push(3, rig.bucket(0, 3.0, refer=b"L1"), rig.bucket(1, 3.0, refer=b"L1"))
    assert info.value.reason == "DUPLICATE_TENSOR" and rig.service.weights_version == 2
    rig.push(3, rig.bucket(0, 3.0, refer=b"L1"))
    assert rig.holds(3.0)


def test_a_restarted_worker_holds_no_references(rig: Rig) -> None:
    rig.push(1, rig.bucket(0, 1.0, keep=b"L1"))
    fresh = Rig()
    try:
        assert fresh.refused(2, fresh.bucket(0, 2.0, refer=b"L1")).reason == "LAYOUT_UNKNOWN"
    finally:
        fresh.close()
