"""``EngineAdapter`` for one vLLM worker: its manifest from the real model, loads through vLLM's
layerwise reload.

The worker service calls ``begin_update`` / ``load`` / ``end_update`` on its gRPC thread.

When an update may run. vLLM's own weight-transfer API brackets every update with
``start_weight_update()`` and ``finish_weight_update(weight_version=...)``, and asks the trainer to
pause generation around them. The backend (``weightwire.adapters.vllm.backend``) turns those two
calls into an update window on every worker; a push outside the window is refused with
ENGINE_NOT_PAUSED before anything is touched, and ``finish_weight_update`` waits for a push still
running. Inside the window the ``ForwardGate`` keeps forward passes and writes of this worker apart
(a forward waits for the write, a write for a running forward), so even an engine that was not
paused never runs a forward on a half-written or meta-device parameter.

How tensors are loaded. vLLM's layerwise reload (``vllm.model_executor.model_loader.reload``) is
what refreshes kernel-layout weights (repacked on CPU, quantized kernels on GPU): a layer is put
back into model format on the meta device, the model's own ``load_weights`` buffers each incoming
tensor through the layer's weight loaders, and once every tensor of the layer has arrived the layer
is materialised, loaded, post-processed and copied into the kernel tensors that the forward pass
reads. A bare ``load_weights`` after start-up writes into the placeholders and changes nothing (or
fails). Here each vLLM layer that an update touches is opened for reload when its first tensor
arrives and finalized when the update ends, so all chunks of one update land in one reload
session, and layers the update does not touch are left alone (a PARTIAL update of ``lm_head``
reloads only ``lm_head``).

Sleep and wake. vLLM's ``LLM.sleep(level)`` / ``wake_up(tags)`` reach every worker's
``Worker.sleep`` / ``Worker.wake_up``, which the backend hooks (``sleep_hooks`` in
``weightwire.adapters.vllm.backend``) to call ``sleeping(level)`` before and ``woken(tags)`` after.
While the weights are released every push is refused at ``begin_update`` with ENGINE_ASLEEP,
before anything is touched (writing into unmapped memory would end the worker, and with it the
EngineCore); a sleep waits for a push still open on this worker, so no write overlaps the release.
vLLM's CuMemAllocator maps the memory again at the same virtual addresses, so the direct-copy
regions below stay valid (they re-check their storage on every use); after a level-2 sleep (the
weights' bytes discarded) the proofs are forgotten, so the next push of each layer goes through
vLLM's reload, which writes the whole layer (padding rows included), and is checked again.

Direct copies (``direct.py``). From the second time a layer arrives whole in one ``load`` on, a
layer whose first reload was checked to be nothing but a copy of the pushed tensors into regions of
its kernel tensors (the same objects at the same storage before and after, nothing else of the layer
or its ``quant_method`` changed, every region holding exactly the pushed piece) is copied straight
into those regions, in one grouped copy, without the reload's round trip. CUDA graphs read the same
storage either way. Layers that repack (every linear and embedding on CPU), tied layers, layers the
check could not prove, and layers split over buckets keep going through the reload.

Fused layers must arrive whole. vLLM processes a layer only when all of it is loaded; a layer with
some of its tensors missing at the end would be materialised with the rest uninitialised. So a
committed update must deliver every checkpoint tensor of each layer it touches (q/k/v weights and
biases of one ``qkv_proj``, gate and up of one ``gate_up_proj``); otherwise the commit is refused
with INCOMPLETE_UPDATE naming each such layer's missing tensors, those layers keep their old weights
(what vLLM buffered for them is dropped), and the worker reports INCONSISTENT only if the update
wrote other, complete layers: ``touched_model()`` tells the service whether anything was written,
so an update that only buffered parts of fused layers (a PARTIAL push of ``q_proj`` alone) leaves a
CONSISTENT worker at its old version.

Tensors that wait. vLLM buffers a tensor until its layer is complete, but the service's views into
the sender's buffer are valid only during ``load``; a tensor whose layer does not complete within
the same ``load`` call (a layer split across two buckets) is copied first. Every tensor must be
consumed: ``load_weights`` returns the parameters it loaded, and one that did not reach its layer
is LOAD_FAILED by name.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from weightwire.adapters.endpoints import worker_id as default_worker_id
from weightwire.adapters.rank_adapter import UpdatePhaseTimes, check_pushed_tensor, rank_manifest
from weightwire.adapters.vllm.direct import DirectLayers, LayerSnapshot, copy_pairs, snapshot
from weightwire.adapters.vllm.forward_gate import ForwardGate
from weightwire.adapters.vllm.manifest import ModelLayout, model_layout
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef, device_ref_of
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest

# Under "vllm." so that vLLM's own log configuration prints it in every worker process.
log = logging.getLogger("vllm.weightwire")

_ASLEEP = (
    'vLLM released this worker\'s weights (sleep level {level}); call wake_up() (LLM.wake_up(tags=["weights"]), '
    "or POST /wake_up?tags=weights) before pushing{after}"
)
_NOT_IN_WINDOW = (
    "vLLM has no weight update open on this worker: call start_weight_update() first (LLM.start_weight_update(), "
    "or POST /start_weight_update after POST /pause), push, then finish_weight_update(weight_version=...)"
)


class VLLMAdapter:
    """Publishes what one vLLM worker consumes and loads pushed tensors through vLLM's reload."""

    def __init__(
        self,
        model: torch.nn.Module,
        vllm_config: Any,
        *,
        rank: ParallelRank,
        device: torch.device,
        own_device: DeviceRef | None = None,
        worker_id: str | None = None,
        forward_wait_s: float = 30.0,
        direct_copy: bool = True,
    ) -> None:
        """``direct_copy``: proven layers are copied straight into their kernel tensors (module
        docstring); False: every layer through vLLM's reload."""
        self.model = model
        self.vllm_config = vllm_config
        self.rank = rank
        self.device = torch.device(device)
        self.own_device = own_device if own_device is not None else device_ref_of(self.device)
        self.worker_id = worker_id or default_worker_id(rank)
        self.forward_wait_s = forward_wait_s
        self.layout: ModelLayout = model_layout(model, vllm_config.model_config.hf_config)
        modules = dict(model.named_modules())
        self._layers = {name: modules[name] for name in self.layout.names_by_layer}
        self._tied = {name: modules[name] for names in self.layout.tied_layers.values() for name in names}
        self.direct = DirectLayers(self.layout, self._layers, enabled=direct_copy)
        self.gate = ForwardGate()
        self._remove_hooks = self.gate.install(model)
        self._manifest = rank_manifest(
            self.own_device,
            rank,
            (
                OwnedTensor(t.name, dtypes.from_torch(t.dtype), t.shape, t.pieces)
                for t in self.layout.targets.values()
            ),
            self.layout,
            engine="vllm",
            worker_id=self.worker_id,
        )
        # Window and update state, shared by the worker's main thread (window) and the gRPC thread.
        self._cond = threading.Condition()
        self._window_open = False
        self._closing = False
        self._update_version: int | None = None
        # The level of the sleep that holds this worker's weights released (None: awake).
        self._asleep_level: int | None = None
        self.committed_version: int | None = None
        # Per update, gRPC thread only: layers opened for reload -> checkpoint names still missing.
        self._open_layers: dict[str, set[str]] = {}
        self._writing = False
        # Whether this update (the last one, once it ended) changed the model: a layer of it was
        # processed by vLLM. Kept after end_update for the service's touched_model() question.
        self._wrote = False
        # Where the current update's time goes on this worker; the last one's once it ended.
        self._phases = UpdatePhases(0)
        self.last_phases: UpdatePhases | None = None
        self._t_begin = 0

    # --- the update window (vLLM's start/finish_weight_update, on the worker's main thread) ----

    def open_window(self) -> None:
        with self._cond:
            self._window_open, self._closing = True, False

    def close_window(self, timeout_s: float) -> None:
        """Refuse new updates, wait up to ``timeout_s`` for a running one, then close the window."""
        with self._cond:
            self._closing = True
            if not self._cond.wait_for(lambda: self._update_version is None, timeout=timeout_s):
                self._closing = False
                raise RuntimeError(
                    f"weightwire {self.worker_id}: update {self._update_version} is still running after "
                    f"{timeout_s:g} s; call finish_weight_update again once the push returned"
                )
            self._window_open, self._closing = False, False

    @property
    def window_open(self) -> bool:
        return self._window_open

    # --- sleep and wake (vLLM's Worker.sleep / wake_up, on the worker's main thread) -----------

    def sleeping(self, level: int, timeout_s: float) -> None:
        """Before vLLM releases this worker's memory: wait up to ``timeout_s`` for a push still open
        here, then refuse pushes until ``woken``. RuntimeError (the sleep does not happen) when the
        push does not end in time: its writes would land in released memory."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._update_version is None, timeout=timeout_s):
                raise RuntimeError(
                    f"weightwire {self.worker_id}: update {self._update_version} is still running after "
                    f"{timeout_s:g} s; sleep once the push returned"
                )
            self._asleep_level = int(level)
        log.info(
            "weightwire %s: vLLM sleeps (level %d); pushes are refused until wake_up", self.worker_id, level
        )

    def sleep_failed(self, level_before: int | None) -> None:
        """vLLM's sleep raised: its memory stays where it was, so the state before it holds again."""
        with self._cond:
            self._asleep_level = level_before

    def woken(self, tags: Sequence[str] | None) -> None:
        """After vLLM mapped memory again: with the weights among ``tags`` (None: every tag), pushes
        are accepted again; after a level-2 sleep the direct-copy proofs are forgotten (module docstring)."""
        if tags is not None and "weights" not in tags:
            return
        with self._cond:
            level, self._asleep_level = self._asleep_level, None
        if level is not None and level >= 2:
            forgotten = self.direct.forget()
            if forgotten:
                log.info(
                    "weightwire %s: woken after a level-%d sleep (weights discarded); %d layer(s) go through vLLM's "
                    "reload on their next push and are checked again",
                    self.worker_id,
                    level,
                    forgotten,
                )

    @property
    def asleep_level(self) -> int | None:
        return self._asleep_level

    def close(self) -> None:
        """Remove the forward hooks (worker shutdown)."""
        self._remove_hooks()

    # --- EngineAdapter -------------------------------------------------------------------------

    def manifest(self) -> ShardManifest:
        return self._manifest

    def begin_update(self, version: int) -> None:
        with self._cond:
            if self._asleep_level is not None:
                after = (
                    "; its weights were discarded (level 2): push every tensor (a FULL update) after waking"
                    if self._asleep_level >= 2
                    else ""
                )
                raise WeightwireError(
                    Reason.ENGINE_ASLEEP,
                    f"{self.worker_id}: cannot begin update {version}: "
                    + _ASLEEP.format(level=self._asleep_level, after=after),
                    sleep_level=str(self._asleep_level),
                )
            if not self._window_open or self._closing:
                what = (
                    "vLLM is finishing its weight update on this worker" if self._closing else _NOT_IN_WINDOW
                )
                raise WeightwireError(
                    Reason.ENGINE_NOT_PAUSED, f"{self.worker_id}: cannot begin update {version}: {what}"
                )
            self._update_version = version
        self._open_layers = {}
        self._wrote = False
        self._phases = UpdatePhases(version)
        self._t_begin = time.perf_counter_ns()

    def touched_model(self) -> bool:
        """Whether the current or last update changed the model (read by the worker service when an
        update fails: a worker whose model is unchanged stays CONSISTENT)."""
        return self._wrote

    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter_ns()
        try:
            self._load(named_tensors)
        finally:
            self._phases.loads += 1
            self._phases.load_ns += time.perf_counter_ns() - t0

    def _load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            self._check_tensor(name, tensor)
        if not named_tensors:
            return
        if not self._writing:
            if not self.gate.begin_write(self.forward_wait_s):
                raise WeightwireError(
                    Reason.ENGINE_NOT_PAUSED,
                    f"{self.worker_id}: a forward pass has run for over {self.forward_wait_s:g} s on this worker; "
                    "pause generation (POST /pause, or no LLM.generate in flight) before pushing",
                )
            self._writing = True
            self._synchronize()  # kernels of the last forward may still read the weights
        arriving: dict[str, set[str]] = {}
        for name, _ in named_tensors:
            arriving.setdefault(self.layout.targets[name].layer_name, set()).add(name)
        by_name = dict(named_tensors)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in list(arriving):
            found = None if layer in self._open_layers else self.direct.direct_pairs(layer, by_name)
            if found is not None:
                pairs.extend(found)
                del arriving[layer]
        if pairs:
            t0 = time.perf_counter_ns()
            with self._vllm_context():
                copy_pairs(pairs)
            self._wrote = True
            self._phases.direct_tensors += len(pairs)
            self._phases.copy_ns += time.perf_counter_ns() - t0
        if not arriving:
            self._synchronize()  # the service acks when we return; the sender may then reuse its buffer
            return
        named_tensors = [(n, t) for n, t in named_tensors if self.layout.targets[n].layer_name in arriving]
        # A tensor stays in vLLM's reload buffers until its layer is complete; views into the
        # sender's buffer die when this call returns, so tensors of layers that stay open are copied.
        stays_open = {
            layer
            for layer, names in arriving.items()
            if self._open_layers.get(layer, self.layout.names_by_layer[layer]) - names
        }
        batch = [
            (name, tensor.clone() if self.layout.targets[name].layer_name in stays_open else tensor)
            for name, tensor in named_tensors
        ]
        t0 = time.perf_counter_ns()
        with self._vllm_context():
            self._load_batch(batch, arriving)
        self._phases.reload_tensors += len(batch)
        self._phases.reload_ns += time.perf_counter_ns() - t0
        self._synchronize()  # the service acks when we return; the sender may then reuse its buffer

    def end_update(self, success: bool) -> None:
        if self._update_version is None:
            return  # begin was refused, or this update already ended
        version = self._update_version
        try:
            incomplete = {layer: missing for layer, missing in self._open_layers.items() if missing}
            if incomplete:
                self._restore(
                    incomplete, why="committed without them" if success else f"update {version} failed"
                )
            self._finalize(set(self._open_layers) - set(incomplete))
            if success and incomplete:
                raise WeightwireError(
                    Reason.INCOMPLETE_UPDATE,
                    f"{self.worker_id}: vLLM reloads a layer only whole, and update {version} left "
                    + "; ".join(
                        f"{layer} without {', '.join(sorted(m))}" for layer, m in sorted(incomplete.items())
                    )
                    + " (nothing of those layers was loaded; they keep their old weights); send every checkpoint "
                    "tensor of a fused layer (q/k/v, gate/up, their biases) in the same update",
                )
            if success:
                self.committed_version = version
        finally:
            self._open_layers = {}
            if self._writing:
                self._writing = False
                self.gate.end_write()
            self._phases.total_ns = time.perf_counter_ns() - self._t_begin
            self.last_phases = self._phases
            with self._cond:
                self._update_version = None
                self._cond.notify_all()

    # --- internals -----------------------------------------------------------------------------

    @contextmanager
    def _vllm_context(self) -> Iterator[None]:
        from vllm.config import set_current_vllm_config

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            yield

    def _check_tensor(self, name: str, tensor: torch.Tensor) -> None:
        target = self.layout.targets.get(name)
        check_pushed_tensor(self.worker_id, name, tensor, (target.dtype, target.shape) if target else None)

    def _load_batch(self, batch: list[tuple[str, torch.Tensor]], arriving: dict[str, set[str]]) -> None:
        """One ``load_weights`` call for a bucket's tensors (per-call overhead is per bucket, not per
        tensor), then a check that each tensor reached its layer."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        buffered_before: dict[str, int] = {}
        # Layers arriving whole that may be copied directly later: checked once their reload ran.
        checking: dict[str, LayerSnapshot] = {}
        for layer in arriving:
            if layer not in self._open_layers:
                if arriving[layer] == self.layout.names_by_layer[layer] and self.direct.candidate(layer):
                    checking[layer] = snapshot(self._layers[layer])
                initialize_layerwise_reload(self._layers[layer])
                self._open_layers[layer] = set(self.layout.names_by_layer[layer])
            buffered_before[layer] = len(get_layerwise_info(self._layers[layer]).loaded_weights)
        loaded = self.model.load_weights(batch)  # type: ignore[operator]
        for layer, names in arriving.items():
            info = get_layerwise_info(self._layers[layer])
            # Processed (its last tensor arrived, vLLM loaded and repacked it), or buffered: every
            # tensor sent to the layer is one more buffered load of it.
            reached = not info.can_load() or len(info.loaded_weights) == buffered_before[layer] + len(names)
            unreported = sorted(
                n
                for n in names
                if isinstance(loaded, set) and not _reported(self.layout.targets[n].param_name, loaded)
            )
            if not reached or unreported:
                first = unreported[0] if unreported else sorted(names)[0]
                target = self.layout.targets[first]
                raise WeightwireError(
                    Reason.LOAD_FAILED,
                    f"{self.worker_id}: vLLM's load_weights did not consume {', '.join(unreported or sorted(names))}: "
                    f"they should fill {layer} ({target.param_name}"
                    + (f", shard {target.shard_id!r}" if target.shard_id is not None else "")
                    + f"), it reported loading {_names(loaded) if isinstance(loaded, set) else 'nothing it could name'}",
                    tensor=first,
                )
            self._open_layers[layer] -= names
            if not self._open_layers[layer]:
                self._wrote = True  # vLLM processed the complete layer: its kernel tensors hold new values
        pushed = dict(batch)
        for layer, before in checking.items():
            if get_layerwise_info(self._layers[layer]).can_load():
                continue  # vLLM defers this layer's processing to the finalize: checked another time
            why = self.direct.verify(layer, before, pushed)
            if why is not None:
                log.info(
                    "weightwire %s: %s keeps loading through vLLM's reload: %s", self.worker_id, layer, why
                )

    def _restore(self, layers: dict[str, set[str]], *, why: str) -> None:
        """Drop what vLLM buffered for these layers, so finalizing puts their old kernel tensors back."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        for layer in layers:
            info = get_layerwise_info(self._layers[layer])
            info.loaded_weights = []
            info.load_numel = 0
        log.warning(
            "weightwire %s: keeping the old weights of %d layer(s) that did not receive all their tensors (%s): %s",
            self.worker_id,
            len(layers),
            why,
            ", ".join(sorted(layers)),
        )

    def _finalize(self, reloaded: set[str]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._open_layers:
            return
        with self._vllm_context():
            for layer in self._open_layers:
                finalize_layerwise_reload(self._layers[layer], self.vllm_config.model_config)
            # vLLM's reload post-processes only the layer it loaded (its documented limit for tied
            # parameters); a layer sharing the parameter keeps kernels built from the old values
            # (on CPU a tied lm_head packs its own copy of the embedding), so rebuild them.
            for layer in sorted(reloaded):
                for tied in self.layout.tied_layers.get(layer, ()):
                    module = self._tied[tied]
                    method = getattr(module, "quant_method", None)
                    if method is not None:
                        method.process_weights_after_loading(module)
            for layer in sorted(reloaded):
                _repack_cpu_experts(self._layers[layer])
        self._synchronize()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            t0 = time.perf_counter_ns()
            torch.cuda.synchronize(self.device)
            self._phases.sync_ns += time.perf_counter_ns() - t0


@dataclasses.dataclass
class UpdatePhases(UpdatePhaseTimes):
    """Where one update's time went on this vLLM worker (nanoseconds): of ``load_ns``,
    ``copy_ns`` direct copies and ``reload_ns`` vLLM's reload (``sync_ns`` device synchronizes end
    the copies); ``total_ns`` includes the worker service's receiving and opening of buckets."""

    direct_tensors: int = 0
    reload_tensors: int = 0
    copy_ns: int = 0
    reload_ns: int = 0


def _repack_cpu_experts(layer: torch.nn.Module) -> None:
    """Prepack a reloaded MoE layer's experts again for vLLM's CPU kernel.

    vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts kernel's own
    ``process_weights_after_loading`` (on CPU: ``cpu_prepack_moe_weight`` into its grouped-GEMM
    layout) only the first time; on a weight update it copies the reloaded model-format weights
    into the prepacked storage, which the CPU kernel then reads as packed (wrong tokens, no error).
    """
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is not None and any(c.__name__ == "CPUUnquantizedExperts" for c in type(experts).__mro__):
        experts.process_weights_after_loading(layer)


def _reported(param_name: str, loaded: set[str]) -> bool:
    """Whether ``load_weights`` reported loading ``param_name``. A mixture-of-experts layer's
    parameters live in its ``MoERunner``'s ``routed_experts`` child; vLLM 0.32 reports them under that
    module's name, vLLM 0.26 (whose runner loads its experts itself) under the runner's."""
    if param_name in loaded:
        return True
    module, _, leaf = param_name.rpartition(".")
    return module.endswith(".routed_experts") and f"{module.removesuffix('.routed_experts')}.{leaf}" in loaded


def _names(names: set[str], limit: int = 10) -> str:
    items = sorted(names)
    return (
        ", ".join(items[:limit]) + (f" ... and {len(items) - limit} more" if len(items) > limit else "")
        if items
        else "nothing"
    )
