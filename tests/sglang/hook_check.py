"""Run SGLang's real plugin loading in a fresh process and report, as one JSON line, what it did.

Used by test_sglang_plugin.py, with the Python of each SGLang environment. SGLang's
``load_plugins()`` discovers entry points of group ``sglang.srt.plugins`` (weightwire's is one),
calls each ``register()`` and applies the hooks to ``Scheduler``. The real-engine tests show the
hooks working; this checks what a running engine cannot show: the plugin's refusals (a release
outside the tested range, a hook target missing, the other hook absent, bad settings, disabled by
environment) and the ranks of a DP replica, which the CPU engines here do not run.
"""

from __future__ import annotations

import json
import logging
import os


def resumes_told(plugin: object) -> list[object]:
    """What the resume hook tells a scheduler's adapter for each (tags, memory saver on, CPU backup)."""
    from types import SimpleNamespace

    told: list[object] = []
    adapter = SimpleNamespace(weights_resumed=lambda *, discarded: told.append(discarded))
    out: list[object] = []
    for tags, saver_on, backup in (
        (["kv_cache"], True, False),
        (["weights"], True, False),
        (None, True, True),
        (["weights", "kv_cache"], False, False),
    ):
        scheduler = SimpleNamespace(
            _weightwire_worker=SimpleNamespace(adapter=adapter),
            server_args=SimpleNamespace(enable_weights_cpu_backup=backup),
        )
        manager = SimpleNamespace(scheduler=scheduler, memory_saver_adapter=SimpleNamespace(enabled=saver_on))
        told.clear()
        plugin.after_resume_memory_occupation(None, manager, SimpleNamespace(tags=tags))  # type: ignore[attr-defined]
        out.append(told[0] if told else "not told")
    return out


def main() -> None:
    import sglang_cpu_shims

    sglang_cpu_shims.apply()
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    ww_log = logging.getLogger("weightwire.sglang")
    ww_log.addHandler(Collect())
    ww_log.setLevel(logging.INFO)

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins, load_plugins_by_group
    from sglang.srt.plugins.hook_registry import HookRegistry
    from weightwire.adapters.sglang import plugin

    out: dict[str, object] = {}
    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    out["sglang_finds_plugin"] = "weightwire" in found and found["weightwire"][0] is plugin.register
    out["init_hooked_before"] = plugin.hook_applied(Scheduler, "__init__", plugin.after_scheduler_init)

    load_plugins()
    out["init_hooked"] = plugin.hook_applied(Scheduler, "__init__", plugin.after_scheduler_init)
    out["loop_hooked"] = plugin.hook_applied(
        Scheduler, "process_input_requests", plugin.after_process_input_requests
    )
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    out["resume_hooked"] = plugin.hook_applied(
        SchedulerWeightUpdaterManager, "resume_memory_occupation", plugin.after_resume_memory_occupation
    )
    out["patched_targets"] = sorted(
        t
        for t in HookRegistry._patched
        if t in (plugin.INIT_TARGET, plugin.LOOP_TARGET, plugin.RESUME_TARGET)
    )
    out["resumes_told"] = resumes_told(plugin)
    out["registered_log"] = any("registered hooks" in r for r in records)

    # Disabled by environment: register() adds nothing.
    before = {t: len(h) for t, h in HookRegistry._hooks.items()}
    os.environ["WEIGHTWIRE_SGLANG_ENABLE"] = "0"
    plugin.register()
    del os.environ["WEIGHTWIRE_SGLANG_ENABLE"]
    out["disabled_adds_nothing"] = before == {t: len(h) for t, h in HookRegistry._hooks.items()}

    # Releases outside the tested range: refused with the range, unless explicitly allowed.
    import sglang

    out["sglang_version"] = sglang.__version__
    for name, version in (("too_old", "0.5.16"), ("too_new", "0.6.0"), ("unparsable", "main")):
        try:
            plugin.check_version(version)
            out[name] = "accepted"
        except SystemExit as e:
            out[name] = str(e)
    try:
        plugin.check_version("0.6.0", allow_untested=True)
        out["untested_allowed"] = "accepted"
    except SystemExit as e:
        out["untested_allowed"] = str(e)

    # A hook target this SGLang lacks: the engine must not start (SystemExit passes load_plugins()).
    plugin.LOOP_TARGET = "sglang.srt.managers.scheduler.Scheduler.no_such_method"
    try:
        plugin.register()
        out["missing_target"] = "registered"
    except SystemExit as e:
        out["missing_target"] = str(e)

    # The init hook finds the loop hook missing on a scheduler class: it refuses to start.
    class SchedulerWithoutLoopHook:
        def process_input_requests(self, recv_reqs: list[object]) -> None:
            return None

    try:
        plugin.after_scheduler_init(None, SchedulerWithoutLoopHook())
        out["init_without_loop_hook"] = "started"
    except RuntimeError as e:
        out["init_without_loop_hook"] = str(e)

    # The loop hook on a scheduler the init hook never saw: it refuses too.
    try:
        plugin.after_process_input_requests(None, SchedulerWithoutLoopHook(), [])
        out["loop_without_worker"] = "drained"
    except RuntimeError as e:
        out["loop_without_worker"] = str(e)

    # Settings SGLang would run without: refused loudly too.
    os.environ["WEIGHTWIRE_SGLANG_BASE_PORT"] = "not-a-port"
    try:
        plugin.register()
        out["bad_settings"] = "registered"
    except SystemExit as e:
        out["bad_settings"] = str(e)
    del os.environ["WEIGHTWIRE_SGLANG_BASE_PORT"]

    # Ranks as a DP replica's scheduler sees them in SGLang's runtime context. Only 0.5.23 has
    # publish()/SpawnRanks to set that context up outside a launched engine.
    import sglang.srt.runtime_context as runtime_context
    from sglang.srt.server_args import ServerArgs
    from weightwire.adapters.sglang import worker_id

    out["dp_replica_rank"] = out["dp_replica_worker_id"] = None
    if hasattr(runtime_context, "SpawnRanks"):
        runtime_context.publish(
            ServerArgs(model_path="dummy", tp_size=2, dp_size=2, device="cpu"),
            role="scheduler",
            ranks=runtime_context.SpawnRanks(world_rank=1, dp_rank=1),
        )
        rank = plugin.parallel_rank()
        out["dp_replica_rank"] = [
            rank.tp_rank,
            rank.tp_size,
            rank.pp_rank,
            rank.pp_size,
            rank.dp_rank,
            rank.dp_size,
        ]
        out["dp_replica_worker_id"] = worker_id(rank)

    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
