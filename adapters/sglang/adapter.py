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

Built by ``weightwire.adapters.sglang.plugin`` inside each scheduler process; tests build it on a
model constructed under SGLang's parallel state.
"""

from __future__ import annotations

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
    ) -> None:
        """``engine_queue``: where steps run (None: on the calling thread, for a model that no
        engine is running). ``engine_gate``: refuses writes while the engine serves requests;
        a refusal is retried on later passes for ``idle_wait_s`` before the step fails.
        ``on_committed(version)``: runs on the engine thread after a successful update."""
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
        self._gated(step, what=f"begin update {version}")
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

        self._gated(step, what=f"load {len(named_tensors)} tensor(s)")

    def end_update(self, success: bool) -> None:
        version, was_open = self._version, self._session_open
        self._version, self._session_open = None, False
        if not was_open:
            return  # begin was refused: SGLang's session was never opened, so there is nothing to close

        def step() -> None:
            self.update_open = False
            # Always close SGLang's session: it re-packs what begin unpacked.
            self._session.end_weight_update(run_post_load=False)
            if success and version is not None and self._on_committed is not None:
                self._on_committed(version)

        self._on_engine(step, what="end update")

    def may_linger(self) -> bool:
        """On the engine thread: whether it may wait a moment for an update step instead of going
        straight back to the event loop: only when no batch could run anyway (the gate allows
        writing: the engine is idle, or paused in a loop that honours the pause)."""
        return self._gate is None or self._gate() is None

    # --- internals -----------------------------------------------------------------------------

    def _on_engine(self, fn: Callable[[], T], *, what: str) -> T:
        if self._queue is None:
            return fn()
        return self._queue.call(fn, what=what)

    def _gated(self, fn: Callable[[], None], *, what: str) -> None:
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
            refusal = self._on_engine(step, what=what)
            if refusal is None:
                return
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
            torch.cuda.synchronize(self.device)


def _describe(targets: Sequence[LoadTarget]) -> str:
    return ", ".join(
        f"{t.param_name}" + (f" (shard {t.shard_id!r})" if t.shard_id is not None else "") for t in targets
    )
