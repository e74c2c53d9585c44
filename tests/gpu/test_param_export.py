"""A trainer's own CUDA parameters exported where they live (no packing copy), end to end on a GPU.

``weightwire serve --model demo --device cuda`` workers and a trainer process (tests/gpu/trainer.py)
whose parameters stay in the same allocations between pushes, as a training loop's do. Contents are
checked through the workers' safetensors dumps; the trainer's GPU memory is read back from torch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_procs import WorkerSpec, expect_dump, needs_gpus, trainer, workers


def ok(answer: dict) -> dict:
    assert answer.get("ok") is True, answer
    return answer["results"]


@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_parameters_go_where_they_live_and_a_replaced_one_is_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, alloc_conf: str
) -> None:
    """Every push of the same parameters reuses the one payload of their storages (nothing opened
    again, nothing packed), each worker sees the step's writes, and a parameter the trainer
    replaces is closed by the worker at the next push, so the trainer gets its memory back.
    With torch's expandable segments the same holds (torch shares a segment's pages)."""
    if alloc_conf:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", alloc_conf)
    dumps = tmp_path / "dumps"
    specs = [WorkerSpec("0", "tp0-pp0"), WorkerSpec("0", "tp1-pp0", tp_rank=1, tp_size=2)]
    with workers(specs, tmp_path, dump_dir=dumps) as ws, trainer("0", [w.address for w in ws]) as tr:
        for version in (1, 2, 3):
            answer = tr.call("push", version, {})
            results = ok(answer)
            print(
                f"{alloc_conf or 'default allocator'}: v{version} storages shared {answer['storages_shared']}, "
                f"handles opened {[r['handles_opened'] for r in results.values()]}"
            )
            if not alloc_conf:
                assert answer["storages_shared"] > 0
            elif answer["storages_shared"] == 0:
                # torch refused to share an expandable segment: packed instead, contents still right.
                for w in ws:
                    assert results[w.address]["version"] == version
                    expect_dump(dumps, w.spec, version)
                continue
            for w in ws:
                r = results[w.address]
                assert r["version"] == version and r["transport"] == "cuda_ipc" and r["state"] == "CONSISTENT"
                assert r["handles_opened"] == (1 if version == 1 else 0), r
                expect_dump(dumps, w.spec, version)
        shared = answer["storages_shared"]
        if shared == 0:
            pytest.skip(
                f"torch did not share parameters under PYTORCH_CUDA_ALLOC_CONF={alloc_conf} (packed instead)"
            )
        replaced = tr.call("replace", 4)
        results = ok(replaced)
        print(f"replace: allocated before {replaced['allocated_before']} after {replaced['allocated_after']}")
        assert replaced["storages_shared"] == shared + len(ws)  # the new allocation, shared once per worker
        for w in ws:
            assert results[w.address]["handles_opened"] == 1  # a new payload: its storages changed
            expect_dump(dumps, w.spec, 4)
        # The old allocation was held only while a worker mapped it; the push closed it.
        assert replaced["allocated_after"] == replaced["allocated_before"]
        status = tr.call("status")
        for w in ws:
            assert status[w.address]["open_mappings"] == 1 and status[w.address]["version"] == 4
        # Packing stays where it is needed: a checksummed push packs into staging buffers.
        results = ok(tr.call("push", 5, {"verify": True}))
        for w in ws:
            assert results[w.address]["version"] == 5
            expect_dump(dumps, w.spec, 5)
