"""CUDA IPC end to end on real GPUs: ``weightwire serve --model demo --device cuda`` workers and
trainer processes running weightwire's client (tests/gpu/trainer.py), each pinned to its GPU with
CUDA_VISIBLE_DEVICES. Contents are checked through the workers' safetensors dumps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_procs import (
    WorkerSpec,
    expect_dump,
    gpu_env,
    gpu_uuid,
    needs_gpus,
    nvml_used_by_process,
    nvml_used_bytes,
    nvml_uuid,
    trainer,
    workers,
)
from weightwire.core.devices import normalize_uuid
from weightwire.v1 import weight_transfer_pb2 as pb

ABSENT_GPU = "GPU-00000000-0000-0000-0000-000000000000"


def ok(answer: dict) -> dict:
    assert answer.get("ok") is True, answer
    return answer["results"]


@pytest.mark.gpu
@needs_gpus(1)
def test_colocated_tp2_pp2_on_one_gpu_reuses_handles(tmp_path: Path) -> None:
    """Four workers (TP=2 x PP=2) and the trainer share GPU 0: every shard verified, every later
    update reuses the handles opened by the first. The parameters go where they live (one payload of
    their storages per pipeline stage); version 3 checksums, so it is packed into staging buffers,
    whose handles it opens once."""
    dumps = tmp_path / "dumps"
    specs = [
        WorkerSpec("0", f"tp{t}-pp{p}", tp_rank=t, tp_size=2, pp_rank=p, pp_size=2)
        for p in range(2)
        for t in range(2)
    ]
    with workers(specs, tmp_path, dump_dir=dumps) as ws:
        addr = {w.address: w.spec for w in ws}
        with trainer("0", list(addr)) as tr:
            opened_first: dict[str, int] = {}
            opened_packed: dict[str, int] = {}
            for version in (1, 2, 3, 7):
                # Version 3 also has both sides checksum the GPU bytes (client staging, worker mapping).
                answer = tr.call("push", version, {"verify": version == 3})
                results = ok(answer)
                assert set(results) == set(addr)
                assert answer["storages_shared"] > 0  # exported where they live, from the first push
                for a, r in results.items():
                    assert (
                        r["version"] == version
                        and r["transport"] == "cuda_ipc"
                        and r["state"] == "CONSISTENT"
                    )
                    assert r["tensors_loaded"] > 0
                    if version == 1:
                        assert r["handles_opened"] >= 1  # the payloads of the stage's storages
                        opened_first[a] = r["handles_opened"]
                    elif version == 3:
                        assert r["handles_opened"] >= 1  # the staging buffers of the packed push
                        opened_packed[a] = r["handles_opened"]
                    else:
                        assert r["handles_opened"] == 0, (a, r)
                for spec in addr.values():
                    expect_dump(dumps, spec, version)
            # A flat GPU buffer that starts 4096 bytes into its allocation, exported in place: the
            # tensor offsets on the wire must count from the storage's first byte.
            # Version 6 comes in a new buffer (the trainer dropped the old one): a new handle.
            opened_flat: dict[str, int] = {}
            for version, lead in ((8, 4096), (9, 4096), (10, 8192)):
                results = ok(tr.call("flat", version, {"lead": lead, "verify": True}))
                for a, r in results.items():
                    assert r["version"] == version and r["transport"] == "cuda_ipc"
                    assert r["handles_opened"] == (0 if version == 9 else 1), (a, r)
                    opened_flat[a] = opened_flat.get(a, 0) + r["handles_opened"]
                for spec in addr.values():
                    expect_dump(dumps, spec, version)
            status = tr.call("status")
            for a, st in status.items():
                assert st["version"] == 10 and st["state"] == "CONSISTENT"
                assert st["device_uuid"] == gpu_uuid(0)
                # The mappings a worker keeps are exactly the handles it opened once.
                assert st["open_mappings"] == opened_first[a] + opened_packed[a] + opened_flat[a]


@pytest.mark.gpu
@needs_gpus(1)
def test_labels_as_nvml_prints_them_match_and_absent_gpu_is_refused(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    spec = WorkerSpec("0", "tp0-pp0")
    raw_nvml = nvml_uuid(0)
    bare = gpu_uuid(0)
    assert normalize_uuid(raw_nvml) == bare
    labels = [raw_nvml, raw_nvml.upper(), "MIG-" + bare, "GPU-" + bare.upper(), bare.upper()]
    with workers([spec], tmp_path, dump_dir=dumps) as ws, trainer("0", [ws[0].address]) as tr:
        a = ws[0].address
        version = 0
        for label in labels:
            version += 1
            results = ok(tr.call("gathered", version, {"label": label}))
            assert results[a]["version"] == version
            expect_dump(dumps, spec, version)
        good = version

        # A label of a GPU that is not on this machine: the client refuses before sending...
        refused = tr.call("gathered", good + 1, {"label": ABSENT_GPU})
        assert refused["ok"] is False and refused["plan_error"]["reason"] == "NO_PAYLOAD_FOR_DEVICE", refused
        # ...and without the client's check the worker refuses it, weights untouched.
        refused = tr.call("gathered", good + 1, {"label": ABSENT_GPU, "precheck": False})
        assert refused["ok"] is False, refused
        err = refused["failures"][a]
        assert (err["code"], err["reason"]) == ("FAILED_PRECONDITION", "NO_PAYLOAD_FOR_DEVICE")
        assert bare in err["message"]
        st = tr.call("status")[a]
        assert (st["version"], st["state"], st["last_error"]) == (good, "CONSISTENT", "NO_PAYLOAD_FOR_DEVICE")
        assert not (dumps / f"{spec.worker_id}-v{good + 1}.safetensors").exists()


@pytest.mark.gpu
@needs_gpus(1)
def test_no_leak_over_20_updates(tmp_path: Path) -> None:
    """GPU memory and the worker's open IPC mappings return to their baseline after 20 updates."""
    spec = WorkerSpec("0", "tp0-pp0")
    with workers([spec], tmp_path) as ws, trainer("0", [ws[0].address]) as tr:
        a = ws[0].address
        first = ok(tr.call("push", 1, {}))[a]
        assert first["handles_opened"] >= 1
        ok(tr.call("push", 2, {}))
        base_mappings = tr.call("status")[a]["open_mappings"]
        base_used = nvml_used_bytes(0)
        print(f"worker pid {ws[0].proc.pid}, trainer pid {tr.proc.pid}")
        print(f"GPU 0 per process at the baseline (pid, B): {nvml_used_by_process(0)}")
        assert base_mappings == first["handles_opened"]
        readings = []
        for version in range(3, 23):
            r = ok(tr.call("push", version, {}))[a]
            assert r["version"] == version and r["handles_opened"] == 0
            readings.append(nvml_used_bytes(0) - base_used)
        st = tr.call("status")[a]
        used = nvml_used_bytes(0)
        # The growth after each update shows whether memory creeps per update or settles once.
        print(
            f"GPU 0 used: baseline {base_used} B, after 20 more updates {used} B; mappings {st['open_mappings']}"
        )
        print(f"GPU 0 growth over the baseline after each update (B): {readings}")
        print(f"GPU 0 per process (pid, B): {nvml_used_by_process(0)}")
        assert st["version"] == 22 and st["open_mappings"] == base_mappings
        assert used <= base_used + 2 * 1024 * 1024, (base_used, used)


