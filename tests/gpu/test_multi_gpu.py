"""Multi-GPU scenarios over CUDA IPC, parametrised over the GPU count: one TP=2 x PP=2 engine fed by
colocated trainer ranks with gathered labelled payloads, and two TP=2 x PP=2 replicas updated by one
push. Every worker (``weightwire serve --model demo --device cuda``) and every trainer rank
(tests/gpu/multi_trainer.py) is its own process pinned to its GPU by CUDA_VISIBLE_DEVICES.

The natural sizes are 4 GPUs (one worker and one trainer rank per GPU) and 8 GPUs (two replicas
of four GPUs, one rank per GPU). With 2 GPUs the same scenarios run with several workers and ranks
per GPU: GPU g hosts tp_rank g's two pipeline stages and two (engine) or four (replicas) ranks, and
replica A lives on GPU 0, replica B on GPU 1. Markers gpu2 / gpu4 / gpu8 select them; each skips on
a machine with fewer GPUs. WEIGHTWIRE_GPU_SIM=N dry-runs them on the CPU (see multi_procs.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from multi_procs import (
    bucket_count,
    check_manifests,
    check_results,
    expect_dump,
    expected,
    gather,
    gpus,
    handles_per_update,
    needs,
    start_ranks,
    start_workers,
    timing_lines,
    tp_pp_engine,
)


def ok(answer: dict[str, Any]) -> dict[str, Any]:
    assert answer.get("ok") is True, answer
    return answer["results"]


def gpu_param(n: int) -> Any:
    mark = {2: pytest.mark.gpu2, 4: pytest.mark.gpu4, 8: pytest.mark.gpu8}[n]
    return pytest.param(n, marks=[mark, needs(n)], id=f"{n}gpu")


@pytest.mark.parametrize("n", [gpu_param(2), gpu_param(4)])
def test_tp2_pp2_engine_gathered_from_colocated_ranks(tmp_path: Path, n: int) -> None:
    """One TP=2 x PP=2 engine over ``n`` GPUs and four trainer ranks colocated with it (4 // n per
    GPU). Each rank exports its own copy labelled with its GPU; rank 0 gathers them and pushes. Every
    worker imports only its own GPU's copies and only its stage's tensors of its TP slice."""
    span = gpus(n)
    placed = tp_pp_engine("", span)
    per_gpu = 4 // n
    nb = bucket_count(per_gpu)
    dumps = tmp_path / "dumps"
    with start_workers(placed, tmp_path, dumps) as workers:
        with start_ranks(span, per_gpu, tmp_path, {"engine": list(workers)}) as ranks:
            leader = ranks[0].proc
            manifests = leader.call("manifests")
            check_manifests(manifests, workers)
            per_update = handles_per_update(workers, manifests, nb, per_gpu)
            cached = not span[0].sim  # CUDA mappings stay cached; host shm is mapped per update

            lines: list[str] = []
            for version in (1, 2):
                buckets = gather(ranks, version, nb)
                assert [len(b) for b in buckets] == [n] * nb
                results = ok(leader.call("gathered", version, {"buckets": buckets})["engine"])
                check_results(
                    results,
                    workers,
                    manifests,
                    version,
                    handles=lambda a, v=version: per_update[a] if v == 1 or not cached else 0,
                )
                lines += timing_lines(f"engine-{n}gpu", results, workers)
                for w in workers.values():
                    expect_dump(dumps, w, version)

            # Version 3: the ranks of GPU g pack a checkpoint of their own (seed 1000 * (g + 1) + 3),
            # so each worker's contents say whose copy it imported: its own GPU's, never another's.
            def seed_of(g: Any) -> int:
                return 1000 * (g.index + 1) + 3

            results = ok(
                leader.call("gathered", 3, {"buckets": gather(ranks, 3, nb, seed_of=seed_of)})["engine"]
            )
            check_results(results, workers, manifests, 3, handles=lambda a: 0 if cached else per_update[a])
            for w in workers.values():
                expect_dump(dumps, w, 3, seed=seed_of(w.gpu))
                for other in span:
                    if other != w.gpu:
                        mine, theirs = expected(w.rank, seed_of(w.gpu)), expected(w.rank, seed_of(other))
                        assert any(not mine[k].equal(theirs[k]) for k in mine), "the GPUs' copies must differ"

            # Version 4, one hand-built stream per worker, to read every bucket's ack: the payload
            # imported is the worker's own GPU's, each bucket's other tensors (the other stage's)
            # are skipped, and the bytes copied add up to the manifest's.
            buckets = gather(ranks, 4, nb)
            for a, w in workers.items():
                m = manifests[a]
                done = leader.call("raw", 4, {"endpoint": a, "buckets": buckets})
                assert done["ok"] is True, (w.worker_id, done)
                acks = done["acks"]
                assert [k["index"] for k in acks] == list(range(nb))
                owned = set(m["names"])
                opened: set[int] = set()
                for ack, names in zip(acks, done["bucket_names"], strict=True):
                    mine = owned & set(names)
                    assert mine, "every bucket holds some of every worker's tensors"
                    assert ack["source_uuid"] == w.gpu.uuid and ack["peer_device_import"] is False, (
                        w.worker_id,
                        ack,
                    )
                    assert ack["transport"] == (
                        "TRANSPORT_KIND_HOST_SHM" if w.gpu.sim else "TRANSPORT_KIND_CUDA_IPC"
                    )
                    assert (ack["tensors_loaded"], ack["tensors_skipped"]) == (
                        len(mine),
                        len(names) - len(mine),
                    ), ack
                    # Bucket j comes from local rank j % per_gpu: a rank's buffer is opened at most
                    # once per update, and not at all while the worker holds its CUDA mapping.
                    source = ack["index"] % per_gpu
                    assert ack["handle_opened"] is (not cached and source not in opened), ack
                    opened.add(source)
                sent = sum(len(names) for names in done["bucket_names"])
                assert sum(k["tensors_skipped"] for k in acks) == sent - len(owned) > 0
                assert (
                    sum(k["bytes_loaded"] for k in acks) == done["result"]["bytes_loaded"] == m["total_bytes"]
                )
                assert done["result"]["version"] == 4
                lines.append(
                    f"timing engine-{n}gpu {w.worker_id} gpu{w.gpu.index} v4 raw: "
                    f"bytes_loaded={done['result']['bytes_loaded']} duration_ns={done['result']['duration_ns']} "
                    + " ".join(
                        f"b{k['index']}(open_ns={k['open_duration_ns']} load_ns={k['load_duration_ns']})"
                        for k in acks
                    )
                )
                expect_dump(dumps, w, 4)

            status = leader.call("status")
            for a, w in workers.items():
                st = status[a]
                assert (st["version"], st["state"], st["device_uuid"]) == (4, "CONSISTENT", w.gpu.uuid), st
                # The mappings a worker holds are exactly its own GPU's ranks' buffers, opened once.
                assert st["open_mappings"] == (per_update[a] if cached else 0), (w.worker_id, st)
            print("\n".join(lines))


@pytest.mark.parametrize("n", [gpu_param(2), gpu_param(4), gpu_param(8)])
def test_two_replicas_one_push(tmp_path: Path, n: int) -> None:
    """Replicas A (first half of the GPUs) and B (second half), each TP=2 x PP=2, and eight trainer
    ranks (8 // n per GPU). One push whose buckets carry only replica A's GPUs' payloads: B refuses
    with NO_PAYLOAD_FOR_DEVICE and keeps its weights, A commits. Then a push carrying every GPU's
    payload commits on both."""
    span = gpus(n)
    half = n // 2
    placed = tp_pp_engine("A", span[:half]) + tp_pp_engine("B", span[half:])
    per_gpu = 8 // n
    nb = bucket_count(per_gpu)
    dumps = tmp_path / "dumps"
    with start_workers(placed, tmp_path, dumps) as workers:
        by_engine = {e: [a for a, w in workers.items() if w.engine == e] for e in ("A", "B")}
        with start_ranks(span, per_gpu, tmp_path, by_engine) as ranks:
            assert len(ranks) == 8
            leader = ranks[0].proc
            manifests = leader.call("manifests")
            check_manifests(manifests, workers)
            per_update = handles_per_update(workers, manifests, nb, per_gpu)
            cached = not span[0].sim
            a_workers = {a: workers[a] for a in by_engine["A"]}
            b_workers = {a: workers[a] for a in by_engine["B"]}
            lines: list[str] = []

            # Version 1: only the payloads of replica A's GPUs. The client's own check is off, so
            # each of B's workers gets the buckets and must refuse them itself.
            buckets = gather(ranks, 1, nb, on={g.index for g in span[:half]})
            answer = leader.call("gathered", 1, {"buckets": buckets, "precheck": False})
            results_a = ok(answer["A"])
            check_results(results_a, a_workers, manifests, 1, handles=lambda a: per_update[a])
            lines += timing_lines(f"replicas-{n}gpu", results_a, workers)
            failed = answer["B"]
            assert failed["ok"] is False and failed["results"] == {}, failed
            # The PushError names exactly replica B's workers.
            assert set(failed["failures"]) == set(b_workers), failed
            refused = 0
            for a, err in failed["failures"].items():
                w = b_workers[a]
                assert w.worker_id in err["message"], err
                lines.append(
                    f"replica B v1 refused: {w.worker_id} gpu{w.gpu.index}: {err['code']}/{err['reason']}"
                )
                if err["reason"] == "NO_PAYLOAD_FOR_DEVICE":
                    assert err["code"] == "FAILED_PRECONDITION" and w.gpu.uuid in err["message"], err
                    refused += 1
                else:  # cancelled by the client once a sibling of its replica refused
                    assert err["reason"] == "CANCELLED", err
            assert refused >= 1, failed
            status = leader.call("status")
            for a, w in workers.items():
                st = status[a]
                want = (1, "CONSISTENT") if w.engine == "A" else (0, "CONSISTENT")
                assert (st["version"], st["state"]) == want, (w.worker_id, st)
                if w.engine == "A":
                    expect_dump(dumps, w, 1)
                else:
                    assert st["open_mappings"] == 0 and st["updates_failed"] <= 1, (w.worker_id, st)
                    assert not (dumps / f"{w.worker_id}-v1.safetensors").exists()
            # (A worker the client saw cancelled may have refused on its own first.)
            assert sum(status[a]["last_error"] == "NO_PAYLOAD_FOR_DEVICE" for a in b_workers) >= refused

            # Version 2: every GPU's payloads; both replicas commit (B straight from version 0).
            answer = leader.call("gathered", 2, {"buckets": gather(ranks, 2, nb)})
            results_a, results_b = ok(answer["A"]), ok(answer["B"])
            check_results(
                results_a, a_workers, manifests, 2, handles=lambda a: 0 if cached else per_update[a]
            )
            check_results(results_b, b_workers, manifests, 2, handles=lambda a: per_update[a])
            assert {r["previous_version"] for r in results_a.values()} == {1}
            assert {r["previous_version"] for r in results_b.values()} == {0}
            lines += timing_lines(f"replicas-{n}gpu", {**results_a, **results_b}, workers)
            for w in workers.values():
                expect_dump(dumps, w, 2)
            status = leader.call("status")
            for a, w in workers.items():
                st = status[a]
                assert (st["version"], st["state"], st["device_uuid"]) == (2, "CONSISTENT", w.gpu.uuid), st
                assert st["open_mappings"] == (per_update[a] if cached else 0), (w.worker_id, st)
            print("\n".join(lines))
