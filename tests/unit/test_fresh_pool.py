"""The CUDA IPC exporter's fresh-tensor pool, on the CPU: which storages a push packs and which it
sends where they live, the pool's layout, that what is packed lands at the payload offsets the
workers read, and that a payload whose layout did not change is the same object (the workers then
find it kept). torch's CUDA sharing is replaced by a stand-in that hands out distinct shares, so
everything here runs without a GPU; tests/gpu/test_fresh_pool_gpu.py runs the same path on one."""

from __future__ import annotations

import itertools
import types
from collections.abc import Iterator

import pytest
import torch
from weightwire.client.push.pusher import WeightPusher
from weightwire.client.transports import cuda_ipc
from weightwire.client.transports import cuda_ipc_pool as pool
from weightwire.v1 import weight_transfer_pb2 as pb

MiB = 1 << 20


@pytest.mark.parametrize(
    ("fresh", "total", "nbytes", "packs"),
    [
        (0, 10, 0, False),  # nothing fresh
        (399, 399, 15 << 30, True),  # every parameter new (Qwen3-8B): 7.6 ms of copy vs 80 ms of opens
        (1, 399, 1 << 20, False),  # a replaced parameter is shared anew
        (199, 399, 1 << 30, False),  # fewer than half
        (200, 399, 1 << 30, True),
        (4, 4, 16 << 30, False),  # a few huge storages open faster than they copy
    ],
)
def test_pack_fresh_decision(fresh: int, total: int, nbytes: int, packs: bool) -> None:
    assert pool.pack_fresh(fresh, total, nbytes) is packs


def test_layout_aligns_and_cuts_chunks() -> None:
    layout = pool.lay_out([10, 300, 600, 2000, 5], chunk_bytes=1024)
    assert layout.places == ((0, 0), (0, 256), (1, 0), (2, 0), (3, 0))
    # A tensor larger than a chunk gets one of its own; every chunk is rounded for allocation.
    assert all(c % pool.ALLOC_GRANULE == 0 for c in layout.chunks)
    assert len(layout.chunks) == 4


def test_layout_places_fit_their_chunks() -> None:
    sizes = [7, 1 << 20, 3, (1 << 30) + 5, 64, 64]
    layout = pool.lay_out(sizes)
    for (chunk, at), n in zip(layout.places, sizes, strict=True):
        assert at % pool.ALIGN_BYTES == 0
        assert at + n <= layout.chunks[chunk]


# ---------------------------------------------------------------------------------------------
# The exporter with a stand-in for torch's CUDA sharing
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[cuda_ipc.CudaIpcExporter]:
    slots = itertools.count()

    def fake_share(t: torch.Tensor) -> types.SimpleNamespace:
        n = next(slots)
        return types.SimpleNamespace(
            fields=types.SimpleNamespace(
                memory_handle=b"h%d" % n,
                storage_offset_bytes=0,
                storage_size_bytes=t.untyped_storage().nbytes(),
                ref_counter_handle=b"/torch_1_1",
                ref_counter_offset=n,
            )
        )

    monkeypatch.setattr(cuda_ipc, "resolve_cuda_device", lambda _: torch.device("cpu"))
    monkeypatch.setattr(cuda_ipc, "cuda_device_uuid", lambda _: "00000000-0000-0000-0000-000000000000")
    monkeypatch.setattr(cuda_ipc, "share_cuda_tensor", fake_share)
    e = cuda_ipc.CudaIpcExporter(0)
    yield e
    e.close()


SHAPES = [(64, 32), (32,), (16, 16), (8,)] * 3  # 12 parameters, each its own storage


