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
keeps those names on ``load_weights`` for good. ``prepare_load`` (views the worker serves again)
works out the regions once.

Built by ``weightwire.adapters.sglang.plugin`` inside each scheduler process; tests build it on a
model constructed under SGLang's parallel state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
from weightwire.adapters.sglang.engine_thread import EngineTaskQueue
from weightwire.adapters.sglang.manifest import LoadTarget, ModelLayout, model_layout
from weightwire.adapters.sglang.settings import worker_id as default_worker_id
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef, device_ref_of
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import OwnedTensor, ParallelRank, ShardManifest, transports_for

log = logging.getLogger(__name__)
T = TypeVar("T")

_GROUP_COPY: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = getattr(
    torch, "_foreach_copy_", None
)

EngineGate = Callable[[], "str | None"]
"""Returns None when the engine may be written to now, else why not (a message for the trainer)."""


class WeightUpdateSession(Protocol):
    """SGLang's per-runner update steps: ``ModelRunner.weight_updater`` has exactly these."""

    def begin_weight_update(self) -> None: ...

    def end_weight_update(self, *, run_post_load: bool) -> None: ...


class NoWeightSession:
    """For SGLang releases whose own updates call ``load_weights`` with nothing around it (0.5.17)."""

    def begin_weight_update(self) -> None:
        return None

    def end_weight_update(self, *, run_post_load: bool) -> None:
        return None


