"""``EngineAdapter`` for one SGLang rank: its manifest from the real model, loads through SGLang.

The worker service calls ``begin_update`` / ``load`` / ``end_update`` on its gRPC thread. Every one
of them runs on SGLang's scheduler thread instead (through an ``EngineTaskQueue`` the scheduler's
event loop drains between batches), after checking that the engine is paused or idle, so a
forward pass never sees a half-written parameter and never runs while one is written.

Loading goes through SGLang's own path: ``model.load_weights`` with checkpoint names (its weight
loaders slice this rank's TP part and pack q/k/v and gate/up), between the same
``begin_weight_update()`` / ``end_weight_update()`` steps SGLang 0.5.23's ``WeightUpdater`` takes
(they undo and redo quantization packing; for unquantized models they change nothing); SGLang
0.5.17 has no such steps (``NoWeightSession``). Each
tensor is handed to ``load_weights`` on its own with the weight loaders of its target parameters
instrumented, and a tensor that no loader consumed is an error: SGLang's Qwen2/Llama loaders skip
names they do not know with at most a log line.

The first load of a set of tensor names goes through ``load_weights`` as above and then checks
that every region the manifest's slice geometry names (this rank's piece of the checkpoint
tensor, at its shard's rows of the fused parameter) holds exactly what SGLang's loaders wrote
there; later loads of the same names copy those regions directly, in one grouped copy, without
``load_weights``' per-tensor Python. A region the geometry cannot state, or a check that fails,
keeps those names on ``load_weights`` for good; in a set with tensors of no region (a block-FP8
layer's), the others' regions are still checked until proven (``proven``: what a slices update may
copy, ``weightwire.adapters.sglang.slices``). ``prepare_load`` (views the worker serves again)
works out the regions once.

Built by ``weightwire.adapters.sglang.plugin`` inside each scheduler process; tests build it on a
model constructed under SGLang's parallel state.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from weightwire.adapters.rank_adapter import check_pushed_tensor, rank_manifest
from weightwire.adapters.sglang.direct_copy import DirectCopy, destinations, direct_pairs
from weightwire.adapters.sglang.engine_thread import EngineTaskQueue
from weightwire.adapters.sglang.manifest import LoadTarget, ModelLayout, model_layout
from weightwire.adapters.sglang.sessions import (
    LoaderWeightSession,
    UpdatePhases,
    WeightUpdateSession,
)
from weightwire.adapters.sglang.settings import worker_id as default_worker_id
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef, device_ref_of
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest

log = logging.getLogger(__name__)
T = TypeVar("T")

EngineGate = Callable[[], "str | None"]
"""Returns None when the engine may be written to now, else why not (a message for the trainer)."""

WeightsAsleep = Callable[[], "str | None"]
"""Returns None while the weights are in place, else why not (the engine released them: sleep)."""


class SGLangAdapter:
    """Publishes what one SGLang rank consumes and loads pushed tensors through SGLang."""

    def __init__(  # noqa: PLR0913 - known; split when next changed
        self,
        model: torch.nn.Module,
        hf_config: Any,
        *,
        rank: ParallelRank,
        device: torch.device,
        own_device: DeviceRef | None = None,
        worker_id: str | None = None,
        engine_queue: EngineTaskQueue | None = None,
        weight_session: WeightUpdateSession | None = None,
        engine_gate: EngineGate | None = None,
        weights_asleep: WeightsAsleep | None = None,
        on_committed: Callable[[int], None] | None = None,
        idle_wait_s: float = 0.0,
        direct_copy: bool = True,
        phase_log: str | None = None,
    ) -> None:
        """``engine_queue``: where steps run (None: on the calling thread, for a model that no
        engine is running). ``engine_gate``: refuses writes while the engine serves requests;
        a refusal is retried on later passes for ``idle_wait_s`` before the step fails.
        ``weights_asleep``: refuses every step at once (ENGINE_ASLEEP, nothing written) while the
        engine holds its weights released; ``weights_resumed`` is told when they are back.
        ``on_committed(version)``: runs on the engine thread after a successful update.
        ``direct_copy``: prepared loads copy straight into the parameters once checked against
        ``load_weights`` (module docstring); False: every load through ``load_weights``.
        ``phase_log``: a file each update's ``UpdatePhases`` (milliseconds) is appended to as one
        JSON line (profiling; None: not written)."""
        self.model = model
        self.rank = rank
        self.device = torch.device(device)
        self.own_device = own_device if own_device is not None else device_ref_of(self.device)
        self.worker_id = worker_id or default_worker_id(rank)
        self.layout: ModelLayout = model_layout(model, hf_config)
        self._queue = engine_queue
        self._session = (
            weight_session if weight_session is not None else LoaderWeightSession(model, self.device)
        )
        self._gate = engine_gate
        self._asleep = weights_asleep
        self._idle_wait_s = idle_wait_s
        self._on_committed = on_committed
        self._params = dict(model.named_parameters())
        self._direct_copy = direct_copy
        # Sets of names whose regions were checked against load_weights: True (copied directly
        # from then on) or False (load_weights only); bounded by _MAX_DIRECT_KEYS.
        self._direct_state: dict[tuple[str, ...], bool] = {}
        # Names whose regions the last check against load_weights proved (a slices update writes
        # only those: ``weightwire.adapters.sglang.slices``); a failed check takes them out again.
        self.proven: set[str] = set()
        self._phase_log = phase_log
        self.phases: UpdatePhases | None = None
        self._t_begin = 0
        self._t_step_done = 0
        self._version: int | None = None
        self._session_open = False
        # Whether this update (the last one, once it ended) wrote into the model: a load refused
        # before its first write (the engine no longer paused, a tensor that does not fit) leaves
        # the model as it was, and the worker service asks touched_model() before it says INCONSISTENT.
        self._wrote = False
        # Set and read on the engine thread: an update's begin ran there and its end has not.
        self.update_open = False
        self._manifest = rank_manifest(
            self.own_device,
            rank,
            (
                OwnedTensor(
                    name, dtypes.from_torch(found[0].dtype), found[0].shape, self.layout.kept_pieces(name)
                )
                for name, found in self.layout.targets.items()
            ),
            self.layout,
            engine="sglang",
            worker_id=self.worker_id,
        )
        self._dst = destinations(model, self._params, self.layout) if direct_copy else {}
        self._stated: frozenset[str] | None = None
        # Where each parameter's storage was when the regions above were stated (weights_resumed).
        self._param_ptrs = self._storage_ptrs()

    # --- EngineAdapter -------------------------------------------------------------------------

    def manifest(self) -> ShardManifest:
        return self._manifest

    def begin_update(self, version: int) -> None:
        def step() -> None:
            self._session.begin_weight_update()
            self.update_open = True

        self._wrote = False
        self._t_begin = time.perf_counter_ns()
        self._t_step_done = 0
        self.phases = UpdatePhases(version)
        self._gated(step, what=f"begin update {version}", phase="begin")
        self._version = version
        self._session_open = True

    def touched_model(self) -> bool:
        """Whether the current or last update wrote into the model (read by the worker service)."""
        return self._wrote

    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            self._check_tensor(name, tensor)
        if named_tensors:
            self._load_checked(list(named_tensors), None)

    def prepare_load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Callable[[], None]:
        """``load``'s checks and the regions of a direct copy now; the returned function loads
        what the tensors hold each time it is called (the worker keeps it for views it serves again)."""
        named = list(named_tensors)
        for name, tensor in named:
            self._check_tensor(name, tensor)
        pairs = direct_pairs(self.layout, self._dst, named) if self._direct_copy and named else None
        return lambda: self._load_checked(named, pairs) if named else None

    def _load_checked(self, named: list[tuple[str, torch.Tensor]], pairs: DirectCopy | None) -> None:
        """Load checked tensors: copied directly when this set of names was checked against
        ``load_weights`` before, else through ``load_weights`` (checking the regions the first time)."""
        key = tuple(name for name, _ in named)
        state = self._direct_state.get(key) if self._direct_copy else False
        if state is not False and pairs is None:
            pairs = direct_pairs(self.layout, self._dst, named)
            if pairs is None:
                state = self._remember(key, False)
        what = f"load {len(named)} tensor(s)"
        if state is True and pairs is not None:
            direct = pairs

            def copy_step() -> None:
                self._synchronize()  # a forward launched before the pause may still read the weights
                self._wrote = True
                with torch.no_grad():
                    direct.copy()
                self._synchronize()  # the service acks when we return; the sender may then reuse its buffer

            self._count_load(len(named), direct=True)
            self._gated(copy_step, what=what, phase="load")
            return
        check = pairs if state is None else None
        # A set with a tensor of no region (a block-FP8 layer's) loads through load_weights for
        # good; the others of it are checked until proven, so a slices update may copy them.
        rest = self._unproven_with_regions(named) if check is None else None

        def step() -> None:
            self._synchronize()  # a forward launched before the pause may still read the weights
            self._wrote = True
            with torch.no_grad():
                for name, tensor in named:
                    self._load_one(name, tensor)
            self._synchronize()  # the service acks when we return; the sender may then reuse its buffer
            if check is not None:
                ok = check.matches()
                self._remember(key, ok)
                if not ok:
                    log.warning(
                        "%s: SGLang's load_weights wrote other regions than the manifest's slice geometry names "
                        "for %d tensor(s) starting at %s; these keep loading through load_weights",
                        self.worker_id,
                        len(named),
                        named[0][0],
                    )
            elif rest is not None:
                ok = rest.matches()
                proved = {name for name, _ in named if name in self._regions_stated}
                if ok:
                    self.proven.update(proved)
                else:
                    self.proven.difference_update(proved)
                    log.warning(
                        "%s: SGLang's load_weights wrote other regions than the manifest's slice geometry names "
                        "for tensor(s) loaded with %s",
                        self.worker_id,
                        named[0][0],
                    )

        self._count_load(len(named), direct=False)
        self._gated(step, what=what, phase="load")

    def _unproven_with_regions(self, named: list[tuple[str, torch.Tensor]]) -> DirectCopy | None:
        """The regions of those of ``named`` that have regions, when some of ``named`` have none
        and one of the others is not proven yet; else None."""
        if not self._direct_copy or all(name in self._regions_stated for name, _ in named):
            return None
        with_regions = [(name, t) for name, t in named if name in self._regions_stated]
        if not with_regions or all(name in self.proven for name, _ in with_regions):
            return None
        return direct_pairs(self.layout, self._dst, with_regions)

    @property
    def _regions_stated(self) -> frozenset[str]:
        """Names every target of which has a region (``direct_copy.destinations``)."""
        if self._stated is None:
            self._stated = frozenset(
                name
                for name, targets in self.layout.targets.items()
                if all((t.param_name, t.shard_id, name) in self._dst for t in targets)
            )
        return self._stated

    def _remember(self, key: tuple[str, ...], direct: bool) -> bool:
        if len(self._direct_state) >= _MAX_DIRECT_KEYS:
            self._direct_state.clear()
        self._direct_state[key] = direct
        if direct:
            self.proven.update(key)
        else:
            self.proven.difference_update(key)
        return direct

    def _count_load(self, tensors: int, *, direct: bool) -> None:
        if self.phases is not None:
            self.phases.loads += 1
            self.phases.tensors += tensors
            self.phases.direct_loads += int(direct)

    def end_update(self, success: bool) -> None:
        version, was_open = self._version, self._session_open
        self._version, self._session_open = None, False
        if not was_open:
            return  # begin was refused: SGLang's session was never opened, so there is nothing to close

        phases = self.phases

        def step() -> None:
            self.update_open = False
            # Always close SGLang's session: it re-packs what begin unpacked.
            self._session.end_weight_update(run_post_load=False)
            if success and version is not None and self._on_committed is not None:
                t0 = time.perf_counter_ns()
                self._on_committed(version)
                if phases is not None:
                    phases.commit_ns += time.perf_counter_ns() - t0

        self._on_engine(step, what="end update", phase="end")
        if phases is not None:
            phases.total_ns = time.perf_counter_ns() - self._t_begin
            if self._phase_log is not None:
                self._write_phases(phases, success)

    def _write_phases(self, phases: UpdatePhases, success: bool) -> None:
        try:
            with open(self._phase_log, "a", encoding="utf-8") as f:  # type: ignore[arg-type]
                f.write(json.dumps({"worker": self.worker_id, "success": success, **phases.as_ms()}) + "\n")
        except OSError as e:
            log.warning("%s: cannot append update phases to %s: %s", self.worker_id, self._phase_log, e)

    def weights_resumed(self, *, discarded: bool) -> None:
        """On the engine thread, after the engine mapped its released weights again (SGLang's
        ``resume_memory_occupation`` with the weights tag).

        Direct copies write into views of the parameters stated at start: if a parameter's
        storage moved (torch_memory_saver maps the same virtual addresses again, so it should
        not), the regions are stated afresh and every proof forgotten. When the release lost the
        bytes (``discarded``: no CPU backup), what a direct copy leaves unwritten (a vocabulary's
        padding rows) holds whatever the new memory held, so the proofs are forgotten too: the next
        load of each set of names goes through ``load_weights``, which writes whole parameters, and
        checks the regions again."""
        moved = self._storage_ptrs() != self._param_ptrs
        if moved:
            self._params = dict(self.model.named_parameters())
            self._dst = destinations(self.model, self._params, self.layout) if self._direct_copy else {}
            self._stated = None
            self._param_ptrs = self._storage_ptrs()
        if (moved or discarded) and (self._direct_state or self.proven):
            log.info(
                "%s: weights resumed (%s); the next load of each tensor goes through load_weights and checks its "
                "regions again",
                self.worker_id,
                "parameters moved" if moved else "their bytes were discarded",
            )
            self._direct_state.clear()
            self.proven.clear()

    def _storage_ptrs(self) -> dict[str, int]:
        return {name: p.data_ptr() for name, p in self._params.items()}

    def may_linger(self) -> bool:
        """On the engine thread: whether it may wait a moment for an update step instead of going
        straight back to the event loop: only when no batch could run anyway (the gate allows
        writing: the engine is idle, or paused in a loop that honours the pause)."""
        return (self._asleep is None or self._asleep() is None) and (
            self._gate is None or self._gate() is None
        )

    # --- internals -----------------------------------------------------------------------------

    def _on_engine(self, fn: Callable[[], T], *, what: str, phase: str | None = None) -> T:
        phases = self.phases if phase is not None else None
        if phases is None:
            return fn() if self._queue is None else self._queue.call(fn, what=what)
        submitted = time.perf_counter_ns()
        if self._t_step_done:
            phases.between_ns += submitted - self._t_step_done

        def timed() -> T:
            started = time.perf_counter_ns()
            try:
                return fn()
            finally:
                done = self._t_step_done = time.perf_counter_ns()
                setattr(phases, f"{phase}_wait_ns", getattr(phases, f"{phase}_wait_ns") + started - submitted)
                setattr(phases, f"{phase}_ns", getattr(phases, f"{phase}_ns") + done - started)

        return timed() if self._queue is None else self._queue.call(timed, what=what)

    def _gated(self, fn: Callable[[], None], *, what: str, phase: str | None = None) -> None:
        """Run ``fn`` on the engine thread in a pass where the gate allows writing.

        A refused pass is tried again, on later passes, for up to ``idle_wait_s``: SGLang's
        ``pause_generation(mode="abort")`` returns before the schedulers dropped the aborted
        requests, and a pipeline stage after the first still lists finished requests until its
        next pass. Writing only ever happens in a pass whose own gate check allowed it. Released
        weights are refused at once (ENGINE_ASLEEP): only the trainer's wake brings them back.
        """
        deadline = time.monotonic() + self._idle_wait_s

        def step() -> str | None:
            asleep = self._asleep() if self._asleep is not None else None
            if asleep is not None:
                raise WeightwireError(Reason.ENGINE_ASLEEP, f"{self.worker_id}: cannot {what}: {asleep}")
            refusal = self._gate() if self._gate is not None else None
            if refusal is None:
                fn()
            return refusal

        while True:
            refusal = self._on_engine(step, what=what, phase=phase)
            if refusal is None:
                return
            if self.phases is not None:
                self.phases.gate_refusals += 1
            if time.monotonic() >= deadline:
                raise WeightwireError(Reason.ENGINE_NOT_PAUSED, f"{self.worker_id}: cannot {what}: {refusal}")
            time.sleep(0.005)

    def _check_tensor(self, name: str, tensor: torch.Tensor) -> None:
        found = self.layout.targets.get(name)
        check_pushed_tensor(self.worker_id, name, tensor, (found[0].dtype, found[0].shape) if found else None)

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.layout.targets[name]
        calls: list[tuple[str, object]] = []
        restore = [self._instrument(t, calls) for t in expected]
        try:
            load_weights: Callable[[list[tuple[str, torch.Tensor]]], object] = self.model.load_weights  # type: ignore[assignment]
            load_weights([(name, tensor)])
        finally:
            for undo in restore:
                undo()
        wanted = sorted((t.param_name, repr(_call_shard(t.shard_id, t.expert_id))) for t in expected)
        seen = sorted((p, repr(s)) for p, s in calls)
        if seen != wanted:
            raise WeightwireError(
                Reason.LOAD_FAILED,
                f"{self.worker_id}: SGLang's load_weights did not consume {name} as expected: it should fill "
                f"{_describe(expected)}, its weight loaders were called for {seen or 'nothing'}",
                tensor=name,
            )

    def _instrument(self, target: LoadTarget, calls: list[tuple[str, object]]) -> Callable[[], None]:
        """Wrap the weight loader of ``target``'s parameter so its calls are recorded; returns undo.

        SGLang's loaders look the loader up as ``getattr(param, "weight_loader", default_weight_loader)``
        at call time, so a wrapper set on the parameter sees every write to it.
        """
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        # Looked up now, not at start: a quantized layer's post-load processing may rebind it.
        param = self.model.get_parameter(target.param_name)
        # Quantized layers' parameters (BasevLLMParameter) expose weight_loader as a read-only
        # property over _weight_loader; wrap what the property returns.
        slot = (
            "_weight_loader"
            if isinstance(getattr(type(param), "weight_loader", None), property)
            else "weight_loader"
        )
        own = slot in param.__dict__
        original = param.__dict__[slot] if own else getattr(param, "weight_loader", default_weight_loader)
        param_name = target.param_name

        def recording_loader(p: torch.Tensor, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if target.expert_id is not None:
                # FusedMoE.weight_loader(param, loaded, weight_name, shard_id, expert_id)
                given = dict(zip(("weight_name", "shard_id", "expert_id"), args, strict=False)) | kwargs
                shard: object = _call_shard(given.get("shard_id"), given.get("expert_id"))
            else:
                shard = args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
            calls.append((param_name, shard))
            return original(p, loaded, *args, **kwargs)

        setattr(param, slot, recording_loader)

        def undo() -> None:
            if own:
                setattr(param, slot, original)
            else:
                delattr(param, slot)

        return undo

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            t0 = time.perf_counter_ns()
            torch.cuda.synchronize(self.device)
            if self.phases is not None:
                self.phases.sync_ns += time.perf_counter_ns() - t0


_MAX_DIRECT_KEYS = 1024


def _call_shard(shard_id: object, expert_id: object) -> object:
    """How a weight-loader call is recorded: its shard id, with the expert for a routed expert."""
    return shard_id if expert_id is None else f"{shard_id} of expert {expert_id}"


def _describe(targets: Sequence[LoadTarget]) -> str:
    return ", ".join(
        f"{t.param_name}"
        + (f" (shard {_call_shard(t.shard_id, t.expert_id)!r})" if t.shard_id is not None else "")
        for t in targets
    )
