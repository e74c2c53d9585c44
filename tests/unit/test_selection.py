"""select_own_payload from tables: own device, host memory, opt-in peer GPUs, and every refusal."""

from __future__ import annotations

import pytest
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import WeightwireError
from weightwire.server.rules.selection import select_own_payload
from weightwire.v1 import weight_transfer_pb2 as pb

GPU0 = "00000000-aaaa-bbbb-cccc-000000000000"
GPU1 = "11111111-aaaa-bbbb-cccc-111111111111"
GPU2 = "22222222-aaaa-bbbb-cccc-222222222222"
BOOT = "b0070000-1111-2222-3333-444444444444"
OTHER_BOOT = "b0071111-1111-2222-3333-444444444444"
HOST = DeviceRef.host(BOOT)
# GPUs this (pretend) process can see: GPU0 and GPU1; GPU2 is on another host.
VISIBLE = {GPU0, GPU1}


def cuda(uuid: str) -> pb.Payload:
    return pb.Payload(
        device=pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid=uuid), size_bytes=8, inline_data=b"x" * 8
    )


def host(boot: str = BOOT) -> pb.Payload:
    return pb.Payload(
        device=pb.DeviceId(kind=pb.DEVICE_KIND_HOST, uuid=boot), size_bytes=8, inline_data=b"x" * 8
    )


def is_local(label: DeviceRef) -> bool:
    return label.is_cuda and label.uuid in VISIBLE


def select(payloads: list[pb.Payload], own: DeviceRef, allow_peer: bool = False) -> tuple[int, bool]:
    sel = select_own_payload(payloads, own, allow_peer=allow_peer, host_device=HOST, is_local_cuda=is_local)
    return [id(p) for p in payloads].index(id(sel.payload)), sel.peer


@pytest.mark.parametrize(
    ("payloads", "own", "allow_peer", "index", "peer"),
    [
        pytest.param([cuda(GPU0)], DeviceRef.cuda(GPU0), False, 0, False, id="single-own"),
        # A rank index would pick payload 0 here; the label picks the worker's own GPU.
        pytest.param([cuda(GPU0), cuda(GPU1)], DeviceRef.cuda(GPU1), False, 1, False, id="own-not-first"),
        pytest.param(
            [cuda("GPU-" + GPU1.upper()), cuda(GPU0)],
            DeviceRef.cuda(GPU1),
            False,
            0,
            False,
            id="nvml-form-label",
        ),
        pytest.param(
            [cuda(GPU1), cuda(GPU0)], DeviceRef.cuda(GPU0), True, 1, False, id="own-preferred-over-peer"
        ),
        pytest.param([host()], HOST, False, 0, False, id="cpu-worker-host-payload"),
        pytest.param([cuda(GPU0), host()], HOST, False, 1, False, id="cpu-worker-ignores-gpus"),
        pytest.param([host()], DeviceRef.cuda(GPU0), False, 0, False, id="gpu-worker-host-memory"),
        pytest.param(
            [host(), cuda(GPU0)], DeviceRef.cuda(GPU0), False, 1, False, id="gpu-worker-own-gpu-before-host"
        ),
        pytest.param([cuda(GPU1)], DeviceRef.cuda(GPU0), True, 0, True, id="peer-allowed-visible"),
        pytest.param(
            [cuda(GPU2), cuda(GPU1)], DeviceRef.cuda(GPU0), True, 1, True, id="peer-skips-invisible"
        ),
    ],
)
def test_selected(
    payloads: list[pb.Payload], own: DeviceRef, allow_peer: bool, index: int, peer: bool
) -> None:
    assert select(payloads, own, allow_peer) == (index, peer)


@pytest.mark.parametrize(
    ("payloads", "own", "allow_peer", "reason"),
    [
        pytest.param(
            [cuda(GPU1)], DeviceRef.cuda(GPU0), False, "NO_PAYLOAD_FOR_DEVICE", id="peer-not-allowed"
        ),
        pytest.param(
            [cuda(GPU0), cuda(GPU1)], DeviceRef.cuda(GPU2), False, "NO_PAYLOAD_FOR_DEVICE", id="foreign-gpus"
        ),
        pytest.param([host(OTHER_BOOT)], HOST, False, "NO_PAYLOAD_FOR_DEVICE", id="other-machine-host"),
        pytest.param(
            [host(OTHER_BOOT)],
            DeviceRef.cuda(GPU0),
            False,
            "NO_PAYLOAD_FOR_DEVICE",
            id="gpu-other-machine-host",
        ),
        pytest.param([cuda(GPU0)], HOST, False, "NO_PAYLOAD_FOR_DEVICE", id="cpu-worker-gpu-payload"),
        pytest.param([], DeviceRef.cuda(GPU0), False, "NO_PAYLOAD_FOR_DEVICE", id="no-payloads"),
        pytest.param(
            [cuda(GPU2)], DeviceRef.cuda(GPU0), True, "PEER_DEVICE_UNAVAILABLE", id="peer-not-on-this-host"
        ),
        pytest.param([cuda(GPU0)], HOST, True, "PEER_DEVICE_UNAVAILABLE", id="cpu-worker-peer"),
        pytest.param(
            [pb.Payload(size_bytes=8, inline_data=b"x" * 8)],
            HOST,
            False,
            "PAYLOAD_LABEL_MISSING",
            id="no-label",
        ),
        pytest.param([cuda("")], HOST, False, "PAYLOAD_LABEL_MISSING", id="empty-uuid"),
        pytest.param(
            [pb.Payload(device=pb.DeviceId(uuid=GPU0), size_bytes=8, inline_data=b"x" * 8)],
            DeviceRef.cuda(GPU0),
            False,
            "DEVICE_KIND_UNSPECIFIED",
            id="kind-unspecified",
        ),
        pytest.param(
            [cuda(GPU0), cuda("GPU-" + GPU0)],
            DeviceRef.cuda(GPU0),
            False,
            "DUPLICATE_PAYLOAD_LABEL",
            id="duplicate-normalised",
        ),
        pytest.param([host(), host()], HOST, False, "DUPLICATE_PAYLOAD_LABEL", id="duplicate-host"),
    ],
)
def test_refused(payloads: list[pb.Payload], own: DeviceRef, allow_peer: bool, reason: str) -> None:
    with pytest.raises(WeightwireError) as e:
        select(payloads, own, allow_peer)
    assert e.value.reason == reason


def test_no_payload_message_names_own_device_and_every_label() -> None:
    own = DeviceRef.cuda(GPU2)
    with pytest.raises(WeightwireError) as e:
        select([cuda(GPU0), cuda(GPU1), host(OTHER_BOOT)], own)
    err = e.value
    assert err.code == "FAILED_PRECONDITION"
    for text in (GPU2, GPU0, GPU1, OTHER_BOOT):
        assert text in err.message
    assert err.metadata["own_device"] == f"cuda:{GPU2}"
    assert err.metadata["labels"].split(",") == [f"cuda:{GPU0}", f"cuda:{GPU1}", f"host:{OTHER_BOOT}"]


def test_many_labels_truncated_in_message_but_complete_in_metadata() -> None:
    uuids = [f"{i:08x}-0000-0000-0000-000000000000" for i in range(20)]
    with pytest.raises(WeightwireError) as e:
        select([cuda(u) for u in uuids], DeviceRef.cuda(GPU0))
    assert "and 12 more" in e.value.message
    assert len(e.value.metadata["labels"].split(",")) == 20
