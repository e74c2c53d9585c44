"""Memory on the trainer stays bounded by the bucket size, not the model: two gloo ranks push an
FSDP2 model many times larger than a bucket, and each rank's peak RSS growth over the push is
measured in bytes (``/proc/self/clear_refs`` resets the peak, ``VmHWM`` reads it).

The same ranks then push the way a hand-written loop often does (every DTensor's ``full_tensor()``
first, then one push of plain tensors): its growth is at least the model's size, which shows the
measurement sees a whole-model gather when there is one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fsdp_ranks import Fleet, RankRun, labelled_fleet, run_ranks
from weightwire.adapters.torch.demo import DemoConfig, checkpoint_shapes

# About 250 MiB of float32 in tensors of at most 4 MiB: fifteen 16 MiB buckets.
CONFIG = DemoConfig(num_layers=16, hidden_size=512, intermediate_size=2048, vocab_size=2048)
CONFIG_ARGS = [
    "--num-layers",
    "16",
    "--hidden-size",
    "512",
    "--intermediate-size",
    "2048",
    "--vocab-size",
    "2048",
]
BUCKET_BYTES = 16 * 1024 * 1024
pytestmark = pytest.mark.timeout(900)
PIPELINE_DEPTH = 2  # WeightPusher's default: this many staging buffers at most
# Python, gRPC and torch bookkeeping of one push, whatever the model (threads, messages, manifests).
ALLOWANCE_BYTES = 24 * 1024 * 1024


def model_bytes() -> int:
    n = 0
    for shape in checkpoint_shapes(CONFIG).values():
        size = 4
        for d in shape:
            size *= d
        n += size
    return n


def largest_tensor_bytes() -> int:
    return max(4 * _numel(s) for s in checkpoint_shapes(CONFIG).values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = labelled_fleet(
        1, 1, str(tmp_path_factory.mktemp("big")), labels=[None], config_args=CONFIG_ARGS, config=CONFIG
    )
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def measured(worker: Fleet, tmp_path_factory: pytest.TempPathFactory) -> RankRun:
    version = worker.next_version()
    common = {
        "kind": "push",
        "endpoints": worker.endpoints,
        "bucket_size_bytes": BUCKET_BYTES,
        "measure_memory": True,
        "config": {"num_layers": 16, "hidden_size": 512, "intermediate_size": 2048, "vocab_size": 2048},
    }
    scenarios = [
        {"name": "per_bucket", "version": version, "seed": version, **common},
        {
            "name": "whole_model",
            "version": version + 1,
            "seed": version + 1,
            "source": "full_tensors",
            **common,
        },
    ]
    # A fixed mmap threshold: every allocation of 64 KiB or more is its own mapping, given back to the
    # system when freed, so RSS follows what is alive (glibc otherwise raises the threshold as it goes
    # and keeps freed tensors in its heap).
    run = run_ranks(
        2, scenarios, str(tmp_path_factory.mktemp("memory")), env={"MALLOC_MMAP_THRESHOLD_": "65536"}
    )
    assert run.returncodes == [0, 0], run.explain()
    worker.assert_dumps(version, seed=version)
    worker.assert_dumps(version + 1, seed=version + 1)
    return run


def growth_bytes(record: dict) -> int:
    assert record["ok"], record.get("error")
    return (record["peak_kib"] - record["before_kib"]) * 1024


def test_model_is_many_buckets() -> None:
    assert model_bytes() > 12 * BUCKET_BYTES and largest_tensor_bytes() <= BUCKET_BYTES // 4


def test_peak_rss_growth_is_bounded_by_the_bucket_size(measured: RankRun) -> None:
    # The staging buffers (the rank that packs), one tensor's gathered value and this rank's padded
    # shard of it (every rank), and the allowance; nothing that grows with the model.
    bound = PIPELINE_DEPTH * BUCKET_BYTES + 2 * largest_tensor_bytes() + ALLOWANCE_BYTES
    for rank, record in enumerate(measured.of("per_bucket")):
        grew = growth_bytes(record)
        print(
            f"rank {rank}: peak RSS growth {grew / 2**20:.1f} MiB (bound {bound / 2**20:.1f} MiB, model {model_bytes() / 2**20:.1f} MiB)"
        )
        assert grew <= bound, f"rank {rank} grew {grew} bytes, bound {bound}"


def test_a_whole_model_gather_shows_in_the_measurement(measured: RankRun) -> None:
    for rank, (ours, whole) in enumerate(
        zip(measured.of("per_bucket"), measured.of("whole_model"), strict=True)
    ):
        print(f"rank {rank}: whole-model gather grew {growth_bytes(whole) / 2**20:.1f} MiB")
        assert growth_bytes(whole) >= 0.9 * model_bytes()
        assert growth_bytes(ours) * 3 < growth_bytes(whole)
