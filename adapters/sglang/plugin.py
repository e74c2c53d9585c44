"""SGLang plugin: a weightwire worker service inside every SGLang scheduler process.

Registered as entry point ``weightwire`` in group ``sglang.srt.plugins`` (pyproject.toml). SGLang
calls ``register()`` from ``load_plugins()`` in each of its processes (in a scheduler process it is
the first thing ``run_scheduler_process`` does); ``register`` checks the SGLang release against the
tested range and adds two hooks through SGLang's ``HookRegistry``:

- AFTER ``Scheduler.__init__`` (model loaded, KV cache and graphs built, event loop not started):
  build the rank's ``SGLangAdapter`` from the real model, start the worker service at the address
  its ranks give (``settings.py``), make an idle-sleeping scheduler wakeable (``wake.py``), and log
  that the hooks applied. Any failure here raises out of ``Scheduler.__init__``, so the engine does
  not start without weight sync.
- AFTER ``Scheduler.process_input_requests`` (once per pass of every event loop of SGLang 0.5.17
  through 0.5.23, between batches, right after the scheduler handled its own requests, weight
  updates included): run the queued update steps on the scheduler thread.
- AFTER ``SchedulerWeightUpdaterManager.resume_memory_occupation`` (SGLang's own wake, on the
  scheduler thread): tell the adapter its weights are back (``SGLangAdapter.weights_resumed``).

Sleep and wake. While SGLang holds the ``weights`` tag released (``release_memory_occupation``;
both releases keep the released tags in ``scheduler.weight_updater.offload_tags``) every update
step is refused at once with ENGINE_ASLEEP, before anything is written: with the memory saver the
parameters' memory is unmapped (a write faults) and the stash SGLang restores on resume would
overwrite it. torch_memory_saver maps the memory again at the same virtual addresses, so the
adapter's direct-copy regions stay valid (checked on resume); when the bytes were discarded (the
memory saver on without ``--enable-weights-cpu-backup``) the adapter forgets which regions it
proved, so the next push goes through ``load_weights`` (which writes whole parameters, padding rows
included) and proves them again.

What differs between the releases is found by feature, not by version number: the weight-update
session (``ModelRunner.weight_updater.begin_weight_update``, 0.5.23) and the scheduler's own record
of its weight version (``Scheduler.record_weight_version_change``, 0.5.23) are used where they
exist; 0.5.17 has neither (its own updates call ``load_weights`` directly, and it reports the
version the tokenizer manager holds, which only ``POST /update_weight_version`` sets).

Each hook checks the other applied (SGLang only logs a hook it could not apply), and ``register``
refuses to let the engine start if the hook targets do not exist or the release is outside the
tested range.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import os
import pkgutil
import re
from collections.abc import Callable
from typing import Any

import torch
from weightwire.adapters.endpoints import engine_rank, prepare_socket
from weightwire.adapters.sglang.adapter import SGLangAdapter
from weightwire.adapters.sglang.engine_thread import EngineTaskQueue
from weightwire.adapters.sglang.sessions import NoWeightSession, WeightUpdateSession
from weightwire.adapters.sglang.settings import (
    ENV_ALLOW_UNTESTED,
    ENV_ENABLE,
    ENV_SOCKET_DIR,
    Settings,
    SettingsError,
    worker_id,
    worker_index,
)
from weightwire.adapters.sglang.slices import build_adapter
from weightwire.adapters.sglang.wake import WakeReceiver, WakeSender, attach_to_idle_sleeper
from weightwire.core.devices import device_ref_of
from weightwire.core.manifest import ParallelRank

log = logging.getLogger("weightwire.sglang")

INIT_TARGET = "sglang.srt.managers.scheduler.Scheduler.__init__"
LOOP_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_input_requests"
# SGLang's own wake of released memory (both supported releases; the scheduler's request dispatcher
# binds this method when the scheduler is built, after register() patched the class).
RESUME_TARGET = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.resume_memory_occupation"
WEIGHTS_TAG = "weights"
# Both ends run a real engine in the test suite (tests/sglang, `make test`).
OLDEST_SGLANG = (0, 5, 17)
NEWEST_SGLANG = (0, 5, 23)
SUPPORTED_RANGE = "0.5.17 through 0.5.23"
_WORKER_ATTR = "_weightwire_worker"
# An idle or paused scheduler's loop pass waits up to this long for an update step
# (engine_thread.EngineTaskQueue.drain), so that the worker's gRPC threads get the GIL that SGLang's
# spinning idle loop would otherwise hold. A request arriving at an idle engine waits at most this
# much longer; other ranks of the replica wait on this rank's passes, so it stays short.
LINGER_S = 0.002
# "0": every load through SGLang's load_weights (adapter.py: a prepared load otherwise copies the
# checked regions directly from its second call on).
ENV_DIRECT_COPY = "WEIGHTWIRE_SGLANG_DIRECT_COPY"
# A file each update's phase times are appended to, one JSON line per update (profiling).
ENV_PHASE_LOG = "WEIGHTWIRE_SGLANG_PHASE_LOG"
# The same wait while an update is open in a replica of one rank (no other rank waits on its
# passes): the scheduler thread then stays in the hook from one step to the next.
SOLO_UPDATE_LINGER_S = 0.05


@dataclasses.dataclass
class SchedulerWorker:
    """What the plugin attached to one scheduler: its adapter, task queue and running server."""

    adapter: SGLangAdapter
    queue: EngineTaskQueue
    server: Any
    address: str
    socket_path: str | None
    wake_receiver: WakeReceiver | None = None
    wake_sender: WakeSender | None = None

    def drain(self) -> int:
        """On the scheduler thread: empty the wake socket first (a wake sent while the steps below
        run then means one more loop pass, never a lost step), then run the queued steps."""
        if self.wake_receiver is not None:
            self.wake_receiver.drain()
        return self.queue.drain(linger=self.linger_s)

    def linger_s(self) -> float:
        """How long the scheduler thread may wait for a step now (see LINGER_S)."""
        if not self.adapter.may_linger():
            return 0.0
        rank = self.adapter.rank
        if self.adapter.update_open and rank.tp_size * rank.pp_size == 1:
            return SOLO_UPDATE_LINGER_S
        return LINGER_S

    def stop(self) -> None:
        self.server.stop(grace=1.0)
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        for sock in (self.wake_receiver, self.wake_sender):
            if sock is not None:
                sock.close()


def register() -> None:
    """Entry point called by SGLang's ``load_plugins()``: register the two scheduler hooks."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:
        settings = Settings.from_env()
    except SettingsError as e:
        log.error("weightwire: %s", e)
        raise SystemExit(f"weightwire: {e}") from e
    if not settings.enabled:
        log.warning("weightwire: %s=0, not starting weight-sync workers in this engine", ENV_ENABLE)
        return
    check_version(_sglang_version(), allow_untested=settings.allow_untested)
    for target in (INIT_TARGET, LOOP_TARGET, RESUME_TARGET):
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError) as e:
            # load_plugins() only logs a plugin's exceptions; an engine without weight sync must not start.
            msg = (
                f"weightwire: cannot hook {target} in sglang {_sglang_version()} ({e}); this weightwire "
                f"supports sglang {SUPPORTED_RANGE}. Set {ENV_ENABLE}=0 to run without weight sync."
            )
            log.error(msg)
            raise SystemExit(msg) from e
    HookRegistry.register(INIT_TARGET, after_scheduler_init, HookType.AFTER)
    HookRegistry.register(LOOP_TARGET, after_process_input_requests, HookType.AFTER)
    HookRegistry.register(RESUME_TARGET, after_resume_memory_occupation, HookType.AFTER)
    log.info("weightwire: registered hooks on %s, %s and %s", INIT_TARGET, LOOP_TARGET, RESUME_TARGET)