class LoaderWeightSession:
    """The steps of SGLang's ``WeightUpdater.begin/end_weight_update`` for a model that has no
    ``ModelRunner`` around it (tests): the same ``DefaultModelLoader`` calls."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device

    def begin_weight_update(self) -> None:
        from sglang.srt.model_loader.loader import DefaultModelLoader

        DefaultModelLoader.restore_weights_before_loading(self.model, self.device)

    def end_weight_update(self, *, run_post_load: bool) -> None:
        from sglang.srt.model_loader.loader import DefaultModelLoader, post_load_weights

        if run_post_load:
            post_load_weights(self.model)
        DefaultModelLoader.postprocess_weights(self.model, self.device)


@dataclasses.dataclass
class UpdatePhases:
    """Where one update's time went on this worker (nanoseconds, summed over its steps).

    ``*_wait_ns``: from handing a step to the scheduler thread until that thread started it (the
    hand-off); ``load_ns``: the load steps' work (synchronizes, copies or ``load_weights``);
    ``commit_ns``: ``on_committed`` (SGLang's version record and cache flush); ``between_ns``: from
    the end of one step to the hand-off of the next (the worker's gRPC thread receiving, opening
    and checking the next bucket, acking the last); ``total_ns``: from
    ``begin_update`` until ``end_update`` returned, the time between steps (the gRPC threads
    receiving and opening buckets) included."""

    version: int
    begin_wait_ns: int = 0
    begin_ns: int = 0
    load_wait_ns: int = 0
    load_ns: int = 0
    sync_ns: int = 0
    end_wait_ns: int = 0
    end_ns: int = 0
    commit_ns: int = 0
    between_ns: int = 0
    total_ns: int = 0
    loads: int = 0
    tensors: int = 0
    direct_loads: int = 0
    gate_refusals: int = 0

    def as_ms(self) -> dict[str, float | int]:
        return {
            k.removesuffix("_ns") + "_ms" if k.endswith("_ns") else k: (v / 1e6 if k.endswith("_ns") else v)
            for k, v in dataclasses.asdict(self).items()
        }


class _DirectCopy:
    """The regions a load writes, as (parameter view, source view) pairs."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = pairs
        same = [(d, s) for d, s in pairs if d.device == s.device]
        self._grouped = ([d for d, _ in same], [s for _, s in same]) if _GROUP_COPY is not None else ([], [])
        self._each = [(d, s) for d, s in pairs if _GROUP_COPY is None or d.device != s.device]

    def matches(self) -> bool:
        return all(torch.equal(d, s) for d, s in self.pairs)

    def copy(self) -> None:
        dsts, srcs = self._grouped
        if dsts:
            assert _GROUP_COPY is not None
            _GROUP_COPY(dsts, srcs)
        for d, s in self._each:
            d.copy_(s)


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
        on_committed: Callable[[int], None] | None = None,
        idle_wait_s: float = 0.0,
        direct_copy: bool = True,
        phase_log: str | None = None,
    ) -> None:
        """``engine_queue``: where steps run (None: on the calling thread, for a model that no
        engine is running). ``engine_gate``: refuses writes while the engine serves requests;
        a refusal is retried on later passes for ``idle_wait_s`` before the step fails.
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
        self._idle_wait_s = idle_wait_s
        self._on_committed = on_committed
        self._params = dict(model.named_parameters())
        self._direct_copy = direct_copy
        # Sets of names whose regions were checked against load_weights: True (copied directly
        # from then on) or False (load_weights only); bounded by _MAX_DIRECT_KEYS.
        self._direct_state: dict[tuple[str, ...], bool] = {}
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
        self._manifest = ShardManifest.build(
            self.own_device,
            rank,
            (
                OwnedTensor(
                    name, dtypes.from_torch(found[0].dtype), found[0].shape, self.layout.kept_pieces(name)
                )
                for name, found in self.layout.targets.items()
            ),
            layer_start=self.layout.layer_start,
            layer_end=self.layout.layer_end,
            num_layers=self.layout.num_layers,
            engine="sglang",
            worker_id=self.worker_id,
            transports=transports_for(self.own_device),
            instance_id=uuid.uuid4().hex,
        )
        self._dst = self._destinations() if direct_copy else {}

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
        pairs = self._direct_pairs(named) if self._direct_copy and named else None
        return lambda: self._load_checked(named, pairs) if named else None

    def _load_checked(self, named: list[tuple[str, torch.Tensor]], pairs: _DirectCopy | None) -> None:
        """Load checked tensors: copied directly when this set of names was checked against
        ``load_weights`` before, else through ``load_weights`` (checking the regions the first time)."""
        key = tuple(name for name, _ in named)
        state = self._direct_state.get(key) if self._direct_copy else False
        if state is not False and pairs is None:
            pairs = self._direct_pairs(named)
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

        self._count_load(len(named), direct=False)
        self._gated(step, what=what, phase="load")

    def _remember(self, key: tuple[str, ...], direct: bool) -> bool:
        if len(self._direct_state) >= _MAX_DIRECT_KEYS:
            self._direct_state.clear()
        self._direct_state[key] = direct
        return direct

    def _direct_pairs(self, named: Sequence[tuple[str, torch.Tensor]]) -> _DirectCopy | None:
        """(parameter region, source region) for every target of ``named``, or None when the
        geometry of one cannot be stated (``load_weights`` then does it all)."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, full in named:
            for target in self.layout.targets[name]:
                dst = self._dst.get((target.param_name, target.shard_id, name))
                if dst is None:
                    return None
                src = full
                for piece in target.pieces:
                    src = src.narrow(piece.dim, piece.offset, piece.length)
                if src.shape != dst.shape or src.dtype != dst.dtype:
                    return None
                pairs.append((dst, src))
        return _DirectCopy(pairs)

    def _destinations(self) -> dict[tuple[str, str | int | None, str], torch.Tensor]:
        """Where each target's rows lie in its parameter: a fused parameter holds its shards' rows
        one after another in the layer's shard order (q, k, v; gate, up), an unfused one from row 0
        (a vocabulary's padding rows past the checkpoint's are never written). Targets whose place
        cannot be stated are left out (their loads go through ``load_weights``)."""
        by_param: dict[str, list[LoadTarget]] = {}
        for found in self.layout.targets.values():
            for t in found:
                by_param.setdefault(t.param_name, []).append(t)
        out: dict[tuple[str, str | int | None, str], torch.Tensor] = {}
        for param_name, targets in by_param.items():
            param = self._params[param_name]
            if param.dim() == 0:
                continue
            if any(t.expert_id is not None for t in targets):
                out.update(self._expert_destinations(param_name, param, targets))
                continue
            if all(t.shard_id is None for t in targets):
                ordered = targets
                fused = False
            elif all(t.shard_id in _QKV_ORDER for t in targets):
                ordered = sorted(targets, key=lambda t: _QKV_ORDER.index(t.shard_id))  # type: ignore[arg-type]
                fused = True
            elif all(isinstance(t.shard_id, int) for t in targets):
                ordered = sorted(targets, key=lambda t: int(t.shard_id))  # type: ignore[arg-type]
                fused = True
            else:
                continue
            row = 0
            for t in ordered:
                local = list(t.shape)
                for piece in t.pieces:
                    local[piece.dim] = piece.length
                start = row if fused else 0
                if fused:
                    row += local[0]
                if (
                    t.dtype != param.dtype
                    or len(local) != param.dim()
                    or tuple(local[1:]) != tuple(param.shape[1:])
                ):
                    continue
                if start + local[0] > param.shape[0]:
                    continue
                if not fused and local[0] != param.shape[0] and not self._is_vocab(param_name):
                    continue
                out[(param_name, t.shard_id, t.name)] = param.data.narrow(0, start, local[0])
        return out

    def _expert_destinations(
        self, param_name: str, param: torch.Tensor, targets: list[LoadTarget]
    ) -> dict[tuple[str, str | int | None, str], torch.Tensor]:
        """A routed expert's place in a ``FusedMoE`` parameter: its local slot, then gate (``w1``)
        in the first half of ``w13``'s rows and up (``w3``) in the second, ``w2`` whole."""
        module_name = param_name.rpartition(".")[0]
        layer = self.model.get_submodule(module_name)
        out: dict[tuple[str, str | int | None, str], torch.Tensor] = {}
        for t in targets:
            if t.expert_id is None or t.dtype != param.dtype:
                continue
            slot = int(layer._map_global_expert_id_to_local_expert_id(t.expert_id))  # type: ignore[operator]
            if not 0 <= slot < param.shape[0]:
                continue
            local = list(t.shape)
            for piece in t.pieces:
                local[piece.dim] = piece.length
            expert = param.data[slot]
            if t.shard_id in ("w1", "w3") and len(local) == 2:
                # A padded intermediate size (CPU, unaligned TP): the checkpoint's rows come first.
                rows = expert.shape[0] // 2
                region = expert.narrow(0, 0 if t.shard_id == "w1" else rows, min(rows, local[0]))
            elif t.shard_id == "w2" and len(local) == 2:
                region = expert.narrow(1, 0, min(expert.shape[1], local[1]))
            else:
                continue
            if tuple(region.shape) == tuple(local):
                out[(param_name, t.shard_id, t.name)] = region
        return out

    def _is_vocab(self, param_name: str) -> bool:
        from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

        module_name = param_name.rpartition(".")[0]
        return isinstance(
            self.model.get_submodule(module_name) if module_name else self.model, VocabParallelEmbedding
        )

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

    def may_linger(self) -> bool:
        """On the engine thread: whether it may wait a moment for an update step instead of going
        straight back to the event loop: only when no batch could run anyway (the gate allows
        writing: the engine is idle, or paused in a loop that honours the pause)."""
        return self._gate is None or self._gate() is None

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
        next pass. Writing only ever happens in a pass whose own gate check allowed it.
        """
        deadline = time.monotonic() + self._idle_wait_s

        def step() -> str | None:
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
        if found is None:
            # The service filters by manifest already; anything else reaching here is a bug upstream.
            raise WeightwireError(
                Reason.LOAD_FAILED,
                f"{self.worker_id}: {name!r} is not in this worker's manifest; refusing to load it",
            )
        target = found[0]
        if tensor.dtype != target.dtype:
            raise WeightwireError(
                Reason.DTYPE_MISMATCH,
                f"{name}: got {tensor.dtype}, this worker expects {target.dtype}",
                tensor=name,
            )
        if tuple(tensor.shape) != target.shape:
            raise WeightwireError(
                Reason.SHAPE_MISMATCH,
                f"{name}: got shape {tuple(tensor.shape)}, this worker expects the full checkpoint shape {target.shape}",
                tensor=name,
            )

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

        param = self._params[target.param_name]
        own = "weight_loader" in param.__dict__
        original = (
            param.__dict__["weight_loader"] if own else getattr(param, "weight_loader", default_weight_loader)
        )
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

        param.weight_loader = recording_loader  # type: ignore[attr-defined]

        def undo() -> None:
            if own:
                param.weight_loader = original  # type: ignore[attr-defined]
            else:
                del param.weight_loader  # type: ignore[attr-defined]

        return undo

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            t0 = time.perf_counter_ns()
            torch.cuda.synchronize(self.device)
            if self.phases is not None:
                self.phases.sync_ns += time.perf_counter_ns() - t0


_QKV_ORDER = ("q", "k", "v")
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
