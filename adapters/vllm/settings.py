"""Where each vLLM worker's weightwire service listens, and the environment variables that say so.

Read in every vLLM worker process by ``weightwire.adapters.vllm.backend`` (the variables are set
before ``LLM(...)`` or ``vllm serve`` starts and reach every worker through the environment), and by
a trainer that finds the workers with ``weightwire.adapters.discovery.discover``. Pure: no vllm, no
gRPC.

- ``WEIGHTWIRE_VLLM_SOCKET_DIR``: each worker listens on ``<dir>/<worker_id>.sock`` (``tp1-pp0``,
  plus ``-dp2`` with data-parallel replicas); created with mode 0700.
- ``WEIGHTWIRE_VLLM_BASE_PORT``: TCP instead, ``HOST:(BASE_PORT + index)`` with index
  ``(dp_rank * pp_size + pp_rank) * tp_size + tp_rank`` (vLLM's global rank order).
- ``WEIGHTWIRE_VLLM_HOST``: the TCP host (default ``127.0.0.1``); any other host needs
  ``WEIGHTWIRE_TOKEN`` (and should have ``WEIGHTWIRE_TLS_CERT``/``WEIGHTWIRE_TLS_KEY``).
- ``WEIGHTWIRE_VLLM_FORWARD_WAIT_S``: how long an update waits for a running forward pass to end
  before it is refused with ENGINE_NOT_PAUSED (default 30).
- ``WEIGHTWIRE_VLLM_FINISH_WAIT_S``: how long ``finish_weight_update`` waits for an update still
  running on a worker (default 60).
- ``WEIGHTWIRE_VLLM_DIRECT_COPY``: ``0`` loads every layer through vLLM's layerwise reload, also
  the layers proven to take a plain copy (default ``1``: those are copied directly; ``direct.py``).
- ``WEIGHTWIRE_VLLM_DELTA_COPIES``: ``1`` keeps a host copy of this worker's pieces of each layer
  whose kernel holds no checkpoint-layout weight (every linear layer on CPU), so delta updates apply
  to those layers too (default ``0``: a worker with such a layer refuses deltas; ``deltas.py``).

Neither SOCKET_DIR nor BASE_PORT set: sockets go to ``<tmp>/weightwire-vllm-<instance id>``, where
the instance id is vLLM's ``VllmConfig.instance_id`` (the same in all workers of one engine,
different for every engine); ``weightwire.adapters.vllm.worker_endpoints(llm)`` returns the
addresses without knowing it.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping

from weightwire.adapters.endpoints import EndpointSettings, SettingsError, env_flag, env_seconds

ENV_PREFIX = "WEIGHTWIRE_VLLM"
ENV_SOCKET_DIR = f"{ENV_PREFIX}_SOCKET_DIR"
ENV_BASE_PORT = f"{ENV_PREFIX}_BASE_PORT"
ENV_HOST = f"{ENV_PREFIX}_HOST"
ENV_FORWARD_WAIT = f"{ENV_PREFIX}_FORWARD_WAIT_S"
ENV_FINISH_WAIT = f"{ENV_PREFIX}_FINISH_WAIT_S"
ENV_DIRECT_COPY = f"{ENV_PREFIX}_DIRECT_COPY"
ENV_DELTA_COPIES = f"{ENV_PREFIX}_DELTA_COPIES"

__all__ = ["ENV_BASE_PORT", "ENV_HOST", "ENV_SOCKET_DIR", "Settings", "SettingsError", "default_socket_dir"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The vLLM adapter's configuration in one worker process."""

    endpoints: EndpointSettings
    forward_wait_s: float = 30.0
    finish_wait_s: float = 60.0
    direct_copy: bool = True
    delta_copies: bool = False

    @classmethod
    def from_env(cls, instance_id: str, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        return cls(
            endpoints=EndpointSettings.from_env(
                ENV_PREFIX, default_socket_dir=default_socket_dir(instance_id), env=env
            ),
            forward_wait_s=env_seconds(env, ENV_FORWARD_WAIT, default=30.0),
            finish_wait_s=env_seconds(env, ENV_FINISH_WAIT, default=60.0),
            direct_copy=env_flag(env, ENV_DIRECT_COPY, default=True),
            delta_copies=env_flag(env, ENV_DELTA_COPIES, default=False),
        )


def default_socket_dir(instance_id: str) -> str:
    suffix = "".join(c for c in instance_id if c.isalnum() or c in "-_")[:24] or "default"
    return os.path.join(tempfile.gettempdir(), f"weightwire-vllm-{suffix}")
