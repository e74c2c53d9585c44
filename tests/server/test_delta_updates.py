"""Delta updates into real gRPC workers (the demo model), sent as raw requests built with
``weightwire.core.delta``'s own wire functions: after a FULL at version v, a delta based on v lands
bit-exactly (inline bytes and host shared memory; TP=2, each worker applying only its piece), and
every refusal leaves the weights, the version and the state as they were, except a drifted
worker's, which did write and says so."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import grpc
import pytest
import torch
from helpers import (
    InProcessWorker,
    ShmSegments,
    bucket,
    commit,
    full_update_requests,
    header,
    inline_payload,
    push,
    shm_payload,
    start_demo_worker,
)
from weightwire.adapters.torch.demo import expected_shard, full_checkpoint
from weightwire.core import dtypes
from weightwire.core.delta import checksum, encode, pack_delta, packed_size_bytes
from weightwire.core.manifest import ParallelRank
from weightwire.v1 import weight_transfer_pb2 as pb

CRC = pb.CHECKSUM_ALGORITHM_CRC32
WSUM = pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64
_versions = itertools.count(1)


@pytest.fixture(scope="module")
def segments() -> Iterator[ShmSegments]:
    segs = ShmSegments()
    yield segs
    segs.close()


@pytest.fixture(scope="module")
def one() -> Iterator[InProcessWorker]:
    worker = start_demo_worker()
    yield worker
    worker.server.stop(grace=0)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def tp2() -> Iterator[list[InProcessWorker]]:
    workers = [start_demo_worker(ParallelRank(tp_rank=r, tp_size=2)) for r in range(2)]
    yield workers
    for w in workers:
        w.server.stop(grace=0)  # type: ignore[attr-defined]


def stepped(old: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A training step's new weights: per tensor none, about 1%, about 10% or all elements changed
    (so every encoding is chosen: an empty INDICES, INDICES, BITMAP, DENSE)."""
    gen = torch.Generator().manual_seed(seed)
    new = {}
    for i, (name, t) in enumerate(old.items()):
        fraction = (0.0, 0.01, 0.1, 1.0)[i % 4]
        flat = t.clone().view(-1)
        mask = torch.rand(flat.numel(), generator=gen) < fraction
        flat[mask] += 1e-3
        new[name] = flat.view(t.shape)
    return new


def parts_of(workers: Sequence[InProcessWorker], name: str) -> list[tuple[int, int, int] | None]:
    """Each distinct part the workers keep of ``name`` (their manifests' pieces, or whole)."""
    out: list[tuple[int, int, int] | None] = []
    for w in workers:
        owned = w.adapter.manifest().tensors.get(name)
        if owned is not None:
            out.extend([(p.dim, p.offset, p.length) for p in owned.pieces] or [None])
    return list(dict.fromkeys(out))


def result_checksums(t: torch.Tensor, parts, algorithm=CRC) -> list[pb.DeltaChecksum]:
    out = []
    for part in parts:
        view = t if part is None else t.narrow(*part)
        msg = pb.DeltaChecksum(checksum=pb.Checksum(algorithm=algorithm, value=checksum(view, algorithm)))
        if part is not None:
            msg.piece.CopyFrom(pb.TensorPiece(dim=part[0], offset=part[1], length=part[2]))
        out.append(msg)
    return out


