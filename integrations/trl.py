"""A weight-transfer backend for TRL's ``AsyncGRPOTrainer`` that pushes with weightwire.

TRL (1.16) lets a trainer take any object with ``init_weight_transfer()``, ``pause()``,
``send_weights(iterator)``, ``resume()`` and ``destroy()`` as ``weight_transfer=``
(``trl.experimental.async_grpo.WeightTransferProtocol``); its main process calls them around each
weight sync. ``WeightwireTransfer`` is that object for an engine that serves weightwire workers: a
vLLM server started with ``--weight-transfer-config '{"backend": "weightwire"}'`` (and
``VLLM_SERVER_DEV_MODE=1``), or an SGLang server with the weightwire plugin. It pauses and resumes
generation through the engine's own HTTP routes, opens vLLM's update window, pushes the trainer's
``(name, tensor)`` stream with ``WeightPusher`` as weights version = the trainer's step, records that
version in the engine, and lets a ``PushError`` / ``PlanError`` (weightwire's reason, naming each
worker) fail the trainer. Switching a TRL script to it is one argument::

    AsyncGRPOTrainer(..., weight_transfer=WeightwireTransfer("http://127.0.0.1:8000", socket_dir=SOCKETS))

TRL itself is not imported here: the protocol is structural, so this module loads in any
environment that has weightwire (docs/integrations.md).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from weightwire.client import WeightPusher

logger = logging.getLogger(__name__)

ENGINES = ("vllm", "sglang")

# How each engine pauses without losing the requests in flight, which TRL's asynchronous rollouts
# rely on (its own NCCL backend pauses vLLM with "keep"): vLLM freezes them in its queue; SGLang
# retracts them to its waiting queue (its "in_place" would leave them in the running batch, which
# the plugin refuses to update under pipeline parallelism: docs/sglang.md).
DEFAULT_PAUSE_MODE = {"vllm": "keep", "sglang": "retract"}


class EngineRequestError(RuntimeError):
    """An engine's HTTP route answered with an error (or could not be reached); names the route."""


