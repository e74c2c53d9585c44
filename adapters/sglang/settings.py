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

# The rank naming and socket layout every engine adapter shares; re-exported under the names SGLang
# users and the plugin import from here.
from weightwire.adapters.endpoints import MAX_SOCKET_PATH as MAX_SOCKET_PATH
from weightwire.adapters.endpoints import SOCKET_SUFFIX as SOCKET_SUFFIX
from weightwire.adapters.endpoints import parse_worker_id as parse_worker_id
from weightwire.adapters.endpoints import worker_id as worker_id
from weightwire.adapters.endpoints import worker_index as worker_index
from weightwire.core.manifest import ParallelRank
from weightwire.core.netutil import is_loopback

ENV_SOCKET_DIR = "WEIGHTWIRE_SGLANG_SOCKET_DIR"
ENV_BASE_PORT = "WEIGHTWIRE_SGLANG_BASE_PORT"
ENV_HOST = "WEIGHTWIRE_SGLANG_HOST"
ENV_TOKEN = "WEIGHTWIRE_TOKEN"
ENV_TLS_CERT = "WEIGHTWIRE_TLS_CERT"
ENV_TLS_KEY = "WEIGHTWIRE_TLS_KEY"
ENV_ENABLE = "WEIGHTWIRE_SGLANG_ENABLE"
ENV_FLUSH_CACHE = "WEIGHTWIRE_SGLANG_FLUSH_CACHE"
ENV_ENGINE_TIMEOUT = "WEIGHTWIRE_SGLANG_ENGINE_TIMEOUT_S"
ENV_ALLOW_UNTESTED = "WEIGHTWIRE_SGLANG_ALLOW_UNTESTED"
ENV_IDLE_WAIT = "WEIGHTWIRE_SGLANG_IDLE_WAIT_S"



class SettingsError(ValueError):
    """A weightwire environment variable has a value the plugin cannot use."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """The plugin's configuration, from the environment of the scheduler process."""

    enabled: bool = True
    socket_dir: str | None = None
    base_port: int | None = None
    host: str = "127.0.0.1"
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    flush_cache: bool = True
    engine_timeout_s: float = 300.0
    allow_untested: bool = False
    idle_wait_s: float = 5.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, engine_port: int | None = None) -> Settings:
        """Parse the environment; ``engine_port`` (SGLang's ``--port``) names the default directory."""
        env = os.environ if env is None else env
        enabled = _flag(env, ENV_ENABLE, default=True)
        socket_dir = env.get(ENV_SOCKET_DIR) or None
        base_port: int | None = None
        raw_port = env.get(ENV_BASE_PORT)
        if raw_port:
            try:
                base_port = int(raw_port)
            except ValueError:
                raise SettingsError(f"{ENV_BASE_PORT}={raw_port!r} is not a port number") from None
            if not 1 <= base_port <= 65535:
                raise SettingsError(f"{ENV_BASE_PORT}={base_port} is outside 1..65535")
        if socket_dir and base_port is not None:
            raise SettingsError(f"set either {ENV_SOCKET_DIR} or {ENV_BASE_PORT}, not both")
        if socket_dir is None and base_port is None:
            socket_dir = default_socket_dir(engine_port)
        if socket_dir is not None:
            socket_dir = os.path.abspath(socket_dir)
        host = env.get(ENV_HOST) or "127.0.0.1"
        token = env.get(ENV_TOKEN) or None
        if base_port is not None and not is_loopback(host) and token is None:
            raise SettingsError(
                f"{ENV_HOST}={host} is not a loopback address: set {ENV_TOKEN} (and {ENV_TLS_CERT}/{ENV_TLS_KEY}) "
                "so that nobody else on the network can push weights into this engine"
            )
        timeout = _seconds(env, ENV_ENGINE_TIMEOUT, default=300.0, allow_zero=False)
        idle_wait = _seconds(env, ENV_IDLE_WAIT, default=5.0, allow_zero=True)
        return cls(
            enabled=enabled,
            socket_dir=socket_dir,
            base_port=base_port,
            host=host,
            token=token,
            tls_cert=env.get(ENV_TLS_CERT) or None,
            tls_key=env.get(ENV_TLS_KEY) or None,
            flush_cache=_flag(env, ENV_FLUSH_CACHE, default=True),
            engine_timeout_s=timeout,
            allow_untested=_flag(env, ENV_ALLOW_UNTESTED, default=False),
            idle_wait_s=idle_wait,
        )

    def address(self, rank: ParallelRank) -> str:
        """The gRPC target this rank's worker listens on."""
        if self.base_port is not None:
            port = self.base_port + worker_index(rank)
            if port > 65535:
                raise SettingsError(
                    f"{ENV_BASE_PORT}={self.base_port} plus worker index {worker_index(rank)} exceeds 65535"
                )
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"{host}:{port}"
        if self.socket_dir is None:
            raise SettingsError("no socket directory and no base port configured")
        return "unix:" + socket_path(self.socket_dir, rank)

    def engine_key(self) -> str:
        """Names this engine on its host: its socket directory or TCP base address (two engines
        cannot share either), the same in every rank."""
        if self.base_port is not None:
            return f"tcp:{self.host}:{self.base_port}"
        return f"unix:{self.socket_dir}"


def default_socket_dir(engine_port: int | None) -> str:
    suffix = str(engine_port) if engine_port is not None else "default"
    return os.path.join(tempfile.gettempdir(), f"weightwire-sglang-{suffix}")


def socket_path(socket_dir: str, rank: ParallelRank) -> str:
    path = os.path.join(socket_dir, worker_id(rank) + SOCKET_SUFFIX)
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise SettingsError(
            f"Unix socket path {path!r} is {len(path.encode())} bytes, over the kernel's limit of "
            f"{MAX_SOCKET_PATH}: choose a shorter {ENV_SOCKET_DIR}"
        )
    return path


def _seconds(env: Mapping[str, str], key: str, *, default: float, allow_zero: bool) -> float:
    raw = env.get(key)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{key}={raw!r} is not a number of seconds") from None
    if value < 0 or (value == 0 and not allow_zero) or value != value or value == float("inf"):
        raise SettingsError(f"{key} must be {'>= 0' if allow_zero else '> 0'} and finite, got {raw!r}")
    return value


def _flag(env: Mapping[str, str], key: str, *, default: bool) -> bool:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{key}={raw!r}: use 1 or 0")