def fresh_tensors(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def read_back(exported: cuda_ipc.ExportedTensors, tensors: list[torch.Tensor], i: int) -> torch.Tensor:
    """Tensor ``i`` as a worker reads it: at its payload offset, inside the storage holding it."""
    at = exported.offsets[i]
    if i in exported.packs:
        assert exported.region is not None
        storages = exported.storages["w0"]
        firsts = [m.payload_offset_bytes for m in storages]
        k = max(j for j, off in enumerate(firsts) if off <= at)
        chunk = exported.region.chunks[k - (len(storages) - len(exported.region.chunks))]
        raw = chunk[at - firsts[k] : at - firsts[k] + tensors[i].nbytes]
        return raw.view(tensors[i].dtype).view(tensors[i].shape)
    return tensors[i]


def test_first_push_shares_then_fresh_storages_are_packed_into_one_kept_payload(
    exporter: cuda_ipc.CudaIpcExporter,
) -> None:
    first = fresh_tensors(1)
    e1 = exporter.export_tensors(first, ["w0"])
    assert e1 is not None and e1.packs == ()  # nothing says yet whether the trainer keeps them
    assert exporter.storages_shared == len(SHAPES)
    del first, e1

    payloads = []
    for step in (2, 3, 4):
        tensors = fresh_tensors(step)
        exported = exporter.export_tensors(tensors, ["w0"])
        assert exported is not None
        assert exported.packs == tuple(range(len(SHAPES)))
        exported.pack(tensors)
        for i, t in enumerate(tensors):
            assert torch.equal(read_back(exported, tensors, i), t)
            assert exported.offsets[i] % pool.ALIGN_BYTES == 0
        payloads.append(exported)
        storages = exported.storages["w0"]
        assert len(storages) == len(exported.region.chunks)  # type: ignore[union-attr]
    # Every step the same payload object: the worker finds its set, views and prepared load kept.
    assert payloads[0] is payloads[1] is payloads[2]
    assert exporter.storages_shared == len(SHAPES) + 1  # the pool's one chunk, shared once


def test_kept_tensors_stay_where_they_live(exporter: cuda_ipc.CudaIpcExporter) -> None:
    kept = fresh_tensors(1)
    e1 = exporter.export_tensors(kept, ["w0"])
    e2 = exporter.export_tensors(kept, ["w0"])
    assert e1 is e2 and e2 is not None and e2.packs == ()
    assert exporter.tensors_packed == 0


def test_packed_tensors_pushed_again_are_kept_ones(exporter: cuda_ipc.CudaIpcExporter) -> None:
    """After ``load_state_dict(assign=True)`` (every storage new once), the tensors that survive to
    the next push go where they live from then on, and the pool is let go."""
    exporter.export_tensors(fresh_tensors(1), ["w0"])
    assigned = fresh_tensors(2)
    packed = exporter.export_tensors(assigned, ["w0"])
    assert packed is not None and len(packed.packs) == len(SHAPES)
    again = exporter.export_tensors(assigned, ["w0"])
    assert again is not None and again.packs == ()
    assert exporter._pooled == {}
    assert exporter.export_tensors(assigned, ["w0"]) is again


def test_a_few_replaced_storages_are_shared_anew(exporter: cuda_ipc.CudaIpcExporter) -> None:
    params = fresh_tensors(1)
    exporter.export_tensors(params, ["w0"])
    params[0] = params[0].clone()
    exported = exporter.export_tensors(params, ["w0"])
    assert exported is not None and exported.packs == ()
    assert exporter.storages_shared == len(SHAPES) + 1


def test_mixed_kept_and_fresh(exporter: cuda_ipc.CudaIpcExporter) -> None:
    """Kept storages stay in place, fresh ones (most of them) go to the pool, in one payload."""
    base = fresh_tensors(1)
    exporter.export_tensors(base, ["w0"])
    tensors = list(base)
    for i in range(2, len(tensors)):
        tensors[i] = tensors[i].clone() + 1
    exported = exporter.export_tensors(tensors, ["w0"])
    assert exported is not None and exported.packs == tuple(range(2, len(SHAPES)))
    exported.pack(tensors)
    for i in range(2, len(SHAPES)):
        assert torch.equal(read_back(exported, tensors, i), tensors[i])
    offsets = [m.payload_offset_bytes for m in exported.storages["w0"]]
    assert offsets == sorted(offsets)  # storages ascend, as the worker requires


def test_each_recipient_gets_its_own_shares_of_the_pool(exporter: cuda_ipc.CudaIpcExporter) -> None:
    exporter.export_tensors(fresh_tensors(1), ["w0", "w1"])
    exported = exporter.export_tensors(fresh_tensors(2), ["w0", "w1"])
    assert exported is not None and exported.packs
    a, b = exported.storages["w0"], exported.storages["w1"]
    assert [m.payload_offset_bytes for m in a] == [m.payload_offset_bytes for m in b]
    assert {m.ref_counter_offset for m in a}.isdisjoint(m.ref_counter_offset for m in b)


@pytest.mark.parametrize("limit", [0, 1024])
def test_a_pool_limit_shares_instead(exporter: cuda_ipc.CudaIpcExporter, limit: int) -> None:
    exporter.pool_limit_bytes = limit
    exporter.export_tensors(fresh_tensors(1), ["w0"])
    exported = exporter.export_tensors(fresh_tensors(2), ["w0"])
    assert exported is not None and exported.packs == ()


def test_a_failed_push_never_packs_into_the_same_buffers_again(exporter: cuda_ipc.CudaIpcExporter) -> None:
    exporter.export_tensors(fresh_tensors(1), ["w0"])
    failed = exporter.export_tensors(fresh_tensors(2), ["w0"])
    assert failed is not None and failed.region is not None
    old_chunks = [c.data_ptr() for c in failed.region.chunks]
    held = failed.region.chunks  # as a worker still mapping them would
    failed.discard()
    with pytest.raises(RuntimeError):
        failed.pack(fresh_tensors(2))
    tensors = fresh_tensors(3)
    exported = exporter.export_tensors(tensors, ["w0"])
    assert exported is not None and exported is not failed and exported.region is not None
    assert [c.data_ptr() for c in exported.region.chunks] != old_chunks
    del held


def test_payload_of_a_pooled_export_names_the_pool_chunks(exporter: cuda_ipc.CudaIpcExporter) -> None:
    exporter.export_tensors(fresh_tensors(1), ["w0"])
    exported = exporter.export_tensors(fresh_tensors(2), ["w0"])
    assert exported is not None
    label = exporter.label
    msg = exported.payload("w0", label, b"event", True)
    assert msg.cuda_ipc.storages_complete and msg.cuda_ipc.event_sync_required
    assert msg.size_bytes == exported.size_bytes
    assert [s.memory_handle for s in msg.cuda_ipc.storages] == [
        s.memory_handle for s in exported.storages["w0"]
    ]
    assert isinstance(msg, pb.Payload)


def test_tensor_buffers_are_views_of_one_allocation() -> None:
    like = {
        "a": torch.empty(3, 5, dtype=torch.bfloat16, device="meta"),
        "b": torch.empty(7),
        "c": torch.empty(()),
    }
    with WeightPusher(["unix:/nonexistent.sock"]) as pusher:
        bufs = pusher.tensor_buffers(like, device="cpu")
    assert list(bufs) == ["a", "b", "c"]
    assert {n: (t.shape, t.dtype) for n, t in bufs.items()} == {
        n: (t.shape, t.dtype) for n, t in like.items()
    }
    storages = {t.untyped_storage().data_ptr() for t in bufs.values()}
    assert len(storages) == 1
    assert all(t.storage_offset() * t.element_size() % 256 == 0 for t in bufs.values())
    assert all(t.is_contiguous() for t in bufs.values())


@pytest.mark.parametrize("cat", [True, False])
def test_both_packings_land_the_same_bytes(
    exporter: cuda_ipc.CudaIpcExporter, monkeypatch: pytest.MonkeyPatch, cat: bool
) -> None:
    monkeypatch.setattr(pool, "PACK_WITH_CAT", cat)
    exporter.export_tensors(fresh_tensors(1), ["w0"])
    tensors = fresh_tensors(2)
    tensors[3] = tensors[3].to(torch.bfloat16)  # a dtype of its own cuts the run
    exported = exporter.export_tensors(tensors, ["w0"])
    assert exported is not None and exported.packs
    exported.pack(tensors)
    for i, t in enumerate(tensors):
        assert torch.equal(read_back(exported, tensors, i), t)


def test_cat_runs_cut_at_dtypes_gaps_and_chunks() -> None:
    shapes = [
        (torch.float32, torch.Size([64])),
        (torch.float32, torch.Size([3])),
        (torch.float32, torch.Size([64])),
    ]
    shapes += [(torch.bfloat16, torch.Size([128])), (torch.float32, torch.Size([64]))]
    layout = pool.lay_out([d.itemsize * s.numel() for d, s in shapes])
    chunks = [torch.empty(n, dtype=torch.uint8) for n in layout.chunks]
    runs = pool.cat_runs(layout, chunks, shapes)
    # 64 floats fill 256 bytes, so 0 and 1 lie back to back; 1 leaves a gap before 2.
    assert [m for _, m in runs] == [[0, 1], [2], [3], [4]]


def test_two_recipient_groups_each_keep_their_own_history(exporter: cuda_ipc.CudaIpcExporter) -> None:
    """Pipeline stages: one payload per group of workers in one push. After every storage was new
    once, the tensors that survive go where they live in both groups, not only in the last one."""
    for step in (1, 2):
        a, b = fresh_tensors(step), fresh_tensors(step + 10)
        ea = exporter.export_tensors(a, ["w0"])
        eb = exporter.export_tensors(b, ["w1"])
    assert ea is not None and eb is not None and ea.packs and eb.packs
    again_a = exporter.export_tensors(a, ["w0"])
    again_b = exporter.export_tensors(b, ["w1"])
    assert again_a is not None and again_a.packs == ()
    assert again_b is not None and again_b.packs == ()


def test_the_pool_limit_counts_every_group(exporter: cuda_ipc.CudaIpcExporter) -> None:
    exporter.pool_limit_bytes = pool.ALLOC_GRANULE  # one group's pool of these tensors fits, not two
    exporter.export_tensors(fresh_tensors(1), ["w0"])
    exporter.export_tensors(fresh_tensors(2), ["w1"])
    first = exporter.export_tensors(fresh_tensors(3), ["w0"])
    second = exporter.export_tensors(fresh_tensors(4), ["w1"])
    assert first is not None and first.packs
    assert second is not None and second.packs == ()
