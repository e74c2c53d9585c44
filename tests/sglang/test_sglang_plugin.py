"""The SGLang plugin is found and applied by SGLang's own plugin loader (in a fresh process)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
SKIP_REASON = "sglang is not installed in this environment: `make install-sglang` adds its CPU test stack"


def test_entry_point_is_registered() -> None:
    found = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert "weightwire" in found, "reinstall weightwire (pip install -e .) to register its entry points"
    assert found["weightwire"].value == "weightwire.adapters.sglang.plugin:register"


@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason=SKIP_REASON)
def test_sglang_load_plugins_hooks_the_scheduler() -> None:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("SGLANG_PLUGINS", None)
    env.pop("WEIGHTWIRE_SGLANG_ENABLE", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "hook_check.py")], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sglang_finds_plugin"] is True
    assert out["init_hooked_before"] is False
    assert out["init_hooked"] is True
    assert out["ingest_hooked"] is True
    assert out["patched_targets"] == [
        "sglang.srt.managers.scheduler.Scheduler.__init__",
        "sglang.srt.managers.scheduler.Scheduler.ingest_requests",
    ]
    assert out["registered_log"] is True
    assert out["disabled_adds_nothing"] is True
    assert "cannot hook sglang.srt.managers.scheduler.Scheduler.no_such_method" in out["missing_target"]
    assert "is not in place" in out["init_without_ingest_hook"]
    assert "did not run" in out["ingest_without_worker"]
    assert "not a port number" in out["bad_settings"]
    assert out["dp_replica_rank"] == [1, 2, 0, 1, 1, 2]
    assert out["dp_replica_worker_id"] == "tp1-pp0-dp1"