class WeightwireTransfer:
    """TRL ``WeightTransferProtocol`` over weightwire; see the module docstring.

    ``server_url``: the engine's HTTP server (``http://host:port``). Workers: ``workers`` (gRPC
    targets) or ``socket_dir`` (the engine's ``WEIGHTWIRE_VLLM_SOCKET_DIR`` /
    ``WEIGHTWIRE_SGLANG_SOCKET_DIR``; ``worker_count`` = tp * pp * dp makes discovery wait for all
    of them). ``step``: a callable giving the version of the next sync; by default the step of the
    trainer whose ``_streaming_iter`` produced the weights (``trainer.state.global_step``).
    ``cast_to`` / ``scope`` / ``allow_unowned`` go to every ``WeightPusher.push`` (e.g.
    ``cast_to=torch.bfloat16`` from float32 master weights into a bfloat16 engine; ``scope="partial"``
    when frozen parameters are not sent). Other keyword arguments go to ``WeightPusher``
    (``transport=``, ``timeout_s=``, ``token=``, ``transfer_group=``, ...).
    """

    def __init__(
        self,
        server_url: str,
        *,
        engine: str = "vllm",
        workers: Sequence[str] | None = None,
        socket_dir: str | None = None,
        worker_count: int | None = None,
        step: Callable[[], int] | None = None,
        cast_to: Any = None,
        scope: str = "full",
        allow_unowned: bool = False,
        pause_mode: str | None = None,
        http_timeout_s: float = 300.0,
        ready_timeout_s: float = 600.0,
        **pusher_options: Any,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if (workers is None) == (socket_dir is None):
            raise ValueError(
                "pass exactly one of workers (gRPC targets) or socket_dir (the engine's socket directory)"
            )
        self.server_url = server_url.rstrip("/")
        self.engine = engine
        self.pause_mode = pause_mode or DEFAULT_PAUSE_MODE[engine]
        self.http_timeout_s = float(http_timeout_s)
        self.ready_timeout_s = float(ready_timeout_s)
        self._workers = list(workers) if workers is not None else None
        self._socket_dir = socket_dir
        self._worker_count = worker_count
        self._step = step
        self._push_options: dict[str, Any] = {
            "cast_to": cast_to,
            "scope": scope,
            "allow_unowned": allow_unowned,
        }
        self._pusher_options = pusher_options
        self.pusher: WeightPusher | None = None
        self.last_version: int | None = None

    # -- WeightTransferProtocol ------------------------------------------------------------------

    def init_weight_transfer(self) -> None:
        """Wait for the server, find its workers and read their manifests (a worker that cannot be
        reached fails here, before training starts)."""
        self._wait_ready()
        endpoints = self._workers
        if endpoints is None:
            from weightwire.adapters.discovery import discover

            endpoints = discover(
                self._socket_dir,
                count=self._worker_count,
                timeout_s=self.ready_timeout_s if self._worker_count else 0.0,
            )
        self.pusher = WeightPusher(endpoints, **self._pusher_options)
        self.pusher.manifests()

    def pause(self) -> None:
        if self.engine == "vllm":
            self._call("/pause", query={"mode": self.pause_mode})
        else:
            self._call("/pause_generation", {"mode": self.pause_mode})

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Push every ``(name, tensor)`` of ``iterator`` as the trainer's step; raises weightwire's
        ``PlanError`` / ``PushError`` (the engine keeps its previous weights version)."""
        pusher = self._require_pusher()
        version = self._version_of(iterator)
        if self._versions() == {version}:
            # TRL syncs once before the first step. An engine whose every worker already holds this
            # step's weights needs nothing: version 0 is the checkpoint the engine started from (the
            # model a fresh run loads), a later one what this run pushed at that step before it was
            # resumed. The version could not be pushed again anyway (it must be newer than the
            # worker's). The stream is still drained: under FSDP2 every rank's full_tensor() of each
            # parameter is a collective this process takes part in.
            for _ in iterator:
                pass
            logger.info("weightwire: every worker already holds weights version %d; nothing pushed", version)
            return
        if self.engine == "vllm":
            self._call("/start_weight_update")
            try:
                pusher.push(iterator, version=version, **self._push_options)
            except BaseException:
                # Closes the window without a version, so vLLM keeps reporting the previous one.
                self._call_quietly("/finish_weight_update")
                raise
            self._call("/finish_weight_update", {"weight_version": str(version)})
        else:
            pusher.push(iterator, version=version, **self._push_options)
            # SGLang 0.5.23 records the version in every response itself; /model_info (and 0.5.17's
            # responses) only through this route.
            self._call("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        self.last_version = version

    def resume(self) -> None:
        if self.engine == "vllm":
            # KV blocks cached before the update were computed with the old weights. vLLM refuses the
            # reset while requests frozen by a "keep" pause still hold blocks; those requests go on
            # with their own KV (TRL's asynchronous rollouts accept that staleness), and the
            # blocks of requests that finished are evicted as usual.
            reply = self._call("/reset_prefix_cache")
            if isinstance(reply, dict) and reply.get("success") is False:
                logger.warning(
                    "weightwire: vLLM kept its prefix cache (requests paused with 'keep' hold blocks)"
                )
            self._call("/resume")
        else:
            self._call("/continue_generation", {})

    def destroy(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None

    # -- helpers ---------------------------------------------------------------------------------

    def _require_pusher(self) -> WeightPusher:
        if self.pusher is None:
            raise RuntimeError("WeightwireTransfer.init_weight_transfer() has not run (or destroy() has)")
        return self.pusher

    def _versions(self) -> set[int]:
        return {int(s.weights_version) for s in self._require_pusher().status().values()}

    def _version_of(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> int:
        if self._step is not None:
            return int(self._step())
        step = _trainer_step(iterator)
        if step is None:
            raise ValueError(
                "WeightwireTransfer could not read the trainer's step from the weights it was given "
                "(not AsyncGRPOTrainer._streaming_iter): pass step=<callable returning the version>"
            )
        return step

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                self._call("/health", method="GET", timeout_s=5.0)
                return
            except EngineRequestError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)

    def _call(
        self,
        route: str,
        body: dict[str, Any] | None = None,
        *,
        query: dict[str, str] | None = None,
        method: str = "POST",
        timeout_s: float | None = None,
    ) -> Any:
        url = self.server_url + route + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        request = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.http_timeout_s) as response:
                text = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise EngineRequestError(f"{method} {url} answered {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            raise EngineRequestError(f"{method} {url} failed: {e}") from e
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return text.decode(errors="replace")

    def _call_quietly(self, route: str) -> None:
        try:
            self._call(route)
        except EngineRequestError as e:
            logger.warning("weightwire: %s", e)


def _trainer_step(iterator: object) -> int | None:
    """``trainer.state.global_step`` of the trainer whose generator method made ``iterator``.

    TRL hands ``send_weights`` the generator ``AsyncGRPOTrainer._streaming_iter()`` and nothing else
    about the sync; the generator's frame holds the trainer as ``self``.
    """
    frame = getattr(iterator, "gi_frame", None)
    owner = frame.f_locals.get("self") if frame is not None else None
    step = getattr(getattr(owner, "state", None), "global_step", None)
    return step if isinstance(step, int) else None
