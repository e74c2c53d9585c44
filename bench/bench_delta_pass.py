"""The trainer's and the worker's delta work on the same tensors in one process, before and after
the one pass (issue 38): a Qwen-sized set of fp32 masters (two 28672 x 1024 matrices, 42 of
3072 x 1024, 56 of 1024 x 1024, 57 vectors of 1024: 250 M elements, 476 MiB in bf16), a sparse
step between pushes (about ``--changed`` of the bf16 elements move), then alternately

- the separate steps: the whole cast to bf16, ``BaseKeeper.diff``, ``record`` and
  ``result_checksums`` (CRC-32), and
- ``BaseKeeper.update_all`` (one pass per tensor) with CRC-32C and with CRC-32,

and on the worker's side ``check_delta``, ``apply_delta`` and ``verify_result`` of every tensor
against a copy of the base. Interleaved, so that both see the same load of a shared machine;
medians printed and written to ``--out``/delta_pass.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from weightwire.core.delta import BaseKeeper, apply_delta, check_delta, verify_result
from weightwire.core.delta.base_keeper import KeptUpdate, TensorUpdate
from weightwire.v1 import weight_transfer_pb2 as pb

SHAPES = [(28672, 1024)] * 2 + [(3072, 1024)] * 42 + [(1024, 1024)] * 56 + [(1024,)] * 57


def separate(keeper: BaseKeeper, masters: list[torch.Tensor]) -> tuple[dict[str, float], list[KeptUpdate]]:
    t0 = time.perf_counter()
    cast = [m.to(torch.bfloat16) for m in masters]
    t1 = time.perf_counter()
    deltas = [keeper.diff(str(i), c) for i, c in enumerate(cast)]
    t2 = time.perf_counter()
    for i, c in enumerate(cast):
        keeper.record(str(i), c, deltas[i])
    t3 = time.perf_counter()
    sums = [keeper.result_checksums(str(i), pb.CHECKSUM_ALGORITHM_CRC32) for i in range(len(cast))]
    t4 = time.perf_counter()
    out = [KeptUpdate(str(i), c, d, s) for i, (c, d, s) in enumerate(zip(cast, deltas, sums, strict=True))]
    return {
        "cast_s": t1 - t0,
        "diff_s": t2 - t1,
        "record_s": t3 - t2,
        "checksums_s": t4 - t3,
        "sum_s": t4 - t0,
    }, out


def worker_side(worker: dict[str, torch.Tensor], updates: list[KeptUpdate]) -> dict[str, float]:
    t0 = time.perf_counter()
    for u in updates:
        assert u.delta is not None
        check_delta(torch.empty(u.tensor.shape, dtype=u.tensor.dtype, device="meta"), u.delta)
    t1 = time.perf_counter()
    for u in updates:
        assert u.delta is not None
        apply_delta(worker[u.name], u.delta, checked=True)
    t2 = time.perf_counter()
    for u in updates:
        verify_result(u.checksums, [(None, worker[u.name])], tensor=u.name)
    t3 = time.perf_counter()
    return {"check_s": t1 - t0, "apply_s": t2 - t1, "verify_s": t3 - t2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--changed", type=float, default=0.01, help="fraction of elements a step moves")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(s, generator=gen) for s in SHAPES]
    keeper = BaseKeeper()
    keeper.begin(1)
    for i, m in enumerate(masters):
        keeper.record(str(i), m.to(torch.bfloat16))
    keeper.commit(1)
    worker = {str(i): keeper._kept[str(i)].copy.clone() for i in range(len(masters))}
    version = 1
    runs: dict[str, list[dict[str, float]]] = {
        "separate CRC32": [],
        "update_all CRC32C": [],
        "update_all CRC32": [],
    }
    changed: list[float] = []
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for label in runs:
            for m in masters:  # a move of 2 bf16 ulps of ~args.changed of the elements
                moved = torch.rand(m.shape, generator=gen) < args.changed
                m[moved] *= 1.0 + 2.0**-6
            version += 1
            keeper.begin(version)
            if label.startswith("separate"):
                parts, updates = separate(keeper, masters)
            else:
                algorithm = (
                    pb.CHECKSUM_ALGORITHM_CRC32C if label.endswith("CRC32C") else pb.CHECKSUM_ALGORITHM_CRC32
                )
                t0 = time.perf_counter()
                updates = keeper.update_all(
                    [TensorUpdate(str(i), m, torch.bfloat16) for i, m in enumerate(masters)], algorithm
                )
                parts = {"sum_s": time.perf_counter() - t0}
            keeper.commit(version)
            parts.update(worker_side(worker, updates))
            changed.append(
                sum(u.delta.changed_count for u in updates if u.delta is not None)
                / sum(m.numel() for m in masters)
            )
            runs[label].append(parts)
    result = {
        "elements": sum(m.numel() for m in masters),
        "changed_fraction_median": statistics.median(changed),
        "medians": {
            label: {k: statistics.median(p[k] for p in ps) for k in ps[0]} for label, ps in runs.items()
        },
        "runs": runs,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "torch_threads": torch.get_num_threads(),
    }
    print(
        f"{result['elements'] / 1e6:.0f} M elements, median {result['changed_fraction_median']:.3%} changed"
    )
    for label, med in result["medians"].items():
        print(f"{label:18s} " + " ".join(f"{k} {v:.3f}" for k, v in med.items()))
    print(f"load average before/after: {load_before} / {result['loadavg_after']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "delta_pass.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
