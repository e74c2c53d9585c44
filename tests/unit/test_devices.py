"""Device identity: UUID normalisation and the one "is this payload mine" decision, from tables."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from weightwire.core.devices import MAX_UUID_CHARS, DeviceRef, is_own_device, normalize_uuid
from weightwire.core.errors import WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb

TORCH_UUID = "1a2b3c4d-0000-1111-2222-333344445555"


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        (TORCH_UUID, TORCH_UUID),  # torch's bare form is already canonical
        ("GPU-1a2b3c4d-0000-1111-2222-333344445555", TORCH_UUID),  # NVML
        ("gpu-1A2B3C4D-0000-1111-2222-333344445555", TORCH_UUID),
        ("GPU-1A2B3C4D-0000-1111-2222-333344445555", TORCH_UUID),
        ("MIG-1a2b3c4d-0000-1111-2222-333344445555", TORCH_UUID),  # MIG instance
        ("  GPU-1a2b3c4d-0000-1111-2222-333344445555\n", TORCH_UUID),  # read from a file
        ("1A2B3C4D-0000-1111-2222-333344445555", TORCH_UUID),
        ("GPU-GPU-abc", "gpu-abc"),  # only one prefix is stripped
        ("xGPU-abc", "xgpu-abc"),  # a prefix only counts at the start
        ("", ""),
    ],
)
def test_normalize_uuid(raw: str, normalised: str) -> None:
    assert normalize_uuid(raw) == normalised


@pytest.mark.parametrize(
    ("label", "own", "mine"),
    [
        (DeviceRef.cuda("GPU-" + TORCH_UUID.upper()), DeviceRef.cuda(TORCH_UUID), True),
        (DeviceRef.cuda(TORCH_UUID), DeviceRef.cuda("MIG-" + TORCH_UUID), True),
        (DeviceRef.cuda(TORCH_UUID), DeviceRef.cuda("ffffffff-0000-1111-2222-333344445555"), False),
        # same UUID string, different kind: a host boot id never matches a GPU
        (DeviceRef.host(TORCH_UUID), DeviceRef.cuda(TORCH_UUID), False),
        (DeviceRef.host("boot-a"), DeviceRef.host("BOOT-A"), True),
        (DeviceRef.host("boot-a"), DeviceRef.host("boot-b"), False),
    ],
)
def test_is_own_device(label: DeviceRef, own: DeviceRef, mine: bool) -> None:
    assert is_own_device(label, own) is mine


@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        (pb.DeviceId(kind=pb.DEVICE_KIND_UNSPECIFIED, uuid=TORCH_UUID), "DEVICE_KIND_UNSPECIFIED"),
        (pb.DeviceId(kind=77, uuid=TORCH_UUID), "DEVICE_KIND_UNSPECIFIED"),  # type: ignore[arg-type]
        (pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid=""), "PAYLOAD_LABEL_MISSING"),
        (pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid="GPU-"), "PAYLOAD_LABEL_MISSING"),
        # A second prefix: normalising once leaves "gpu-...", which is no device UUID.
        (pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid="GPU-GPU-" + TORCH_UUID), "PAYLOAD_LABEL_MISSING"),
        (pb.DeviceId(kind=pb.DEVICE_KIND_HOST, uuid="MIG-gpu-" + TORCH_UUID), "PAYLOAD_LABEL_MISSING"),
        (pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid="a" * (MAX_UUID_CHARS + 1)), "PAYLOAD_LABEL_MISSING"),
        (pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid=TORCH_UUID + "\x00x"), "PAYLOAD_LABEL_MISSING"),
        (pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid="é" + TORCH_UUID), "PAYLOAD_LABEL_MISSING"),
    ],
)
def test_label_from_wire_rejected(msg: pb.DeviceId, reason: str) -> None:
    with pytest.raises(WeightwireError) as e:
        DeviceRef.from_proto(msg)
    assert e.value.reason == reason


def test_label_from_wire_normalised() -> None:
    assert DeviceRef.from_proto(
        pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid="GPU-" + TORCH_UUID.upper())
    ) == DeviceRef.cuda(TORCH_UUID)


def test_a_doubly_prefixed_label_is_never_the_own_device() -> None:
    own = DeviceRef.cuda(TORCH_UUID)
    with pytest.raises(ValueError):
        DeviceRef.cuda("GPU-GPU-" + TORCH_UUID)
    assert not is_own_device(DeviceRef.cuda("xgpu-" + TORCH_UUID), own)


@settings(deadline=None, database=None)
@given(st.text(max_size=60))
def test_a_label_from_the_wire_is_canonical_once_and_for_all(raw: str) -> None:
    msg = pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid=raw)
    try:
        ref = DeviceRef.from_proto(msg)
    except WeightwireError as e:
        assert e.reason == "PAYLOAD_LABEL_MISSING"
        return
    # Accepted: its canonical form parses back to itself, and compares equal only to itself.
    again = DeviceRef.from_proto(ref.to_proto())
    assert again == ref and is_own_device(again, ref) and normalize_uuid(ref.uuid) == ref.uuid