def check_version(version: str, *, allow_untested: bool = False) -> None:
    """Refuse (SystemExit, which passes ``load_plugins()``) an SGLang release outside the tested range."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    parsed = tuple(int(g) for g in m.groups()) if m else None
    if parsed is not None and OLDEST_SGLANG <= parsed <= NEWEST_SGLANG:
        return
    msg = (
        f"weightwire: sglang {version} is outside the releases this weightwire supports ({SUPPORTED_RANGE}); "
        f"install one of those, set {ENV_ALLOW_UNTESTED}=1 to try this one anyway, or {ENV_ENABLE}=0 to run "
        "without weight sync."
    )
    if allow_untested:
        log.warning("%s Continuing: %s=1.", msg, ENV_ALLOW_UNTESTED)
        return
    log.error(msg)
    raise SystemExit(msg)


def after_scheduler_init(result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``Scheduler.__init__``: start this rank's worker service."""
    if not hook_applied(type(scheduler), "process_input_requests", after_process_input_requests):
        raise RuntimeError(
            f"weightwire: the hook on {LOOP_TARGET} is not in place (see SGLang's log for why), so updates "
            "could never run on the scheduler thread; refusing to start without weight sync"
        )
    manager = getattr(scheduler, "weight_updater", None)
    if manager is not None and not hook_applied(
        type(manager), "resume_memory_occupation", after_resume_memory_occupation
    ):
        raise RuntimeError(
            f"weightwire: the hook on {RESUME_TARGET} is not in place (see SGLang's log for why), so a push after "
            "resume_memory_occupation could copy into regions that are no longer right; refusing to start"
        )
    worker = start_worker(scheduler)
    log.info(
        "weightwire: hooks on Scheduler.__init__ and Scheduler.process_input_requests applied (sglang %s); "
        "worker %s serves %d checkpoint tensors (%.1f MiB, layers [%d, %d) of %d) at %s%s",
        _sglang_version(),
        worker.adapter.worker_id,
        len(worker.adapter.manifest().tensors),
        worker.adapter.manifest().total_bytes / 2**20,
        worker.adapter.layout.layer_start,
        worker.adapter.layout.layer_end,
        worker.adapter.layout.num_layers,
        worker.address,
        "; wakes this idle-sleeping scheduler when updates are queued"
        if worker.wake_receiver is not None
        else "",
    )


