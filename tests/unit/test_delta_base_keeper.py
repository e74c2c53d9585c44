"""The trainer's base keeper: FULL first, deltas after each commit, FULL again after a refusal.

A trainer and a worker (plain tensors on both sides, the worker's checks from ``verify``) run 20
steps of sparse bf16 changes: after each the worker's weights equal the trainer's bit for bit, and a
worker restarted mid-run is refused as a delta target and brought back by the FULL that follows.
"""

from __future__ import annotations

import pytest
import torch
from weightwire.core.delta import BaseKeeper, apply_delta, check_base, checksum, verify_result
from weightwire.core.delta import checksums as ck
from weightwire.core.errors import WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb

SHAPES = {"embed": (64, 32), "layer.0.weight": (32, 32), "layer.0.bias": (32,), "head": (16, 32)}


def model(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in SHAPES.items()}


class Worker:
    """A worker's side of the contract on plain tensors: its version, state, and the two checks."""

    def __init__(self) -> None:
        self.weights = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
        self.version = 0
        self.consistent = True

    def take(self, version: int, base: int | None, sent: dict, algorithm: int) -> None:
        if base is not None:
            check_base(base, self.version, consistent=self.consistent)
        for name, (delta, whole, want) in sent.items():
            if delta is None:
                self.weights[name].copy_(whole)
            else:
                apply_delta(self.weights[name], delta, tensor=name)
                sums = [pb.DeltaChecksum(checksum=pb.Checksum(algorithm=algorithm, value=want))]  # type: ignore[arg-type]
                verify_result(sums, [(None, self.weights[name])], tensor=name)
        self.version = version


def push(
    keeper: BaseKeeper, trainer: dict[str, torch.Tensor], worker: Worker, version: int, algorithm: int
) -> str:
    """One update: a delta when the keeper has a base and the worker takes it, else FULL."""
    keeper.begin(version)
    sent = {}
    for name, t in trainer.items():
        delta = keeper.diff(name, t)
        keeper.record(name, t, delta)
        sent[name] = (delta, t, keeper.result_checksum(name, algorithm))
    base = keeper.base_version
    try:
        worker.take(
            version, base if all(d is not None for d, _, _ in sent.values()) else None, sent, algorithm
        )
    except WeightwireError:
        keeper.drop()
        raise
    keeper.commit(version)
    return "FULL" if base is None else "DELTA"


