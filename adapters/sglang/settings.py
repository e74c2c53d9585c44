"""Where each SGLang worker listens, and the environment variables that say so.

Read once per scheduler process by the plugin (``weightwire.adapters.sglang.plugin``) and by
``discover`` on the trainer side, so that both derive the same address from the same ranks. Pure:
no sglang, no gRPC.

Environment variables (documented in docs/sglang.md):

- ``WEIGHTWIRE_SGLANG_SOCKET_DIR``: a directory; each worker listens on the Unix socket
  ``<dir>/<worker_id>.sock`` (e.g. ``tp1-pp0.sock``). Created with mode 0700 if missing.
- ``WEIGHTWIRE_SGLANG_BASE_PORT``: TCP instead; a worker listens on ``HOST:(BASE_PORT + index)``,
  index = ``(dp_rank * pp_size + pp_rank) * tp_size + tp_rank``.
- ``WEIGHTWIRE_SGLANG_HOST``: the TCP host (default ``127.0.0.1``); a non-loopback host needs
  ``WEIGHTWIRE_TOKEN`` (and TLS).
- ``WEIGHTWIRE_TOKEN``, ``WEIGHTWIRE_TLS_CERT``, ``WEIGHTWIRE_TLS_KEY``: passed to the worker service.
- ``WEIGHTWIRE_SGLANG_ENABLE``: ``0`` turns the plugin off in this engine (default on).
- ``WEIGHTWIRE_SGLANG_FLUSH_CACHE``: ``0`` leaves SGLang's prefix/KV cache alone after an update
  (default: flush it on the scheduler thread once the update committed).
- ``WEIGHTWIRE_SGLANG_ENGINE_TIMEOUT_S``: how long a load waits for the scheduler thread to pick it
  up (default 300).
- ``WEIGHTWIRE_SGLANG_IDLE_WAIT_S``: how long an update step waits for a scheduler that still
  holds requests to become idle (aborted requests drain over a pass or two) before refusing with
  ENGINE_NOT_PAUSED (default 5).
- ``WEIGHTWIRE_SGLANG_ALLOW_UNTESTED``: ``1`` starts the plugin in an SGLang release outside the
  tested range (it still refuses if the hook targets are missing).

Neither SOCKET_DIR nor BASE_PORT set: sockets go to ``<tmp>/weightwire-sglang-<engine port>``, so two
engines on one host (different ``--port``) never share a directory.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping

# The rank naming, socket layout and environment parsing every engine adapter shares; re-exported
# under the names SGLang users and the plugin import from here.
from weightwire.adapters.endpoints import ENV_TLS_CERT as ENV_TLS_CERT
from weightwire.adapters.endpoints import ENV_TLS_KEY as ENV_TLS_KEY
from weightwire.adapters.endpoints import ENV_TOKEN as ENV_TOKEN
from weightwire.adapters.endpoints import MAX_SOCKET_PATH as MAX_SOCKET_PATH
from weightwire.adapters.endpoints import SOCKET_SUFFIX as SOCKET_SUFFIX
from weightwire.adapters.endpoints import EndpointSettings, env_flag, env_seconds
from weightwire.adapters.endpoints import SettingsError as SettingsError
from weightwire.adapters.endpoints import parse_worker_id as parse_worker_id
from weightwire.adapters.endpoints import worker_id as worker_id
from weightwire.adapters.endpoints import worker_index as worker_index
from weightwire.core.manifest import ParallelRank

ENV_PREFIX = "WEIGHTWIRE_SGLANG"
ENV_SOCKET_DIR = f"{ENV_PREFIX}_SOCKET_DIR"
ENV_BASE_PORT = f"{ENV_PREFIX}_BASE_PORT"
ENV_HOST = f"{ENV_PREFIX}_HOST"
ENV_ENABLE = "WEIGHTWIRE_SGLANG_ENABLE"
ENV_FLUSH_CACHE = "WEIGHTWIRE_SGLANG_FLUSH_CACHE"
ENV_ENGINE_TIMEOUT = "WEIGHTWIRE_SGLANG_ENGINE_TIMEOUT_S"
ENV_ALLOW_UNTESTED = "WEIGHTWIRE_SGLANG_ALLOW_UNTESTED"
ENV_IDLE_WAIT = "WEIGHTWIRE_SGLANG_IDLE_WAIT_S"


@dataclasses.dataclass(frozen=True)
class Settings:
    """The plugin's configuration, from the environment of the scheduler process: where the workers
    listen (``endpoints``, the same rules as every engine adapter) and SGLang's own knobs."""

    endpoints: EndpointSettings = dataclasses.field(
        default_factory=lambda: EndpointSettings(socket_dir=default_socket_dir(None), env_prefix=ENV_PREFIX)
    )
    enabled: bool = True
    flush_cache: bool = True
    engine_timeout_s: float = 300.0
    allow_untested: bool = False
    idle_wait_s: float = 5.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, engine_port: int | None = None) -> Settings:
        """Parse the environment; ``engine_port`` (SGLang's ``--port``) names the default directory."""
        env = os.environ if env is None else env
        enabled = env_flag(env, ENV_ENABLE, default=True)
        endpoints = EndpointSettings.from_env(
            ENV_PREFIX, default_socket_dir=default_socket_dir(engine_port), env=env
        )
        return cls(
            endpoints=endpoints,
            enabled=enabled,
            flush_cache=env_flag(env, ENV_FLUSH_CACHE, default=True),
            engine_timeout_s=env_seconds(env, ENV_ENGINE_TIMEOUT, default=300.0, allow_zero=False),
            allow_untested=env_flag(env, ENV_ALLOW_UNTESTED, default=False),
            idle_wait_s=env_seconds(env, ENV_IDLE_WAIT, default=5.0, allow_zero=True),
        )

    def address(self, rank: ParallelRank) -> str:
        """The gRPC target this rank's worker listens on."""
        return self.endpoints.address(rank)

    def engine_key(self) -> str:
        """Names this engine on its host: its socket directory or TCP base address (two engines
        cannot share either), the same in every rank."""
        e = self.endpoints
        return f"tcp:{e.host}:{e.base_port}" if e.base_port is not None else f"unix:{e.socket_dir}"


def default_socket_dir(engine_port: int | None) -> str:
    suffix = str(engine_port) if engine_port is not None else "default"
    return os.path.join(tempfile.gettempdir(), f"weightwire-sglang-{suffix}")
