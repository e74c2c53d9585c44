"""The SGLang plugin is found and applied by SGLang's own plugin loader (in a fresh process of
each SGLang environment), and refuses what it must: see ``hook_check.py`` for why these cases are
checked here and not in a running engine."""

from __future__ import annotations

import json
import os
import subprocess
from importlib.metadata import entry_points

import pytest
from real_engine import SGLANG_ENVS, SGLangEnv, cpu_env

HERE = os.path.dirname(os.path.abspath(__file__))


def test_entry_point_is_registered() -> None:
    found = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert "weightwire" in found, "reinstall weightwire (pip install -e .) to register its entry points"
    assert found["weightwire"].value == "weightwire.adapters.sglang.plugin:register"


@pytest.mark.sglang
@pytest.mark.parametrize("sglang_env", list(SGLANG_ENVS.values()), ids=list(SGLANG_ENVS))
def test_sglang_load_plugins_hooks_the_scheduler(sglang_env: SGLangEnv) -> None:
    if not sglang_env.available():
        pytest.skip(f"no SGLang {sglang_env.version} environment: `make install-sglang` makes it")
    proc = subprocess.run(
        [sglang_env.python, os.path.join(HERE, "hook_check.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=cpu_env(1, 1, sglang_env.version),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sglang_version"] == sglang_env.version
    assert out["sglang_finds_plugin"] is True
    assert out["init_hooked_before"] is False
    assert out["init_hooked"] is True
    assert out["loop_hooked"] is True
    assert out["patched_targets"] == [
        "sglang.srt.managers.scheduler.Scheduler.__init__",
        "sglang.srt.managers.scheduler.Scheduler.process_input_requests",
        "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.resume_memory_occupation",
    ]
    assert out["resume_hooked"] is True
    # Resuming the KV cache alone tells nothing; the weights' bytes count as discarded only with the
    # memory saver on and no CPU backup (the adapter then proves its direct-copy regions again).
    assert out["resumes_told"] == ["not told", True, False, False]
    assert out["registered_log"] is True
    assert out["disabled_adds_nothing"] is True
    for refused, version in (("too_old", "0.5.16"), ("too_new", "0.6.0"), ("unparsable", "main")):
        assert f"sglang {version} is outside" in out[refused] and "0.5.17 through 0.5.23" in out[refused]
        assert "WEIGHTWIRE_SGLANG_ALLOW_UNTESTED=1" in out[refused]
    assert out["untested_allowed"] == "accepted"
    assert "cannot hook sglang.srt.managers.scheduler.Scheduler.no_such_method" in out["missing_target"]
    assert "0.5.17 through 0.5.23" in out["missing_target"]
    assert "is not in place" in out["init_without_loop_hook"]
    assert "did not run" in out["loop_without_worker"]
    assert "not a port number" in out["bad_settings"]
    if sglang_env.version == "0.5.23":  # 0.5.17 cannot set up a DP replica's context outside an engine
        assert out["dp_replica_rank"] == [1, 2, 0, 1, 1, 2]
        assert out["dp_replica_worker_id"] == "tp1-pp0-dp1"
