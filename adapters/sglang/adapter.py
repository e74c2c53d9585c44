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

Tensors the worker serves again in later updates (a kept CUDA IPC mapping of the trainer's own
parameters, a kept staging buffer) get a prepared load (``prepare_load``): its first call goes
through ``load_weights`` as above and then checks that every region the manifest's slice geometry
names (this rank's piece of the checkpoint tensor, at its shard's rows of the fused parameter)
holds exactly what SGLang's loaders wrote there; from then on it copies those regions directly,
in one grouped copy, without ``load_weights``' per-tensor Python. A region the geometry cannot
state, or a check that fails, keeps that load on ``load_weights`` for good.

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

_GROUP_COPY: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = getattr(torch, "_foreach_copy_", None)

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
    ``commit_ns``: ``on_committed`` (SGLang's version record and cache flush); ``total_ns``: from
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
    total_ns: int = 0
    loads: int = 0
    tensors: int = 0
    direct_loads: int = 0
    gate_refusals: int = 0

    def as_ms(self) -> dict[str, float | int]:
        return {k.removesuffix("_ns") + "_ms" if k.endswith("_ns") else k: (v / 1e6 if k.endswith("_ns") else v)
                for k, v in dataclasses.asdict(self).items()}


class _DirectCopy:
    """The regions a prepared load writes, as (parameter view, source view) pairs, and whether
    SGLang's own loaders were seen to write exactly those (``verified``)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = pairs
        self.verified = False
        self.refused = False
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

    def __init__(
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
        self._session = weight_session if weight_session is not None else LoaderWeightSession(model, self.device)
        self._gate = engine_gate
        self._idle_wait_s = idle_wait_s
        self._on_committed = on_committed
        self._params = dict(model.named_parameters())
        self._direct_copy = direct_copy
        self._phase_log = phase_log
        self.phases: UpdatePhases | None = None
        self._t_begin = 0
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
                OwnedTensor(name, dtypes.from_torch(found[0].dtype), found[0].shape, self.layout.kept_pieces(name))
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

    # --- EngineAdapter -------------------------------------------------------------------------

    def manifest(self) -> ShardManifest:
        return self._manifest

    def begin_update(self, version: int) -> None:
        def step() -> None:
            self._session.begin_weight_update()
            self.update_open = True

        self._wrote = False
        self._t_begin = time.perf_counter_ns()
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
        if not named_tensors:
            return

        def step() -> None:
            self._synchronize()  # a forward launched before the pause may still read the weights
            self._wrote = True
            with torch.no_grad():
                for name, tensor in named_tensors:
                    self._load_one(name, tensor)
            self._synchronize()  # the service acks when we return; the sender may then reuse its buffer

        self._count_load(len(named_tensors), direct=False)
        self._gated(step, what=f"load {len(named_tensors)} tensor(s)", phase="load")

    def prepare_load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Callable[[], None]:
        """``load``'s checks now; the returned function loads what the tensors hold each time it is
        called. Its first call goes through ``load_weights`` and checks the manifest's regions
        against what SGLang wrote; later calls copy those regions directly (module docstring)."""
        named = list(named_tensors)
        for name, tensor in named:
            self._check_tensor(name, tensor)
        direct = self._direct_plan(named) if self._direct_copy else None
        if direct is None or not named:
            return lambda: self.load(named)
        what = f"load {len(named)} tensor(s)"

        def first(step_direct: _DirectCopy) -> None:
            self._synchronize()
            self._wrote = True
            with torch.no_grad():
                for name, tensor in named:
                    self._load_one(name, tensor)
            self._synchronize()
            if step_direct.matches():
                step_direct.verified = True
            else:
                step_direct.refused = True
                log.warning(
                    "%s: SGLang's load_weights wrote other regions than the manifest's slice geometry names "
                    "for %d tensor(s) starting at %s; these keep loading through load_weights",
                    self.worker_id, len(named), named[0][0],
                )

        def copy_step() -> None:
            self._synchronize()  # a forward launched before the pause may still read the weights
            self._wrote = True
            with torch.no_grad():
                direct.copy()
            self._synchronize()  # the service acks when we return; the sender may then reuse its buffer

        def run() -> None:
            if direct.refused:
                self.load(named)
            elif direct.verified:
                self._count_load(len(named), direct=True)
                self._gated(copy_step, what=what, phase="load")
            else:
                self._count_load(len(named), direct=False)
                self._gated(lambda: first(direct), what=what, phase="load")

        return run

    def _direct_plan(self, named: Sequence[tuple[str, torch.Tensor]]) -> _DirectCopy | None:
        """The (parameter region, source region) of every target of ``named`` from the layout's
        slice geometry, or None when one cannot be stated (then ``load_weights`` does it all)."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, tensor in named:
            for target in self.layout.targets[name]:
                pair = self._region(target, tensor)
                if pair is None:
                    return None
                pairs.append(pair)
        return _DirectCopy(pairs)

    def _region(self, target: LoadTarget, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        param = self._params[target.param_name]
        src = full
        for piece in target.pieces:
            src = src.narrow(piece.dim, piece.offset, piece.length)
        if src.dtype != param.dtype or src.dim() != param.dim() or src.dim() == 0:
            return None
        # A fused parameter holds its shards' rows one after another, in the shard order of the
        # layer (q, k, v; gate, up); an unfused one starts at row 0 (a vocabulary's padding rows
        # past the checkpoint's stay as they are).
        row = 0
        if target.shard_id is not None:
            siblings = self._shards_of(target.param_name)
            if siblings is None:
                return None
            for sibling in siblings:
                if sibling.shard_id == target.shard_id:
                    break
                rows = sibling.shape[0]
                for piece in sibling.pieces:
                    if piece.dim == 0:
                        rows = piece.length
                row += rows
        if tuple(param.shape[1:]) != tuple(src.shape[1:]) or row + src.shape[0] > param.shape[0]:
            return None
        if target.shard_id is None and src.shape[0] != param.shape[0] and not self._is_vocab(target.param_name):
            return None
        return param.data.narrow(0, row, src.shape[0]), src

    def _shards_of(self, param_name: str) -> list[LoadTarget] | None:
        found = [t for ts in self.layout.targets.values() for t in ts if t.param_name == param_name]
        if all(t.shard_id in _QKV_ORDER for t in found):
            return sorted(found, key=lambda t: _QKV_ORDER.index(t.shard_id))  # type: ignore[arg-type]
        if all(isinstance(t.shard_id, int) for t in found):
            return sorted(found, key=lambda t: int(t.shard_id))  # type: ignore[arg-type]
        return None

    def _is_vocab(self, param_name: str) -> bool:
        from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

        module_name = param_name.rpartition(".")[0]
        return isinstance(self.model.get_submodule(module_name) if module_name else self.model, VocabParallelEmbedding)

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

        def timed() -> T:
            started = time.perf_counter_ns()
            try:
                return fn()
            finally:
                done = time.perf_counter_ns()
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
                Reason.LOAD_FAILED, f"{self.worker_id}: {name!r} is not in this worker's manifest; refusing to load it"
            )
        target = found[0]
        if tensor.dtype != target.dtype:
            raise WeightwireError(
                Reason.DTYPE_MISMATCH, f"{name}: got {tensor.dtype}, this worker expects {target.dtype}", tensor=name
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
        wanted = sorted((t.param_name, repr(t.shard_id)) for t in expected)
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
        original = param.__dict__["weight_loader"] if own else getattr(param, "weight_loader", default_weight_loader)
        param_name = target.param_name

        def recording_loader(p: torch.Tensor, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
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


def _describe(targets: Sequence[LoadTarget]) -> str:
    return ", ".join(
        f"{t.param_name}" + (f" (shard {t.shard_id!r})" if t.shard_id is not None else "") for t in targets
    )
