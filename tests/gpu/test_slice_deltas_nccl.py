"""Delta updates with every trainer rank a source over NCCL: two FSDP2 trainer ranks
(``tests/distributed/slice_trainer.py --backend nccl``, on GPUs 0 and 1, their regions diffed and
packed on their GPU) into a TP2 pair of ``weightwire serve --device cuda`` workers on GPUs 2 and 3,
which receive the streams of encodings into GPU memory and apply them there at the commit: a FULL
push, then sparse deltas bit for bit, each worker having received only its regions' encodings.

The same code path as the gloo test (tests/distributed/test_slice_deltas.py), the backend aside.
NCCL refuses two members of one group on one GPU, and every rank a source needs at least two
trainer ranks besides the workers, so this needs four GPUs (marker gpu4; ``make test-gpu``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gpu_procs import needs_gpus

pytestmark = [pytest.mark.gpu4, needs_gpus(4)]

HERE = Path(__file__).resolve().parents[1]


def test_deltas_from_every_rank_over_nccl_are_bit_exact(tmp_path: Path) -> None:
    sys.path[:0] = [str(HERE), str(HERE / "distributed")]
    import torch
    from helpers import demo_args, load_dump, spawn_worker
    from slice_ranks import Ranks
    from sparse_checkpoint import stepped
    from weightwire.adapters.torch.demo import DemoConfig, expected_shard
    from weightwire.core.manifest import ParallelRank

    config = DemoConfig()
    dumps = tmp_path / "dumps"
    workers = [
        spawn_worker(
            *demo_args(tp=(t, 2), dump_dir=dumps, extra=["--device", "cuda"]),
            env={"CUDA_VISIBLE_DEVICES": str(2 + t)},
        )
        for t in range(2)
    ]
    ranks = None
    try:
        ranks = Ranks(2, [w.address for w in workers], "--backend", "nccl", "--group-timeout", "60")
        steps: list[int] = []
        full_bytes: dict[str, int] = {}
        for version in (1, 2, 3):
            if version > 1:
                steps.append(version)
            answers = ranks.push(version=version, seed=1, steps=steps, delta=True)
            assert all(a["ok"] for a in answers), answers
            results = answers[0]["results"]
            assert all(a["results"] == results for a in answers)
            full = stepped(config, 1, steps)
            for t, w in enumerate(workers):
                r = results[w.address]
                assert (r["state"], r["transport"]) == ("CONSISTENT", "transfer_group")
                assert r["encoding"] == ("FULL" if version == 1 else "DELTA"), r
                if version == 1:
                    full_bytes[w.address] = r["bytes_received"]
                else:
                    assert r["bytes_received"] == r["encoded_bytes"] < full_bytes[w.address] // 10
                got = load_dump(dumps, f"tp{t}-pp0", version)
                want = expected_shard(full, ParallelRank(tp_rank=t, tp_size=2), config)
                assert all(torch.equal(got[n], x) for n, x in want.items()), (t, version)
    finally:
        if ranks is not None:
            ranks.close()
        for w in workers:
            w.stop()