def delta_bucket(
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    workers: Sequence[InProcessWorker],
    *,
    algorithm: int = CRC,
) -> tuple[list[pb.TensorSpec], torch.Tensor]:
    """What the trainer sends: one TensorSpec per tensor with its TensorDelta (packed by
    ``pack_delta`` at a 64-byte aligned offset) and a result checksum per part a recipient keeps."""
    deltas = {name: encode(old[name], new[name]) for name in new}
    offsets, end = {}, 0
    for name, d in deltas.items():
        offsets[name] = -(-end // 64) * 64
        end = offsets[name] + packed_size_bytes(d, offsets[name])
    buffer = torch.zeros(max(end, 1), dtype=torch.uint8)
    specs = []
    for name, d in deltas.items():
        msg = pack_delta(
            d, buffer, offsets[name], result_checksums(new[name], parts_of(workers, name), algorithm)
        )
        specs.append(
            pb.TensorSpec(
                name=name,
                dtype=dtypes.from_torch(new[name].dtype),
                shape=list(new[name].shape),
                offset_bytes=offsets[name],
                delta=msg,
            )
        )
    return specs, buffer


def payload_of(buffer: torch.Tensor, segments: ShmSegments | None) -> pb.Payload:
    data = buffer.numpy().tobytes()
    if segments is None:
        return inline_payload(data)
    return shm_payload(segments.create(data), len(data))


def full_push(workers: Sequence[InProcessWorker], full: dict[str, torch.Tensor]) -> int:
    version = next(_versions)
    for w in workers:
        out = push(w.stub(), full_update_requests(version, full, None, buckets=1))
        assert out.code == grpc.StatusCode.OK, out.message
        assert out.result is not None and out.result.encoding == pb.UPDATE_ENCODING_FULL
    return version


def delta_push(w: InProcessWorker, base: int, specs, payload, *, version: int | None = None, **kw):
    version = version if version is not None else next(_versions)
    hdr = header(version, delta_base=pb.DeltaBase(base_version=base), **kw)
    return push(w.stub(), [hdr, bucket(0, specs, [payload]), commit(1)]), version


def holds(w: InProcessWorker, full: dict[str, torch.Tensor]) -> bool:
    state = w.state()
    return all(torch.equal(state[n], t) for n, t in expected_shard(full, w.rank, w.config).items())


def status(w: InProcessWorker) -> pb.GetStatusResponse:
    return w.stub().GetStatus(pb.GetStatusRequest())


def refused_untouched(
    w: InProcessWorker, out, reason: str, full: dict[str, torch.Tensor], version: int
) -> None:
    assert out.code != grpc.StatusCode.OK and out.reason == reason, (out.code, out.reason, out.message)
    st = status(w)
    assert (st.weights_version, st.state) == (version, pb.WORKER_STATE_CONSISTENT)
    assert holds(w, full)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_delta_lands_bit_exact(one: InProcessWorker, segments: ShmSegments, transport: str) -> None:
    old = full_checkpoint(one.config, 11)
    base = full_push([one], old)
    new = stepped(old, 1)
    specs, buffer = delta_bucket(old, new, [one])
    out, version = delta_push(one, base, specs, payload_of(buffer, segments if transport == "shm" else None))
    assert out.code == grpc.StatusCode.OK, out.message
    r = out.result
    assert r is not None and (r.version, r.previous_version, r.state) == (
        version,
        base,
        pb.WORKER_STATE_CONSISTENT,
    )
    assert (r.encoding, r.base_version) == (pb.UPDATE_ENCODING_DELTA, base)
    changed = sum(int((old[n] != new[n]).sum()) for n in new)
    assert (r.delta_tensors, r.changed_elements, r.result_checksums_verified) == (len(new), changed, len(new))
    assert r.bytes_loaded < buffer.numel() + 64 * len(new) and r.tensors_loaded == len(new)
    encodings = {s.delta.encoding for s in specs}
    assert encodings == {pb.DELTA_ENCODING_INDICES, pb.DELTA_ENCODING_BITMAP, pb.DELTA_ENCODING_DENSE}
    assert holds(one, new) and status(one).weights_version == version


def test_tp2_each_worker_applies_its_piece(tp2: list[InProcessWorker]) -> None:
    """One bucket for both ranks, the weighted sum as the checksum: each keeps only its slice."""
    old = full_checkpoint(tp2[0].config, 12)
    base = full_push(tp2, old)
    new = stepped(old, 2)
    specs, buffer = delta_bucket(old, new, tp2, algorithm=WSUM)
    split = [s for s in specs if len(s.delta.result_checksums) == 2]
    assert split, "the split tensors carry one checksum per rank's piece"
    version = next(_versions)
    for w in tp2:
        out, _ = delta_push(w, base, specs, inline_payload(buffer.numpy().tobytes()), version=version)
        assert out.code == grpc.StatusCode.OK, out.message
        assert out.result is not None and out.result.result_checksums_verified == len(new)
        assert holds(w, new) and not holds(w, old)


def test_wrong_base_is_refused_at_the_header(one: InProcessWorker) -> None:
    old = full_checkpoint(one.config, 13)
    base = full_push([one], old)
    specs, buffer = delta_bucket(old, stepped(old, 3), [one])
    out, _ = delta_push(one, base - 1, specs, inline_payload(buffer.numpy().tobytes()))
    refused_untouched(one, out, "DELTA_BASE_MISMATCH", old, base)
    assert (out.metadata["base_version"], out.metadata["worker_version"]) == (str(base - 1), str(base))
    assert out.code == grpc.StatusCode.FAILED_PRECONDITION
    # Version 0 is the weights a worker started with: never a base (a restarted worker is there).
    fresh = start_demo_worker(seed=0)
    try:
        start = full_checkpoint(fresh.config, 0)
        specs, buffer = delta_bucket(start, stepped(start, 3), [fresh])
        out, _ = delta_push(fresh, 0, specs, inline_payload(buffer.numpy().tobytes()))
        refused_untouched(fresh, out, "DELTA_BASE_MISMATCH", start, 0)
    finally:
        fresh.server.stop(grace=0)  # type: ignore[attr-defined]


def _indices_spec(specs: list[pb.TensorSpec]) -> pb.TensorSpec:
    return next(
        s for s in specs if s.delta.encoding == pb.DELTA_ENCODING_INDICES and s.delta.changed_count > 1
    )


def _bitmap_spec(specs: list[pb.TensorSpec]) -> pb.TensorSpec:
    return next(s for s in specs if s.delta.encoding == pb.DELTA_ENCODING_BITMAP)


def _past_the_tensor(specs, buffer):
    s = _indices_spec(specs)
    at = s.offset_bytes + 4 * (s.delta.changed_count - 1)  # the last int32 index
    n = 1
    for d in s.shape:
        n *= d
    buffer[at : at + 4] = torch.tensor([n], dtype=torch.int32).view(torch.uint8)


def _unsorted(specs, buffer):
    s = _indices_spec(specs)
    first = buffer[s.offset_bytes : s.offset_bytes + 8].clone()
    buffer[s.offset_bytes : s.offset_bytes + 4] = first[4:8]
    buffer[s.offset_bytes + 4 : s.offset_bytes + 8] = first[0:4]


def _duplicate(specs, buffer):
    s = _indices_spec(specs)
    buffer[s.offset_bytes + 4 : s.offset_bytes + 8] = buffer[s.offset_bytes : s.offset_bytes + 4].clone()


def _count_past_n(specs, buffer):
    s = _indices_spec(specs)
    s.delta.changed_count = 10**9


def _bitmap_count(specs, buffer):
    _bitmap_spec(specs).delta.changed_count -= 1


def _index_dtype(specs, buffer):
    _indices_spec(specs).delta.index_dtype = pb.DTYPE_FLOAT32


def _values_outside(specs, buffer):
    _indices_spec(specs).delta.values_offset_bytes = buffer.numel() + 128


def _no_checksum(specs, buffer):
    del _indices_spec(specs).delta.result_checksums[:]


def _dense_short(specs, buffer):
    s = next(s for s in specs if s.delta.encoding == pb.DELTA_ENCODING_DENSE)
    s.delta.changed_count -= 1


HOSTILE = {
    "index past the tensor": _past_the_tensor,
    "indices not ascending": _unsorted,
    "an index twice": _duplicate,
    "count past the elements": _count_past_n,
    "bitmap count differs": _bitmap_count,
    "index dtype float": _index_dtype,
    "values outside the payload": _values_outside,
    "no result checksum": _no_checksum,
    "dense count short": _dense_short,
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_delta_is_refused_before_any_write(one: InProcessWorker, case: str) -> None:
    old = full_checkpoint(one.config, 14)
    base = full_push([one], old)
    specs, buffer = delta_bucket(old, stepped(old, 4), [one])
    HOSTILE[case](specs, buffer)
    out, _ = delta_push(one, base, specs, inline_payload(buffer.numpy().tobytes()))
    refused_untouched(one, out, "INVALID_DELTA", old, base)
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT


def test_delta_without_a_base_and_delta_over_other_transports(one: InProcessWorker) -> None:
    old = full_checkpoint(one.config, 15)
    base = full_push([one], old)
    specs, buffer = delta_bucket(old, stepped(old, 5), [one])
    data = buffer.numpy().tobytes()
    no_base = push(one.stub(), [header(next(_versions)), bucket(0, specs, [inline_payload(data)]), commit(1)])
    refused_untouched(one, no_base, "INVALID_DELTA", old, base)
    assert "delta base" in no_base.message
    # CUDA IPC carries tensors whole (the worker copies from the trainer's memory): refused before
    # any handle is opened. (A transfer group's single-source buckets carry deltas:
    # tests/distributed/test_group_deltas.py.)
    ipc = pb.Payload(
        device=pb.DeviceId(kind=pb.DEVICE_KIND_CUDA, uuid="GPU-0"),
        size_bytes=len(data),
        cuda_ipc=pb.CudaIpcHandle(memory_handle=b"x", storage_size_bytes=len(data)),
    )
    out, _ = delta_push(one, base, specs, ipc)
    refused_untouched(one, out, "INVALID_DELTA", old, base)
    assert "host shared memory, a transfer group (torch.distributed) or inline bytes" in out.message
    # Nor a region of an every-rank-a-source bucket in an update without a base (with one, a
    # region's delta is received and applied: tests/distributed/test_slice_deltas.py).
    region = pb.SliceTransfer(tensor=specs[0].name, delta=specs[0].delta)
    slices = pb.Payload(
        device=inline_payload(b"").device,
        transfer_group=pb.TransferGroupHandle(group_id="g", mode=pb.TRANSFER_MODE_SLICES, slices=[region]),
    )
    out = push(one.stub(), [header(next(_versions)), bucket(0, [], [slices]), commit(1)])
    refused_untouched(one, out, "INVALID_DELTA", old, base)
    assert "every trainer rank is a source" in out.message and "without delta_base" in out.message


def test_drifted_worker_is_caught_and_says_inconsistent(one: InProcessWorker) -> None:
    old = full_checkpoint(one.config, 16)
    base = full_push([one], old)
    new = stepped(old, 6)
    name = next(n for n in new if torch.equal(old[n], new[n]))  # a tensor the delta leaves as it is
    with torch.no_grad():
        one.adapter.state()[name].view(-1)[0] += 1.0  # memory changed behind the worker's back
    specs, buffer = delta_bucket(old, new, [one])
    out, _ = delta_push(one, base, specs, inline_payload(buffer.numpy().tobytes()))
    assert out.reason == "DELTA_RESULT_MISMATCH" and out.code == grpc.StatusCode.DATA_LOSS, out.message
    assert out.metadata["tensor"] == name
    st = status(one)
    assert (st.weights_version, st.state) == (base, pb.WORKER_STATE_INCONSISTENT)
    # Mixed weights are no base: the next delta is refused at the header, a FULL brings it back.
    again, _ = delta_push(one, base, specs, inline_payload(buffer.numpy().tobytes()))
    assert again.reason == "DELTA_BASE_MISMATCH", again.message
    full_push([one], new)
    assert holds(one, new) and status(one).state == pb.WORKER_STATE_CONSISTENT


class _WholeOnly:
    """An engine adapter that loads whole tensors only (as the SGLang and vLLM adapters do now)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def manifest(self):
        return self.inner.manifest()

    def begin_update(self, version: int) -> None:
        self.inner.begin_update(version)

    def load(self, named_tensors) -> None:
        self.inner.load(named_tensors)

    def end_update(self, success: bool) -> None:
        self.inner.end_update(success)


def test_adapter_without_the_ability_refuses_at_the_header() -> None:
    from weightwire.server import serve

    source = start_demo_worker(seed=3)
    server = serve(_WholeOnly(source.adapter))  # type: ignore[arg-type]
    try:
        w = InProcessWorker(server, source.adapter, source.rank, source.config)
        old = full_checkpoint(w.config, 17)
        base = full_push([w], old)
        specs, buffer = delta_bucket(old, stepped(old, 7), [w])
        out, _ = delta_push(w, base, specs, inline_payload(buffer.numpy().tobytes()))
        refused_untouched(w, out, "DELTA_BASE_MISMATCH", old, base)
        assert out.metadata["applies_deltas"] == "false"
    finally:
        server.stop(grace=0)  # type: ignore[attr-defined]
        source.server.stop(grace=0)  # type: ignore[attr-defined]
