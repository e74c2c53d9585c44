"""Engine layouts end to end: TP=2 only, PP=2 only, and an SP-style engine (two workers that each own
every tensor). Each layout's workers are real processes; every shard is checked bit for bit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engines import CONFIG, Engine, WorkerSpec, layout, shard_mismatches, start_engine
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.client import WeightPusher

pytestmark = pytest.mark.timeout(120)

LAYOUTS = {
    "tp2": layout(tp=2, pp=1),
    "pp2": layout(tp=1, pp=2),
    # One engine of tp_size 1 spanning two devices (sequence parallel): each worker holds everything.
    "sp2": [WorkerSpec(extra=("--sp-rank", str(r), "--sp-size", "2")) for r in (0, 1)],
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Engine]]:
    eng = start_engine(LAYOUTS[request.param], tmp_path_factory.mktemp(request.param))
    yield request.param, eng
    eng.stop()


def test_layout_full_then_partial(engine: tuple[str, Engine]) -> None:
    name, eng = engine
    with WeightPusher(eng.addresses, bucket_size_bytes=32 * 1024) as pusher:
        manifests = pusher.manifests()
        ranks = sorted(
            (m.rank.tp_rank, m.rank.tp_size, m.rank.pp_rank, m.rank.pp_size, m.rank.sp_rank, m.rank.sp_size)
            for m in manifests.values()
        )
        if name == "tp2":
            assert ranks == [(0, 2, 0, 1, 0, 1), (1, 2, 0, 1, 0, 1)]
        elif name == "pp2":
            assert ranks == [(0, 1, 0, 2, 0, 1), (0, 1, 1, 2, 0, 1)]
            stage_names = [set(m.tensors) for m in manifests.values()]
            assert not stage_names[0] & stage_names[1]  # stages own disjoint tensors
        else:
            assert ranks == [(0, 1, 0, 1, 0, 2), (0, 1, 0, 1, 1, 2)]
            assert all(len(m.tensors) == len(full_checkpoint(CONFIG, seed=0)) for m in manifests.values())

        full = full_checkpoint(CONFIG, seed=1)
        results = pusher.push(full, version=1)
        for addr, r in results.items():
            assert r.tensors_loaded == len(manifests[addr].tensors)
        assert shard_mismatches(eng.dump_dir, manifests, full, 1) == {}

        # A partial update of one layer: only its owners load anything.
        update = {n: t for n, t in full_checkpoint(CONFIG, seed=2).items() if n.startswith("model.layers.3.")}
        results = pusher.push(update, version=2, scope="partial")
        for addr, r in results.items():
            owns = any(n in manifests[addr].tensors for n in update)
            assert r.version == 2 and r.tensors_loaded == (len(update) if owns else 0)
        assert shard_mismatches(eng.dump_dir, manifests, {**full, **update}, 2) == {}
