"""SGLang plugin: a weightwire worker service inside every SGLang scheduler process.

Registered as entry point ``weightwire`` in group ``sglang.srt.plugins`` (pyproject.toml). SGLang
calls ``register()`` from ``load_plugins()`` in each of its processes (in a scheduler process it is
the first thing ``run_scheduler_process`` does); ``register`` adds two hooks through SGLang's
``HookRegistry``:

- AFTER ``Scheduler.__init__`` (model loaded, KV cache and graphs built, event loop not started):
  build the rank's ``SGLangAdapter`` from the real model, start the worker service at the address
  its ranks give (``settings.py``), and log that the hooks applied. Any failure here raises out of
  ``Scheduler.__init__``, so the engine does not start without weight sync.
- AFTER ``Scheduler.ingest_requests`` (once per pass of every event loop, between batches; where
  SGLang handles its own weight-update requests): run the queued update steps on the scheduler
  thread.

Each hook checks the other applied (SGLang only logs a hook it could not apply), and ``register``
refuses to let the engine start if the hook targets do not exist in the installed SGLang.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import os
import pkgutil
import stat
from collections.abc import Callable
from typing import Any

import torch
from weightwire.adapters.sglang.adapter import SGLangAdapter
from weightwire.adapters.sglang.discovery import unix_socket_alive
from weightwire.adapters.sglang.engine_thread import EngineTaskQueue
from weightwire.adapters.sglang.settings import ENV_ENABLE, Settings, SettingsError, worker_id
from weightwire.core.devices import device_ref_of
from weightwire.core.manifest import ParallelRank

log = logging.getLogger("weightwire.sglang")

INIT_TARGET = "sglang.srt.managers.scheduler.Scheduler.__init__"
INGEST_TARGET = "sglang.srt.managers.scheduler.Scheduler.ingest_requests"
TESTED_SGLANG_VERSION = "0.5.23"
_WORKER_ATTR = "_weightwire_worker"


@dataclasses.dataclass
class SchedulerWorker:
    """What the plugin attached to one scheduler: its adapter, task queue and running server."""

    adapter: SGLangAdapter
    queue: EngineTaskQueue
    server: Any
    address: str
    socket_path: str | None

    def stop(self) -> None:
        self.server.stop(grace=1.0)
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)


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
    for target in (INIT_TARGET, INGEST_TARGET):
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError) as e:
            # load_plugins() only logs a plugin's exceptions; an engine without weight sync must not start.
            msg = (
                f"weightwire: cannot hook {target} in sglang {_sglang_version()} ({e}); this weightwire "
                f"supports sglang {TESTED_SGLANG_VERSION}. Set {ENV_ENABLE}=0 to run without weight sync."
            )
            log.error(msg)
            raise SystemExit(msg) from e
    HookRegistry.register(INIT_TARGET, after_scheduler_init, HookType.AFTER)
    HookRegistry.register(INGEST_TARGET, after_ingest_requests, HookType.AFTER)
    log.info("weightwire: registered hooks on %s and %s", INIT_TARGET, INGEST_TARGET)


def after_scheduler_init(result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``Scheduler.__init__``: start this rank's worker service."""
    if not hook_applied(type(scheduler), "ingest_requests", after_ingest_requests):
        raise RuntimeError(
            f"weightwire: the hook on {INGEST_TARGET} is not in place (see SGLang's log for why), so updates "
            "could never run on the scheduler thread; refusing to start without weight sync"
        )
    worker = start_worker(scheduler)
    log.info(
        "weightwire: hooks on Scheduler.__init__ and Scheduler.ingest_requests applied (sglang %s); worker %s "
        "serves %d checkpoint tensors (%.1f MiB, layers [%d, %d) of %d) at %s",
        _sglang_version(),
        worker.adapter.worker_id,
        len(worker.adapter.manifest().tensors),
        worker.adapter.manifest().total_bytes / 2**20,
        worker.adapter.layout.layer_start,
        worker.adapter.layout.layer_end,
        worker.adapter.layout.num_layers,
        worker.address,
    )


