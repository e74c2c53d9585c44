"""``WeightPusher.push(delta=True)`` into two real TP=2 gRPC workers (the demo model in bf16):
a real AdamW step on fp32 master weights between pushes, bf16 sent; after each push every worker
holds the trainer's tensors bit-exactly, from the second push on as a DELTA far smaller than the
model; a worker set to another version by a FULL push from elsewhere makes the next delta push go
whole by itself and land; a pusher over CUDA IPC would send FULL (over a transfer group deltas go
as here: tests/distributed/test_group_deltas.py). A worker that keeps whole tensors and lists
CRC32C gets CRC-32C result checksums (the trainer's one pass per tensor) and still catches a
drifted norm; one whose manifest lists no algorithm (a worker from before the field) gets CRC-32."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import InProcessWorker, delta_algorithms_sent
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import (
    DEMO_TP_RULES,
    DemoConfig,
    build_demo_model,
    expected_shard,
    full_checkpoint,
)
from weightwire.client import WeightPusher
from weightwire.core.errors import PushError, Reason
from weightwire.core.manifest import ParallelRank
from weightwire.v1 import weight_transfer_pb2 as pb

CONFIG = DemoConfig(dtype=torch.bfloat16)


def _worker(rank: ParallelRank) -> InProcessWorker:
    from weightwire.server import serve

    model = build_demo_model(CONFIG, rank, "cpu", 0)
    adapter = TorchAdapter(
        model,
        rank=rank,
        device=torch.device("cpu"),
        own_device=None,
        tp_rules=DEMO_TP_RULES,
        num_layers=CONFIG.num_layers,
    )
    return InProcessWorker(serve(adapter), adapter, rank, CONFIG)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tp2() -> Iterator[list[InProcessWorker]]:
    workers = [_worker(ParallelRank(tp_rank=r, tp_size=2)) for r in range(2)]
    yield workers
    for w in workers:
        w.server.stop(grace=0)  # type: ignore[attr-defined]


class Trainer:
    """fp32 master weights of the demo checkpoint and a real AdamW step on a real loss."""

    def __init__(self) -> None:
        full = full_checkpoint(DemoConfig(), seed=3)
        self.params = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=2e-6, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(0)

    def step(self) -> None:
        self.opt.zero_grad()
        loss = sum(
            ((p - torch.randn(p.shape, generator=self.gen) * 0.02) ** 2).mean() for p in self.params.values()
        )
        loss.backward()  # type: ignore[union-attr]
        self.opt.step()

    def bf16(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16) for n, p in self.params.items()}


def _assert_hold(workers: list[InProcessWorker], full: dict[str, torch.Tensor]) -> None:
    for w in workers:
        want = expected_shard(full, w.rank, CONFIG)
        got = w.state()
        for name, t in want.items():
            assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), (w.rank, name)


@pytest.mark.parametrize("transport", ["host_shm", "inline"])
def test_delta_pushes_land_bit_exactly(tp2: list[InProcessWorker], transport: str) -> None:
    trainer = Trainer()
    full_bytes = sum(t.nbytes for t in trainer.bf16().values())
    base = 100 if transport == "inline" else 0
    with WeightPusher([w.address for w in tp2], transport=transport) as pusher:
        for i in range(5):
            if i:
                trainer.step()
            results = pusher.push(
                trainer.params.items(), version=base + i + 1, cast_to=torch.bfloat16, delta=True
            )
            _assert_hold(tp2, trainer.bf16())
            for r in results.values():
                assert r.version == base + i + 1
                if i == 0:
                    assert (r.encoding, r.delta_fallback) == ("FULL", "NO_BASE")
                else:
                    assert (r.encoding, r.delta_fallback) == ("DELTA", "NONE")
                    assert r.encoded_bytes < full_bytes * 0.3, (r.encoded_bytes, full_bytes)


def test_a_worker_moved_elsewhere_makes_the_next_push_full(tp2: list[InProcessWorker]) -> None:
    trainer = Trainer()
    addresses = [w.address for w in tp2]
    with WeightPusher(addresses) as pusher, WeightPusher(addresses) as other:
        pusher.push(trainer.params.items(), version=201, cast_to=torch.bfloat16, delta=True)
        trainer.step()
        assert {
            r.encoding
            for r in pusher.push(
                trainer.params.items(), version=202, cast_to=torch.bfloat16, delta=True
            ).values()
        } == {"DELTA"}
        # Another trainer's FULL update: the workers no longer hold this pusher's base.
        other.push(full_checkpoint(CONFIG, seed=9), version=203)
        trainer.step()
        results = pusher.push(trainer.params.items(), version=204, cast_to=torch.bfloat16, delta=True)
        assert {(r.encoding, r.delta_fallback) for r in results.values()} == {("FULL", "BASE_MISMATCH")}
        _assert_hold(tp2, trainer.bf16())
        trainer.step()
        results = pusher.push(trainer.params.items(), version=205, cast_to=torch.bfloat16, delta=True)
        assert {r.encoding for r in results.values()} == {"DELTA"}
        _assert_hold(tp2, trainer.bf16())


def test_a_drifted_worker_fails_the_delta_and_the_next_push_is_full(tp2: list[InProcessWorker]) -> None:
    trainer = Trainer()
    with WeightPusher([w.address for w in tp2]) as pusher:
        pusher.push(trainer.params.items(), version=301, cast_to=torch.bfloat16, delta=True)
        # Weights changed behind the trainer's back: the version and state still say the base.
        name = "model.layers.0.mlp.down_proj.weight"
        with torch.no_grad():
            tp2[1].adapter.state()[name].view(-1)[:3] += 1.0
        trainer.step()
        with pytest.raises(PushError) as raised:
            pusher.push(trainer.params.items(), version=302, cast_to=torch.bfloat16, delta=True)
        assert any(e.kind is Reason.DELTA_RESULT_MISMATCH for e in raised.value.failures.values())
        assert pusher.delta_keeper.base_version is None
        results = pusher.push(trainer.params.items(), version=303, cast_to=torch.bfloat16, delta=True)
        assert {(r.encoding, r.delta_fallback) for r in results.values()} == {("FULL", "NO_BASE")}
        _assert_hold(tp2, trainer.bf16())


@pytest.fixture(scope="module")
def whole() -> Iterator[InProcessWorker]:
    worker = _worker(ParallelRank())
    yield worker
    worker.server.stop(grace=0)  # type: ignore[attr-defined]


def _verified(worker: InProcessWorker) -> int:
    """The result checksums the worker verified in its last update."""
    return worker.stub().GetStatus(pb.GetStatusRequest()).last_result.result_checksums_verified


def test_a_worker_that_lists_crc32c_gets_it_and_a_drift_is_still_caught(whole: InProcessWorker) -> None:
    trainer = Trainer()
    with WeightPusher([whole.address]) as pusher:
        (manifest,) = pusher.manifests().values()
        assert pb.CHECKSUM_ALGORITHM_CRC32C in manifest.delta_checksum_algorithms
        seen = delta_algorithms_sent(pusher)
        pusher.push(trainer.params.items(), version=401, cast_to=torch.bfloat16, delta=True)
        for version in (402, 403):
            trainer.step()
            (r,) = pusher.push(
                trainer.params.items(), version=version, cast_to=torch.bfloat16, delta=True
            ).values()
            assert r.encoding == "DELTA" and _verified(whole) == len(trainer.params)
            _assert_hold([whole], trainer.bf16())
        assert seen == [pb.CHECKSUM_ALGORITHM_CRC32C] * 2
        # A norm changed behind the trainer's back (the tensor a step moves least): caught.
        with torch.no_grad():
            whole.adapter.state()["model.layers.0.input_layernorm.weight"].view(-1)[0] += 1.0
        trainer.step()
        with pytest.raises(PushError) as raised:
            pusher.push(trainer.params.items(), version=404, cast_to=torch.bfloat16, delta=True)
        assert any(e.kind is Reason.DELTA_RESULT_MISMATCH for e in raised.value.failures.values())
        (r,) = pusher.push(trainer.params.items(), version=405, cast_to=torch.bfloat16, delta=True).values()
        assert (r.encoding, r.delta_fallback) == ("FULL", "NO_BASE")
        _assert_hold([whole], trainer.bf16())


def test_a_worker_from_before_crc32c_gets_crc32(whole: InProcessWorker) -> None:
    # Stand-in for a worker from before ShardManifest.delta_checksum_algorithms (none can run
    # here): this worker's published manifest without the field.
    service: Any = whole.service
    get_manifest = service.get_manifest

    def without_field() -> pb.GetManifestResponse:
        resp = get_manifest()
        del resp.manifest.delta_checksum_algorithms[:]
        return resp

    service.get_manifest = without_field
    try:
        trainer = Trainer()
        with WeightPusher([whole.address]) as pusher:
            (manifest,) = pusher.manifests().values()
            assert manifest.delta_checksum_algorithms == ()
            seen = delta_algorithms_sent(pusher)
            pusher.push(trainer.params.items(), version=501, cast_to=torch.bfloat16, delta=True)
            trainer.step()
            (r,) = pusher.push(
                trainer.params.items(), version=502, cast_to=torch.bfloat16, delta=True
            ).values()
            assert r.encoding == "DELTA" and _verified(whole) == len(trainer.params)
            assert seen == [pb.CHECKSUM_ALGORITHM_CRC32]
            _assert_hold([whole], trainer.bf16())
    finally:
        del service.get_manifest