@pytest.mark.gpu
@needs_gpus(1)
def test_restarted_trainer_gets_fresh_mappings(tmp_path: Path) -> None:
    """A new trainer process (new buffers, new handles) is never served a stale cached mapping of
    the one before it: it opens its own handles and the contents are its own. Its first push lists
    every storage it wants kept, so the worker closes the storages of the trainer before it."""
    dumps = tmp_path / "dumps"
    spec = WorkerSpec("0", "tp0-pp0")
    with workers([spec], tmp_path, dump_dir=dumps) as ws:
        a = ws[0].address
        opened = []
        for version in (1, 2):
            with trainer("0", [a]) as tr:
                r = ok(tr.call("push", version, {}))[a]
                assert r["version"] == version
                opened.append(r["handles_opened"])
                expect_dump(dumps, spec, version)
                held = tr.call("status")[a]["open_mappings"]
        assert opened[0] >= 1 and opened[1] >= 1
        assert held == opened[1]


@pytest.mark.gpu
@needs_gpus(1)
def test_kept_parameters_go_as_the_name_of_their_storage_set(tmp_path: Path) -> None:
    """From its second push of parameters kept in place a trainer sends the worker the name of the
    storage set it keeps (CudaIpcHandle.storage_set_id), not the storages: the contents are the
    new step's every time (the producer event is still waited for). A replaced parameter is a new
    set, sent whole once. Another trainer's complete set drops the first one's: its next push is
    refused by name (STORAGE_SET_UNKNOWN, nothing loaded) and goes again whole at once."""
    dumps = tmp_path / "dumps"
    spec = WorkerSpec("0", "tp0-pp0")
    with workers([spec], tmp_path, dump_dir=dumps) as ws, trainer("0", [ws[0].address]) as tr:
        a = ws[0].address
        named = []
        for version in (1, 2, 3):
            answer = tr.call("push", version, {})
            r = ok(answer)[a]
            assert r["version"] == version and r["transport"] == "cuda_ipc"
            assert r["handles_opened"] == (1 if version == 1 else 0), r
            expect_dump(dumps, spec, version)
            named.append(answer["storage_sets_named"])
        assert named == [0, 1, 2]
        answer = tr.call("replace", 4)
        assert ok(answer)[a]["version"] == 4 and answer["storage_sets_named"] == 2
        expect_dump(dumps, spec, 4)
        answer = tr.call("push", 5, {})
        assert ok(answer)[a]["handles_opened"] == 0 and answer["storage_sets_named"] == 3
        expect_dump(dumps, spec, 5)
        with trainer("0", [a]) as other:
            ok(other.call("push", 6, {}))  # complete: the worker keeps only its set now
            expect_dump(dumps, spec, 6)
        answer = tr.call("push", 7, {})
        r = ok(answer)[a]
        # Named once (refused), then sent whole: its storages opened again.
        assert r["version"] == 7 and r["handles_opened"] == 1 and answer["storage_sets_named"] == 4
        expect_dump(dumps, spec, 7)
        answer = tr.call("push", 8, {})
        assert ok(answer)[a]["handles_opened"] == 0 and answer["storage_sets_named"] == 5
        expect_dump(dumps, spec, 8)
        st = tr.call("status")[a]
        assert st["version"] == 8 and st["state"] == "CONSISTENT"