def after_ingest_requests(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``Scheduler.ingest_requests``: run queued update steps on this thread."""
    worker: SchedulerWorker | None = getattr(scheduler, _WORKER_ATTR, None)
    if worker is None:
        raise RuntimeError("weightwire: Scheduler.ingest_requests is hooked but the scheduler has no worker: "
                           f"the hook on {INIT_TARGET} did not run")
    worker.queue.drain()
    return None


def hook_applied(cls: type, method: str, hook: Callable[..., Any]) -> bool:
    """Whether ``cls.method`` (as ``cls`` resolves it) is wrapped by SGLang's hook registry around ``hook``."""
    fn: Any = next((klass.__dict__[method] for klass in cls.__mro__ if method in klass.__dict__), None)
    while fn is not None:
        if any(getattr(cell, "cell_contents", None) is hook for cell in (getattr(fn, "__closure__", None) or ())):
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
    rank = parallel_rank()
    device = torch.device(runner.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    queue = EngineTaskQueue(timeout_s=settings.engine_timeout_s)
    adapter = SGLangAdapter(
        runner.model,
        runner.model_config.hf_config,
        rank=rank,
        device=device,
        own_device=device_ref_of(device),
        worker_id=worker_id(rank),
        engine_queue=queue,
        weight_session=runner.weight_updater,
        engine_gate=functools.partial(scheduler_gate, scheduler, pause_honoured=pause_honoured(scheduler, rank)),
        on_committed=functools.partial(after_commit, scheduler, settings),
    )
    address = settings.address(rank)
    socket_path = None
    if address.startswith("unix:"):
        socket_path = address.removeprefix("unix:")
        prepare_socket(socket_path)
    server = serve(
        adapter,
        listen=address,
        token=settings.token,
        tls_cert=settings.tls_cert,
        tls_key=settings.tls_key,
        own_device=adapter.own_device,
    )
    worker = SchedulerWorker(adapter, queue, server, server.address, socket_path)
    setattr(scheduler, _WORKER_ATTR, worker)
    atexit.register(worker.stop)
    return worker


def pause_honoured(scheduler: Any, rank: ParallelRank) -> bool:
    """Whether this scheduler's event loop stops running batches while ``_engine_paused``.

    In SGLang 0.5.23 the normal, overlap and disaggregation loops do; the pipeline-parallel and
    PD-multiplexing loops never look at the flag and keep running the batches an in-place or
    retract pause left behind.
    """
    return rank.pp_size == 1 and not getattr(scheduler, "enable_pdmux", False)


def scheduler_gate(scheduler: Any, *, pause_honoured: bool) -> str | None:
    """None when writing weights cannot overlap a batch: the engine has no request, or is paused
    and its event loop honours the pause."""
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


def after_commit(scheduler: Any, settings: Settings, version: int) -> None:
    """On the scheduler thread after an update: tell SGLang its weight version, drop stale KV."""
    scheduler.record_weight_version_change(new_version=str(version))
    if settings.flush_cache and not scheduler.flush_cache():
        log.warning(
            "weightwire: weights version %d loaded but SGLang kept its cache (requests still running); "
            "call POST /flush_cache before resuming",
            version,
        )


def parallel_rank() -> ParallelRank:
    """This process's ranks from SGLang's runtime context."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    dp_rank = _read(p, "dp_rank", None)
    dp_size = _read(p, "dp_size", 1) or 1
    if dp_rank is None or dp_rank >= dp_size:
        dp_rank, dp_size = 0, 1
    return ParallelRank(
        tp_rank=p.tp_rank,
        tp_size=p.tp_size,
        pp_rank=p.pp_rank,
        pp_size=p.pp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        sp_rank=_read(p, "attn_cp_rank", 0) or 0,
        sp_size=_read(p, "attn_cp_size", 1) or 1,
    )


def prepare_socket(path: str) -> None:
    """Create the socket directory (0700) and remove a stale socket of a previous run at ``path``."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid != os.getuid():
        raise PermissionError(f"weightwire socket directory {directory} belongs to uid {st.st_uid}, not to us")
    if st.st_mode & 0o077:
        log.warning("weightwire: socket directory %s is accessible to other users (mode %o)", directory, st.st_mode & 0o777)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    if unix_socket_alive(path):
        raise FileExistsError(
            f"another worker is listening at {path} (a second engine with the same socket directory?); "
            "give each engine its own WEIGHTWIRE_SGLANG_SOCKET_DIR or --port"
        )
    os.unlink(path)


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
