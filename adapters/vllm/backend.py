"""vLLM weight-transfer backend ``weightwire``: a weightwire worker service inside every vLLM worker.

vLLM builds the configured weight-transfer engine in each worker process right after the model is
loaded (``Worker.load_model``, when ``LLM(weight_transfer_config=WeightTransferConfig(backend=
"weightwire"))`` or ``vllm serve --weight-transfer-config '{"backend": "weightwire"}'``). The plugin
(``weightwire.adapters.vllm.plugin``) registers this class under that name in every vLLM process.
Building it starts the rank's worker service at the address its ranks give (``settings.py``); an
exception here leaves ``load_model``, so an engine that asked for weightwire does not start without it.

vLLM's weight-transfer calls map to weightwire as follows; the trainer pushes the bytes itself with
``weightwire.client.WeightPusher``, straight into the workers:

- ``init_weight_transfer_engine`` (optional): nothing to rendezvous; accepts an empty ``init_info``.
- ``start_weight_update``: opens the update window on this worker (pushes outside it are refused
  with ENGINE_NOT_PAUSED).
- ``update_weights``: not used; weightwire's bytes never travel through vLLM's RPC. Refused with a
  message saying so.
- ``finish_weight_update``: waits for a push still running, closes the window. With
  ``weight_version=...`` vLLM then records the version for its outputs.
- ``shutdown``: stops the worker service, removes its socket and, when the engine's socket directory
  is the default one made for it (``<tmp>/weightwire-vllm-<instance id>``), that directory once the
  engine's last worker left it.
- ``LLM.sleep(level)`` / ``LLM.wake_up(tags)`` (``POST /sleep``, ``/wake_up``): ``sleep_hooks``
  wraps the worker's own ``Worker.sleep`` / ``Worker.wake_up`` in this process, once, so that the
  adapter refuses pushes (ENGINE_ASLEEP) from before the memory is released until the weights are
  mapped again (``VLLMAdapter.sleeping`` / ``woken``). Workers whose class overrides them (vLLM's
  CPU worker, whose sleep releases nothing) are left alone.
- ``trainer_send_weights``: abstract in vLLM 0.26 and 0.27 (a static method for the trainer);
  weightwire's trainer side is ``WeightPusher``, so it raises a message saying so.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from weightwire.adapters.endpoints import engine_rank, prepare_socket, worker_id, worker_index
from weightwire.adapters.vllm.deltas import build_adapter
from weightwire.adapters.vllm.plugin import check_version
from weightwire.adapters.vllm.settings import ENV_BASE_PORT, ENV_SOCKET_DIR, Settings, default_socket_dir
from weightwire.adapters.vllm.slices import SlicesVLLMAdapter
from weightwire.core.devices import device_ref_of
from weightwire.core.manifest import ParallelRank

# Under "vllm." so that vLLM's own log configuration prints it in every worker process.
log = logging.getLogger("vllm.weightwire")


@dataclasses.dataclass
class WeightwireInitInfo(WeightTransferInitInfo):
    """No fields: the trainer connects to each worker over gRPC, nothing is set up through vLLM."""


@dataclasses.dataclass
class WeightwireUpdateInfo(WeightTransferUpdateInfo):
    """No fields: ``update_weights`` is not used with this backend."""


class WeightwireWeightTransferEngine(WeightTransferEngine[WeightwireInitInfo, WeightwireUpdateInfo]):
    """Serves one vLLM worker's weights over weightwire's gRPC contract (see the module docstring)."""

    init_info_cls = WeightwireInitInfo
    update_info_cls = WeightwireUpdateInfo
    # Only the target model is served; vLLM refuses start_draft_weight_update for this backend.
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        from weightwire.server import serve

        check_version(_vllm_version())
        self.settings = Settings.from_env(str(vllm_config.instance_id))
        rank = parallel_rank(vllm_config)
        # Receives slices from every trainer rank too (slices.py): vLLM reloads what arrives; and
        # applies delta updates where it can (deltas.py).
        self.adapter = build_adapter(
            model,
            vllm_config,
            rank=rank,
            device=device,
            own_device=device_ref_of(device),
            worker_id=worker_id(rank),
            forward_wait_s=self.settings.forward_wait_s,
            direct_copy=self.settings.direct_copy,
            delta_copies=self.settings.delta_copies,
        )
        address = self.settings.endpoints.address(rank)
        self._socket_path: str | None = None
        # The directory made for this engine alone (no WEIGHTWIRE_VLLM_SOCKET_DIR): removed at shutdown.
        self._own_socket_dir: str | None = None
        if address.startswith("unix:"):
            self._socket_path = address.removeprefix("unix:")
            if self.settings.endpoints.socket_dir == default_socket_dir(str(vllm_config.instance_id)):
                self._own_socket_dir = os.path.dirname(self._socket_path)
            prepare_socket(self._socket_path, env_hint=f"its own {ENV_SOCKET_DIR} or {ENV_BASE_PORT}")
        self.server = serve(
            self.adapter,
            listen=address,
            token=self.settings.endpoints.token,
            tls_cert=self.settings.endpoints.tls_cert,
            tls_key=self.settings.endpoints.tls_key,
            own_device=self.adapter.own_device,
        )
        self.address = self.server.address
        sleep_hooks()
        self._stopped = False
        atexit.register(self.shutdown)
        # Metrics into vLLM's /metrics when its prometheus runs in multiprocess mode (several API
        # servers, or PROMETHEUS_MULTIPROC_DIR set), or on WEIGHTWIRE_METRICS_PORT + worker index.
        from weightwire.server.observe.metrics import engine_metrics

        engine_metrics(self.server.service, engine="vllm", port_offset=worker_index(rank))
        manifest = self.adapter.manifest()
        log.info(
            "weightwire: worker %s of vLLM %s serves %d checkpoint tensors (%.1f MiB, layers [%d, %d) of %d) at %s",
            self.adapter.worker_id,
            _vllm_version(),
            len(manifest.tensors),
            manifest.total_bytes / 2**20,
            manifest.layer_start,
            manifest.layer_end,
            manifest.num_layers,
            self.address,
        )

    def init_transfer_engine(self, init_info: WeightwireInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        self.adapter.open_window()

    def finish_weight_update(self) -> None:
        self.adapter.close_window(self.settings.finish_wait_s)

    def receive_weights(self, update_info: WeightwireUpdateInfo) -> None:
        # vLLM ends its update session when update_weights fails; close the window with it.
        self.adapter.close_window(self.settings.finish_wait_s)
        raise RuntimeError(
            "the weightwire backend receives weights over gRPC: push with weightwire.client.WeightPusher "
            f"to the workers' addresses (worker {self.adapter.worker_id} listens at {self.address}) between "
            "start_weight_update() and finish_weight_update(); update_weights is not used"
        )

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.server.stop(grace=1.0)
        self.adapter.close()
        if self._socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._socket_path)
        if self._own_socket_dir is not None:
            # Every worker of the engine tries; the last one out finds it empty.
            with contextlib.suppress(OSError):
                os.rmdir(self._own_socket_dir)

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        raise NotImplementedError(
            "the weightwire backend has no vLLM trainer-side sender: push with weightwire.client.WeightPusher "
            "to weightwire.adapters.vllm.worker_endpoints(llm) inside update_window(llm, version)"
        )


_HOOKED = "_weightwire_sleep_hook"


def sleep_hooks() -> bool:
    """Wrap ``vllm.v1.worker.gpu_worker.Worker.sleep`` and ``wake_up`` (once per process) so that the
    weightwire backend a worker holds hears of both; False when this vLLM has neither."""
    from vllm.v1.worker.gpu_worker import Worker

    hooked = False
    for name, wrap in (("sleep", _wrap_sleep), ("wake_up", _wrap_wake_up)):
        original = Worker.__dict__.get(name)
        if original is None:
            continue
        if not getattr(original, _HOOKED, False):
            wrapped = functools.wraps(original)(wrap(original))
            setattr(wrapped, _HOOKED, True)
            setattr(Worker, name, wrapped)
        hooked = True
    return hooked


def _own_adapter(worker: Any) -> SlicesVLLMAdapter | None:
    engine = getattr(worker, "weight_transfer_engine", None)
    return engine.adapter if isinstance(engine, WeightwireWeightTransferEngine) else None


def _wrap_sleep(original: Callable[..., Any]) -> Callable[..., Any]:
    def sleep(worker: Any, level: int = 1, *args: Any, **kwargs: Any) -> Any:
        adapter = _own_adapter(worker)
        if adapter is None:
            return original(worker, level, *args, **kwargs)
        before = adapter.asleep_level
        engine = worker.weight_transfer_engine
        adapter.sleeping(level, engine.settings.finish_wait_s)
        try:
            return original(worker, level, *args, **kwargs)
        except BaseException:
            adapter.sleep_failed(before)
            raise

    return sleep


def _wrap_wake_up(original: Callable[..., Any]) -> Callable[..., Any]:
    def wake_up(worker: Any, tags: list[str] | None = None, *args: Any, **kwargs: Any) -> Any:
        result = original(worker, tags, *args, **kwargs)
        adapter = _own_adapter(worker)
        if adapter is not None:
            adapter.woken(tags)
        return result

    return wake_up


def parallel_rank(vllm_config: Any) -> ParallelRank:
    """This worker's ranks from vLLM's parallel state (TP and PP groups, the DP replica index)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    parallel = vllm_config.parallel_config
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    if pcp > 1:
        # Its ranks are a dimension of their own next to TP and PP; worker ids would collide.
        raise RuntimeError(
            f"weightwire: prefill_context_parallel_size={pcp} is not supported (TP x PP x DP only)"
        )
    tp, pp = get_tp_group(), get_pp_group()
    dp_rank = int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank) or 0)
    return engine_rank(
        tp=(tp.rank_in_group, tp.world_size),
        pp=(pp.rank_in_group, pp.world_size),
        dp=(dp_rank, int(parallel.data_parallel_size or 1)),
    )


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return "unknown"