@pytest.mark.gpu
@needs_gpus(1)
def test_demo_runs_on_cuda(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "weightwire.client.cli.main", "demo", "--device", "cuda"],
        cwd=tmp_path,
        env=gpu_env(os.environ.get("CUDA_VISIBLE_DEVICES", "0")),
        capture_output=True,
        text=True,
        timeout=280,
    )
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stderr[-6000:]


# --------------------------------------------------------------------------------------------
# Two GPUs
# --------------------------------------------------------------------------------------------


def two_gpu_engine(kind: str) -> list[WorkerSpec]:
    if kind == "tp2":
        return [
            WorkerSpec("0", "tp0-pp0", tp_rank=0, tp_size=2),
            WorkerSpec("1", "tp1-pp0", tp_rank=1, tp_size=2),
        ]
    # SP-style: one TP rank, sequence parallel over two GPUs; both workers own every tensor.
    return [WorkerSpec("0", "sp0", sp_rank=0, sp_size=2), WorkerSpec("1", "sp1", sp_rank=1, sp_size=2)]


@pytest.mark.gpu2
@needs_gpus(2)
@pytest.mark.parametrize("kind", ["tp2", "sp2"])
def test_two_trainers_gathered_each_worker_imports_its_gpu(tmp_path: Path, kind: str) -> None:
    dumps = tmp_path / "dumps"
    specs = two_gpu_engine(kind)
    with workers(specs, tmp_path, dump_dir=dumps) as ws:
        endpoints = [w.address for w in ws]
        with trainer("0", endpoints) as leader, trainer("1", endpoints) as follower:
            for version in (1, 2):
                remote = follower.call("prepare", version)["payload"]
                label = pb.Payload.FromString(bytes.fromhex(remote)).device
                assert (label.kind, label.uuid) == (pb.DEVICE_KIND_CUDA, gpu_uuid(1))
                results = ok(leader.call("gathered", version, {"remote": [remote]}))
                for w in ws:
                    r = results[w.address]
                    assert r["version"] == version and r["transport"] == "cuda_ipc"
                    # Each GPU's buffer is opened once, by the worker on that GPU, then reused.
                    assert r["handles_opened"] == (1 if version == 1 else 0), (w.spec.worker_id, r)
                    expect_dump(dumps, w.spec, version)
            status = leader.call("status")
            for w, uuid in zip(ws, (gpu_uuid(0), gpu_uuid(1)), strict=True):
                assert status[w.address]["device_uuid"] == uuid
                assert status[w.address]["open_mappings"] == 1

            # Payloads labelled only with GPU 1: the worker on GPU 0 refuses, weights untouched.
            remote = follower.call("prepare", 3)["payload"]
            refused = leader.call("gathered", 3, {"remote": [remote], "local": False, "precheck": False})
            assert refused["ok"] is False
            err = refused["failures"][ws[0].address]
            assert (err["code"], err["reason"]) == ("FAILED_PRECONDITION", "NO_PAYLOAD_FOR_DEVICE"), refused
            st = leader.call("status")[ws[0].address]
            assert (st["version"], st["state"]) == (2, "CONSISTENT")
            assert not (dumps / f"{ws[0].spec.worker_id}-v3.safetensors").exists()


@pytest.mark.gpu2
@needs_gpus(2)
def test_peer_import_over_nvlink_only_when_allowed(tmp_path: Path) -> None:
    """A worker on GPU 0 that can see GPU 1 imports GPU 1's payload only with the header's consent,
    and the ack says it was a peer import."""
    dumps = tmp_path / "dumps"
    spec = WorkerSpec("0,1", "tp0-pp0")  # its cuda:0 is GPU 0; GPU 1 is visible as cuda:1
    with workers([spec], tmp_path, dump_dir=dumps) as ws, trainer("1", [ws[0].address]) as tr:
        a = ws[0].address
        refused = tr.call("raw", 1, {"endpoint": a, "local": True})
        assert refused["ok"] is False and refused["error"]["reason"] == "NO_PAYLOAD_FOR_DEVICE", refused
        assert refused["acks"] == []

        for version in (1, 2):
            done = tr.call("raw", version, {"endpoint": a, "local": True, "allow_peer": True})
            assert done["ok"] is True and done["version"] == version, done
            (ack,) = done["acks"]
            assert ack["peer_device_import"] is True
            assert ack["source_uuid"] == gpu_uuid(1)
            assert ack["transport"] == "TRANSPORT_KIND_CUDA_IPC"
            assert ack["handle_opened"] is (version == 1)
            expect_dump(dumps, spec, version)
        st = tr.call("status")[a]
        assert st["device_uuid"] == gpu_uuid(0) and st["version"] == 2