def step(trainer: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """A sparse change of a few percent of the elements, as a small learning rate gives."""
    for t in trainer.values():
        mask = torch.rand(t.shape, generator=gen) < 0.03
        t[mask] = (t[mask].float() + 0.25).to(torch.bfloat16)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


@pytest.mark.parametrize(
    "algorithm",
    [pb.CHECKSUM_ALGORITHM_CRC32, pb.CHECKSUM_ALGORITHM_CRC32C, pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64],
)
def test_twenty_steps_bit_identical_and_a_restart_brought_back(algorithm: int) -> None:
    keeper, trainer, worker = BaseKeeper(), model(0), Worker()
    gen = torch.Generator().manual_seed(1)
    kinds = []
    for version in range(1, 21):
        if version == 11:
            worker = Worker()  # restarted: version 0, fresh weights
            with pytest.raises(WeightwireError) as info:
                push(keeper, trainer, worker, version, algorithm)
            assert info.value.reason == "DELTA_BASE_MISMATCH"
            assert keeper.base_version is None and worker.version == 0
            assert same(worker.weights, {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()})
        kinds.append(push(keeper, trainer, worker, version, algorithm))
        assert worker.version == version and keeper.base_version == version
        assert same(worker.weights, trainer)
        step(trainer, gen)
    assert kinds == ["FULL"] + ["DELTA"] * 9 + ["FULL"] + ["DELTA"] * 9


@pytest.mark.parametrize("algorithm", [pb.CHECKSUM_ALGORITHM_CRC32, pb.CHECKSUM_ALGORITHM_CRC32C])
def test_a_worker_that_drifted_is_caught_by_the_result_checksum(algorithm: int) -> None:
    keeper, trainer, worker = BaseKeeper(), model(0), Worker()
    push(keeper, trainer, worker, 1, algorithm)
    worker.weights["head"][0, 0] += 1  # something else wrote into the model
    step(trainer, torch.Generator().manual_seed(2))
    with pytest.raises(WeightwireError) as info:
        push(keeper, trainer, worker, 2, algorithm)
    assert info.value.reason == "DELTA_RESULT_MISMATCH"
    assert push(keeper, trainer, worker, 3, algorithm) == "FULL"
    assert same(worker.weights, trainer)


def test_the_base_advances_only_at_commit_and_a_drop_keeps_the_memory() -> None:
    keeper, trainer = BaseKeeper(), model(0)
    with pytest.raises(RuntimeError):
        keeper.diff("embed", trainer["embed"])
    keeper.begin(1)
    for name, t in trainer.items():
        assert keeper.diff(name, t) is None
        keeper.record(name, t)
    assert keeper.base_version is None and keeper.pending_version == 1
    nbytes = sum(t.numel() * 2 for t in trainer.values())
    assert keeper.memory().host_bytes == nbytes and keeper.memory().device_bytes == 0
    with pytest.raises(RuntimeError):
        keeper.commit(2)
    keeper.commit(1)
    with pytest.raises(ValueError):
        keeper.begin(1)  # not after the base
    # the kept copy is a copy: the trainer changing its tensor later changes nothing kept
    trainer["embed"][0, 0] += 1
    keeper.begin(2)
    delta = keeper.diff("embed", trainer["embed"])
    assert delta is not None and delta.changed_count == 1
    # a refusal: no base any more, nothing freed
    keeper.drop()
    assert keeper.base_version is None and keeper.memory().host_bytes == nbytes
    keeper.begin(3)
    assert keeper.diff("embed", trainer["embed"]) is None
    # only what the FULL after a drop recorded is a base again (a PARTIAL one recorded one tensor)
    keeper.record("embed", trainer["embed"])
    keeper.commit(3)
    keeper.begin(4)
    assert keeper.diff("embed", trainer["embed"]) is not None
    assert keeper.diff("head", trainer["head"]) is None
    # a tensor whose shape changed is sent whole and kept anew
    assert keeper.diff("embed", torch.zeros(3, dtype=torch.bfloat16)) is None
    keeper.release()
    assert keeper.memory().tensors == 0


def test_a_pending_update_is_dropped_by_the_next_begin() -> None:
    keeper, trainer = BaseKeeper(), model(0)
    keeper.begin(1)
    keeper.record("embed", trainer["embed"])
    keeper.commit(1)
    keeper.begin(2)
    keeper.record("embed", trainer["embed"])
    keeper.begin(3)  # version 2's outcome never came
    assert keeper.base_version is None
    assert keeper.diff("embed", trainer["embed"]) is None


def test_result_checksums_of_a_piece() -> None:
    keeper, trainer = BaseKeeper(), model(0)
    keeper.begin(1)
    keeper.record("embed", trainer["embed"])
    for algorithm in (pb.CHECKSUM_ALGORITHM_CRC32, pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64):
        got = keeper.result_checksum("embed", algorithm, piece=(1, 8, 8))  # type: ignore[arg-type]
        assert got == checksum(trainer["embed"][:, 8:16], algorithm)  # type: ignore[arg-type]
    assert keeper.result_checksum("embed", pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64) == ck.weighted_sum64(
        trainer["embed"]
    )


def test_a_device_budget_needs_a_cuda_tensor() -> None:
    keeper = BaseKeeper(device_budget_bytes=1 << 30)
    keeper.begin(1)
    keeper.record("w", torch.ones(4))
    assert keeper.memory().host_bytes == 16 and keeper.memory().device_bytes == 0
    with pytest.raises(ValueError):
        BaseKeeper(device_budget_bytes=-1)


def test_result_checksums_cover_every_recipients_part_once() -> None:
    """What a TensorDelta carries: the whole tensor and each tensor-parallel piece, each once, and a
    worker keeping any one of them verifies it."""
    keeper, trainer = BaseKeeper(), model(0)
    keeper.begin(1)
    keeper.record("embed", trainer["embed"])
    parts = [None, (0, 0, 32), (0, 32, 32), (0, 0, 32)]
    sums = keeper.result_checksums("embed", pb.CHECKSUM_ALGORITHM_CRC32, parts)
    assert len(sums) == 3 and not sums[0].HasField("piece") and sums[2].piece.offset == 32
    for part in (None, (0, 0, 32), (0, 32, 32)):
        view = trainer["embed"] if part is None else trainer["embed"].narrow(*part)
        assert verify_result(sums, [(part, view.clone())], tensor="embed") == 1


def test_kept_copies_of_parameters_stay_out_of_autograd() -> None:
    keeper = BaseKeeper()
    param = torch.nn.Parameter(torch.randn(8, 4).to(torch.bfloat16))
    keeper.begin(1)
    keeper.record("w", param)
    keeper.commit(1)
    with torch.no_grad():
        param[0, 0] += 1
    keeper.begin(2)
    delta = keeper.diff("w", param)
    assert delta is not None and delta.changed_count == 1
    keeper.record("w", param, delta)
    assert keeper.result_checksum("w", pb.CHECKSUM_ALGORITHM_CRC32) == ck.crc32(param)
    assert not keeper._kept["w"].copy.requires_grad
