"""Trainer side with an in-process ``vllm.LLM``: find its workers, and bracket a push the way vLLM
expects a weight update to be bracketed.

``worker_endpoints(llm)`` derives every worker's weightwire address the way the workers do (the
same environment, vLLM's instance id for the default socket directory, the engine's world size) and
waits until all of them listen; ordered by DP, PP, then TP rank, as vLLM orders its workers. ``update_window``
is a context manager for one update: ``start_weight_update()`` on entry; on a clean exit
``finish_weight_update(weight_version=str(version))`` (vLLM then labels its outputs with that version)
and ``reset_prefix_cache()`` (the cached KV blocks were computed with the old weights); on an
exception only ``finish_weight_update()``, so the window closes and vLLM's version stays. vLLM 0.26
keeps no weight version (its ``finish_weight_update`` takes none): there the version is only
weightwire's (``WeightPusher.status()``). With the
OpenAI-compatible server the same steps are HTTP routes (docs/vllm.md). Neither imports vllm: they
call methods of the ``llm`` object they are given.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from weightwire.adapters.discovery import DiscoveryError, discover
from weightwire.adapters.vllm.plugin import BACKEND_NAME
from weightwire.adapters.vllm.settings import Settings


def worker_endpoints(llm: Any, *, timeout_s: float = 60.0) -> list[str]:
    """The gRPC target of every worker of ``llm`` (a ``vllm.LLM`` started with the weightwire backend
    in this process, so with this process's environment)."""
    config = llm.llm_engine.vllm_config
    backend = getattr(config.weight_transfer_config, "backend", None)
    if backend != BACKEND_NAME:
        raise DiscoveryError(
            f"this vLLM engine's weight-transfer backend is {backend!r}: start it with "
            f'weight_transfer_config=WeightTransferConfig(backend="{BACKEND_NAME}")'
        )
    parallel = config.parallel_config
    count = int(parallel.world_size) * int(parallel.data_parallel_size or 1)
    endpoints = Settings.from_env(str(config.instance_id)).endpoints
    if endpoints.base_port is not None:
        host = f"[{endpoints.host}]" if ":" in endpoints.host else endpoints.host
        return discover(base_address=f"{host}:{endpoints.base_port}", count=count, timeout_s=timeout_s)
    return discover(endpoints.socket_dir, count=count, timeout_s=timeout_s)


@contextmanager
def update_window(llm: Any, version: int, *, reset_prefix_cache: bool = True) -> Iterator[None]:
    """``with update_window(llm, step): pusher.push(weights, version=step)``; see the module docstring.

    No ``generate`` may run in ``llm`` meanwhile (the offline ``LLM`` runs none between calls; with
    ``AsyncLLM``, ``await llm.pause_generation()`` first).
    """
    llm.start_weight_update()
    try:
        yield
    except BaseException:
        llm.finish_weight_update()
        raise
    if _takes_weight_version(llm.finish_weight_update):
        llm.finish_weight_update(weight_version=str(version))
    else:
        llm.finish_weight_update()  # vLLM 0.26: no weight versions
    if reset_prefix_cache:
        llm.reset_prefix_cache()


def _takes_weight_version(finish: Any) -> bool:
    try:
        return "weight_version" in inspect.signature(finish).parameters
    except (TypeError, ValueError):
        return True
