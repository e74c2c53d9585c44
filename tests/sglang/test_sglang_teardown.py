"""A test engine's teardown leaves nothing in /dev/shm: the segments a real SGLang engine's processes
held (its broadcast queue, load-snapshot file, multiprocessing semaphores) are gone once it is
stopped, and a segment another living process still holds is never taken.

The first test needs no SGLang (a process group that holds a segment and is killed, as SGLang kills
its own); the second starts a real engine (SGLang 0.5.23, TP2: its ranks share a broadcast queue)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from multiprocessing import shared_memory
from pathlib import Path

import pytest
from real_engine import SGLANG_ENVS, EngineHost, engine_kwargs, stop_process_group
from shm_leftovers import FAMILIES, SHM, GroupShm, held_by_anyone

HOLD = """
import sys, time
from multiprocessing import shared_memory, resource_tracker
segments = [shared_memory.SharedMemory(name=n, create=c == "new", size=4096) for n, c in zip(sys.argv[1::2], sys.argv[2::2])]
for s in segments:  # as SGLang's SIGKILLed processes: nothing will unlink them
    resource_tracker.unregister(s._name, "shared_memory")
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_killed_group_leaves_no_segment_but_keeps_what_others_hold() -> None:
    leaked = f"psm_wwtest_{uuid.uuid4().hex[:8]}"
    shared = shared_memory.SharedMemory(name=f"psm_wwtest_{uuid.uuid4().hex[:8]}", create=True, size=4096)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, leaked, "new", shared.name, "old"],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert os.path.exists(os.path.join(SHM, leaked))
        stop_process_group(proc)  # SIGTERM, then SIGKILL: the holder unlinks nothing itself
        assert not os.path.exists(os.path.join(SHM, leaked))  # the group's own: removed
        assert os.path.exists(os.path.join(SHM, shared.name))  # this process still holds it: kept
    finally:
        shared.close()
        shared.unlink()


@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_a_stopped_engine_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    from checkpoints import LLAMA, ModelSpec, full_checkpoint, write_model_dir

    env = SGLANG_ENVS["0.5.23"]
    if not env.available():
        pytest.skip("no SGLang 0.5.23 environment: `make install-sglang` makes it")
    spec = ModelSpec(LLAMA)
    model = write_model_dir(spec, str(tmp_path / "model"), full_checkpoint(spec, seed=1))
    socket_dir = f"/tmp/ww-sgl-{uuid.uuid4().hex[:10]}"
    host = EngineHost(
        env, engine_kwargs(model, tp=2), socket_dir=socket_dir, log_path=str(tmp_path / "engine.log")
    )
    probe = GroupShm(host.proc.pid)  # what the engine holds, seen from outside its teardown
    try:
        probe.sample()
        assert any(n.startswith("sgl_shm_") for n in probe.names), probe.names
        assert any(n.startswith("sglang_loads_") for n in probe.names), probe.names
        before_stop = set(os.listdir(SHM))
    finally:
        host.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
    left = sorted(n for n in probe.names if os.path.exists(os.path.join(SHM, n)))
    assert left == [], f"{left} left in {SHM}"
    # Nor anything its shutdown made (semaphores), unless a living process (another engine) holds it.
    made = {n for n in set(os.listdir(SHM)) - before_stop if n.startswith(FAMILIES)}
    assert sorted(made - held_by_anyone()) == []
    stamped = [
        n for n in os.listdir(SHM) if any(f"_{pid}_" in n for pid in probe.pids) and n.startswith("sgl_")
    ]
    assert stamped == [], stamped