def after_process_input_requests(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``Scheduler.process_input_requests``: run queued update steps on this thread."""
    worker: SchedulerWorker | None = getattr(scheduler, _WORKER_ATTR, None)
    if worker is None:
        raise RuntimeError(
            "weightwire: Scheduler.process_input_requests is hooked but the scheduler has no "
            f"worker: the hook on {INIT_TARGET} did not run"
        )
    worker.drain()
    return None


def after_resume_memory_occupation(
    result: Any, manager: Any, recv_req: Any, *args: Any, **kwargs: Any
) -> None:
    """AFTER hook on SGLang's ``resume_memory_occupation`` (scheduler thread): when the weights tag
    was resumed, tell this scheduler's adapter (``SGLangAdapter.weights_resumed``)."""
    tags = getattr(recv_req, "tags", None)
    if tags and WEIGHTS_TAG not in tags:
        return None  # None or empty: SGLang resumes every tag
    scheduler = getattr(manager, "scheduler", None)
    worker: SchedulerWorker | None = getattr(scheduler, _WORKER_ATTR, None)
    if worker is not None:
        worker.adapter.weights_resumed(discarded=weights_discarded(scheduler, manager))
    return None


def weights_discarded(scheduler: Any, manager: Any) -> bool:
    """Whether releasing the weights lost their bytes: SGLang's memory saver is really on (not its
    no-op adapter) and the weights had no CPU backup (``--enable-weights-cpu-backup``)."""
    saver = getattr(manager, "memory_saver_adapter", None)
    if saver is None or not getattr(saver, "enabled", False):
        return False
    return not bool(getattr(getattr(scheduler, "server_args", None), "enable_weights_cpu_backup", False))


def hook_applied(cls: type, method: str, hook: Callable[..., Any]) -> bool:
    """Whether ``cls.method`` (as ``cls`` resolves it) is wrapped by SGLang's hook registry around ``hook``."""
    fn: Any = next((klass.__dict__[method] for klass in cls.__mro__ if method in klass.__dict__), None)
    while fn is not None:
        if any(
            getattr(cell, "cell_contents", None) is hook for cell in (getattr(fn, "__closure__", None) or ())
        ):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def start_worker(scheduler: Any, settings: Settings | None = None) -> SchedulerWorker:
    """Build the adapter for ``scheduler``'s model and serve it; attach it to the scheduler."""
    from weightwire.server import serve

    runner = scheduler.tp_worker.model_runner
    if settings is None:
        settings = Settings.from_env(engine_port=getattr(scheduler.server_args, "port", None))
    if getattr(scheduler, "draft_worker", None) is not None:
        log.warning("weightwire: speculative decoding is on; only the target model's weights are updated")
    cache_mode = getattr(scheduler.server_args, "weight_cache_mode", None)
    if cache_mode not in (None, "off"):
        raise RuntimeError(
            f"weightwire: --weight-cache-mode {cache_mode} shares the model's parameters with SGLang's weight-cache "
            "daemon, so writing them in place would change every engine attached to it; start with "
            "--weight-cache-mode off"
        )
    rank = parallel_rank()
    device = torch.device(runner.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    wake_receiver, wake_sender = idle_wakers(scheduler, settings, rank)
    queue = EngineTaskQueue(
        timeout_s=settings.engine_timeout_s, on_submit=wake_sender.wake if wake_sender is not None else None
    )
    adapter = build_adapter(
        runner.model,
        runner.model_config.hf_config,
        rank=rank,
        device=device,
        own_device=device_ref_of(device),
        worker_id=worker_id(rank),
        engine_queue=queue,
        weight_session=weight_session_of(runner),
        weights_asleep=functools.partial(released_weights, scheduler),
        engine_gate=functools.partial(
            scheduler_gate, scheduler, pause_honoured=pause_honoured(scheduler, rank)
        ),
        on_committed=functools.partial(after_commit, scheduler, settings),
        idle_wait_s=settings.idle_wait_s,
        direct_copy=os.environ.get(ENV_DIRECT_COPY, "1") != "0",
        phase_log=os.environ.get(ENV_PHASE_LOG) or None,
    )
    address = settings.address(rank)
    socket_path = None
    if address.startswith("unix:"):
        socket_path = address.removeprefix("unix:")
        prepare_socket(socket_path, env_hint=f"its own {ENV_SOCKET_DIR} or --port")
    server = serve(
        adapter,
        listen=address,
        token=settings.endpoints.token,
        tls_cert=settings.endpoints.tls_cert,
        tls_key=settings.endpoints.tls_key,
        own_device=adapter.own_device,
    )
    worker = SchedulerWorker(adapter, queue, server, server.address, socket_path, wake_receiver, wake_sender)
    setattr(scheduler, _WORKER_ATTR, worker)
    atexit.register(worker.stop)
    # Metrics into SGLang's own /metrics (its prometheus multiprocess directory, --enable-metrics).
    # Imported only here, in the scheduler, after SGLang set PROMETHEUS_MULTIPROC_DIR for it.
    from weightwire.server.observe.metrics import engine_metrics

    engine_metrics(server.service, engine="sglang", port_offset=worker_index(rank))
    return worker


def weight_session_of(runner: Any) -> WeightUpdateSession:
    """SGLang's begin/end weight-update steps where the release has them (0.5.23), else none:
    SGLang 0.5.17's own updates call ``load_weights`` with nothing around it."""
    updater = getattr(runner, "weight_updater", None)
    if (
        updater is not None
        and hasattr(updater, "begin_weight_update")
        and hasattr(updater, "end_weight_update")
    ):
        return updater  # type: ignore[no-any-return]
    return NoWeightSession()


def idle_wakers(
    scheduler: Any, settings: Settings, rank: ParallelRank
) -> tuple[WakeReceiver | None, WakeSender | None]:
    """The wake socket this scheduler polls when it sleeps on idle, and the sender that wakes every
    sleeper of this rank's replica (``wake.py``); (None, None) when the engine does not sleep."""
    if not getattr(scheduler.server_args, "sleep_on_idle", True):
        return None, None
    key = settings.engine_key()
    receiver = attach_to_idle_sleeper(scheduler, key, worker_index(rank))
    replica = [
        worker_index(dataclasses.replace(rank, pp_rank=p, tp_rank=t))
        for p in range(rank.pp_size)
        for t in range(rank.tp_size)
    ]
    return receiver, WakeSender(key, replica)


def pause_honoured(scheduler: Any, rank: ParallelRank) -> bool:
    """Whether this scheduler's event loop stops running batches while ``_engine_paused``.

    In SGLang 0.5.17 through 0.5.23 the normal, overlap and disaggregation loops do; the
    pipeline-parallel and PD-multiplexing loops never look at the flag and keep running the batches an in-place or
    retract pause left behind.
    """
    return rank.pp_size == 1 and not getattr(scheduler, "enable_pdmux", False)


def scheduler_gate(scheduler: Any, *, pause_honoured: bool) -> str | None:
    """None when writing weights cannot overlap a batch: the engine has no request, or is paused
    and its event loop honours the pause (released weights: ``released_weights``)."""
    if scheduler.is_fully_idle():
        return None
    load = f"{len(scheduler.waiting_queue)} waiting, {len(scheduler.running_batch.reqs)} running"
    if getattr(scheduler, "_engine_paused", False):
        if pause_honoured:
            return None
        return (
            f"the engine is paused but still holds requests ({load}), and SGLang's pipeline-parallel "
            "event loop keeps running them while paused; pause with POST /pause_generation "
            '{"mode": "abort"}'
        )
    return f"the engine is serving requests ({load}); call POST /pause_generation first"


def released_weights(scheduler: Any) -> str | None:
    """None while the weights are in place, else why a push cannot write them now: SGLang holds the
    weights tag released (both supported releases keep the released tags in
    ``scheduler.weight_updater.offload_tags``). With the memory saver the parameters' memory is then
    unmapped (a GPU write faults) and the stash SGLang restores on resume would overwrite it."""
    tags = getattr(getattr(scheduler, "weight_updater", None), "offload_tags", None) or ()
    if WEIGHTS_TAG not in tags:
        return None
    return (
        "SGLang released its weights (release_memory_occupation with the weights tag); call POST "
        '/resume_memory_occupation {"tags": ["weights"]} (Engine.resume_memory_occupation) before pushing'
    )


def after_commit(scheduler: Any, settings: Settings, version: int) -> None:
    """On the scheduler thread after an update: tell SGLang its weight version (where the scheduler
    keeps one: 0.5.23 reports it in every response's ``meta_info.weight_version``), drop stale KV."""
    record = getattr(scheduler, "record_weight_version_change", None)
    if record is not None:
        record(new_version=str(version))
    # Without emptying torch's allocator cache, as SGLang's own updates flush (their
    # torch_empty_cache defaults to False): the next batch then need not allocate afresh.
    if settings.flush_cache and not scheduler.flush_cache(empty_cache=False):
        log.warning(
            "weightwire: weights version %d loaded but SGLang kept its cache (requests still running); "
            "call POST /flush_cache before resuming",
            version,
        )


def parallel_rank() -> ParallelRank:
    """This process's ranks from SGLang's runtime context."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    return engine_rank(
        tp=(p.tp_rank, p.tp_size),
        pp=(p.pp_rank, p.pp_size),
        dp=(_read(p, "dp_rank", None), _read(p, "dp_size", 1)),
        sp=(_read(p, "attn_cp_rank", 0) or 0, _read(p, "attn_cp_size", 1) or 1),
    )


def _read(parallel: Any, name: str, default: Any) -> Any:
    try:
        return getattr(parallel, name)
    except (AttributeError, RuntimeError, ValueError):
        return default


def _sglang_version() -> str:
    try:
        import sglang

        return str(sglang.__version__)
    except Exception:
        return "unknown"
