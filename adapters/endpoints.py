"""Where the weightwire worker inside one engine rank listens, the same way for every engine.

An engine adapter (SGLang, vLLM) runs one
worker service per rank process and derives its address from the rank alone, so every rank of an
engine, and ``weightwire.adapters.discovery`` on the trainer side, agree on the addresses without
talking to each other:

- a Unix socket ``<socket_dir>/<worker_id>.sock`` (``worker_id`` is ``tp1-pp0``, plus ``-dp2`` with
  data-parallel replicas), in a directory created with mode 0700; or
- TCP ``HOST:(BASE_PORT + worker_index)``, ``worker_index = (dp_rank * pp_size + pp_rank) * tp_size
  + tp_rank`` (the global rank order of both SGLang and vLLM).

``EndpointSettings.from_env`` reads ``<PREFIX>_SOCKET_DIR``, ``<PREFIX>_BASE_PORT`` and
``<PREFIX>_HOST`` for one engine's prefix (``WEIGHTWIRE_SGLANG``, ``WEIGHTWIRE_VLLM``), plus the engine-independent
``WEIGHTWIRE_TOKEN``, ``WEIGHTWIRE_TLS_CERT`` and ``WEIGHTWIRE_TLS_KEY``; ``env_seconds`` and
``env_flag`` parse an adapter's own knobs the same way everywhere. Pure except for
``prepare_socket``: no engine, no gRPC.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import socket
import stat
from collections.abc import Mapping

from weightwire.core.manifest import ParallelRank
from weightwire.core.netutil import is_loopback as is_loopback

log = logging.getLogger(__name__)

ENV_TOKEN = "WEIGHTWIRE_TOKEN"
ENV_TLS_CERT = "WEIGHTWIRE_TLS_CERT"
ENV_TLS_KEY = "WEIGHTWIRE_TLS_KEY"

SOCKET_SUFFIX = ".sock"
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
_WORKER_ID_RE = re.compile(r"^tp(\d+)-pp(\d+)(?:-dp(\d+))?(?:-sp(\d+))?\Z")


def env_seconds(env: Mapping[str, str], key: str, *, default: float, allow_zero: bool = False) -> float:
    """A duration in seconds from ``env[key]``: finite, > 0 (or >= 0 with ``allow_zero``)."""
    raw = env.get(key)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{key}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise SettingsError(f"{key} must be {'>= 0' if allow_zero else '> 0'} and finite, got {raw!r}")
    return value


def env_flag(env: Mapping[str, str], key: str, *, default: bool) -> bool:
    """A boolean from ``env[key]``: 1/true/yes/on or 0/false/no/off; unset or empty is ``default``."""
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{key}={raw!r}: use 1 or 0")


class SettingsError(ValueError):
    """A weightwire environment variable has a value the engine adapter cannot use."""


def worker_id(rank: ParallelRank) -> str:
    """``tp1-pp0``, plus ``-dp2`` / ``-sp1`` when those sizes are > 1 (the torch adapter's naming)."""
    text = f"tp{rank.tp_rank}-pp{rank.pp_rank}"
    if rank.dp_size > 1:
        text += f"-dp{rank.dp_rank}"
    if rank.sp_size > 1:
        text += f"-sp{rank.sp_rank}"
    return text


def parse_worker_id(text: str) -> tuple[int, int, int, int] | None:
    """``(dp, pp, tp, sp)`` ranks of a worker id (the sort key of discovery), or None if not one."""
    m = _WORKER_ID_RE.match(text)
    if m is None:
        return None
    tp, pp, dp, sp = (int(g) if g is not None else 0 for g in m.groups())
    return dp, pp, tp, sp


def engine_rank(
    *,
    tp: tuple[int, int],
    pp: tuple[int, int],
    dp: tuple[int | None, int | None],
    sp: tuple[int, int] = (0, 1),
) -> ParallelRank:
    """The ``ParallelRank`` of an engine's rank process from its parallel state's ``(rank, size)``
    of each dimension (SGLang's and vLLM's adapters both build it here).

    A data-parallel rank that is unknown or not below the data-parallel size (SGLang without DP
    attention, a vLLM replica launched on its own) means one replica: ``dp`` is then 0 of 1, so the
    worker id and index do not name replicas that no one else of this engine counts.
    """
    dp_rank, dp_size = dp[0], dp[1] or 1
    if dp_rank is None or dp_rank >= dp_size:
        dp_rank, dp_size = 0, 1
    return ParallelRank(tp[0], tp[1], pp[0], pp[1], dp_rank, dp_size, sp[0], sp[1])


def worker_index(rank: ParallelRank) -> int:
    """Dense index of a rank process: ``(dp_rank * pp_size + pp_rank) * tp_size + tp_rank``."""
    return (rank.dp_rank * rank.pp_size + rank.pp_rank) * rank.tp_size + rank.tp_rank


def socket_path(socket_dir: str, rank: ParallelRank, *, env_name: str = "the socket directory") -> str:
    path = os.path.join(socket_dir, worker_id(rank) + SOCKET_SUFFIX)
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise SettingsError(
            f"Unix socket path {path!r} is {len(path.encode())} bytes, over the kernel's limit of "
            f"{MAX_SOCKET_PATH}: choose a shorter {env_name}"
        )
    return path


@dataclasses.dataclass(frozen=True)
class EndpointSettings:
    """How one engine's workers listen: a socket directory or a TCP base port, and credentials."""

    socket_dir: str | None = None
    base_port: int | None = None
    host: str = "127.0.0.1"
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    env_prefix: str = "WEIGHTWIRE"

    @classmethod
    def from_env(
        cls, prefix: str, *, default_socket_dir: str, env: Mapping[str, str] | None = None
    ) -> EndpointSettings:
        """Parse ``<prefix>_SOCKET_DIR`` / ``<prefix>_BASE_PORT`` / ``<prefix>_HOST`` and the token and TLS
        variables; with neither a directory nor a port, sockets go to ``default_socket_dir``."""
        env = os.environ if env is None else env
        dir_var, port_var, host_var = f"{prefix}_SOCKET_DIR", f"{prefix}_BASE_PORT", f"{prefix}_HOST"
        socket_dir = env.get(dir_var) or None
        base_port: int | None = None
        raw_port = env.get(port_var)
        if raw_port:
            try:
                base_port = int(raw_port)
            except ValueError:
                raise SettingsError(f"{port_var}={raw_port!r} is not a port number") from None
            if not 1 <= base_port <= 65535:
                raise SettingsError(f"{port_var}={base_port} is outside 1..65535")
        if socket_dir and base_port is not None:
            raise SettingsError(f"set either {dir_var} or {port_var}, not both")
        if socket_dir is None and base_port is None:
            socket_dir = default_socket_dir
        host = env.get(host_var) or "127.0.0.1"
        token = env.get(ENV_TOKEN) or None
        if base_port is not None and not is_loopback(host) and token is None:
            raise SettingsError(
                f"{host_var}={host} is not a loopback address: set {ENV_TOKEN} (and {ENV_TLS_CERT}/{ENV_TLS_KEY}) "
                "so that nobody else on the network can push weights into this engine"
            )
        tls_cert, tls_key = env.get(ENV_TLS_CERT) or None, env.get(ENV_TLS_KEY) or None
        if (tls_cert is None) != (tls_key is None):
            raise SettingsError(f"TLS needs both {ENV_TLS_CERT} and {ENV_TLS_KEY}")
        return cls(
            socket_dir=os.path.abspath(socket_dir) if socket_dir is not None else None,
            base_port=base_port,
            host=host,
            token=token,
            tls_cert=tls_cert,
            tls_key=tls_key,
            env_prefix=prefix,
        )

    def address(self, rank: ParallelRank) -> str:
        """The gRPC target this rank's worker listens on."""
        if self.base_port is not None:
            port = self.base_port + worker_index(rank)
            if port > 65535:
                raise SettingsError(
                    f"{self.env_prefix}_BASE_PORT={self.base_port} plus worker index {worker_index(rank)} exceeds 65535"
                )
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"{host}:{port}"
        if self.socket_dir is None:
            raise SettingsError("no socket directory and no base port configured")
        return "unix:" + socket_path(self.socket_dir, rank, env_name=f"{self.env_prefix}_SOCKET_DIR")


def prepare_socket(path: str, *, env_hint: str = "its own socket directory") -> None:
    """Create the socket's directory (0700) and remove a stale socket of a previous run at ``path``.

    Refuses a directory owned by another user, a non-socket file at ``path``, and a socket that
    another worker still listens on (two engines given the same directory).
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"weightwire socket directory {directory} belongs to uid {st.st_uid}, not to us"
        )
    if st.st_mode & 0o077:
        # Anyone who can connect can push weights. Not changed here: the directory may be shared.
        log.warning(
            "weightwire: socket directory %s is accessible to other users (mode %o)",
            directory,
            st.st_mode & 0o777,
        )
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    if unix_socket_alive(path):
        raise FileExistsError(
            f"another worker is listening at {path} (a second engine with the same socket directory?); "
            f"give each engine {env_hint}"
        )
    os.unlink(path)


def unix_socket_alive(path: str) -> bool:
    """Whether something accepts connections on the Unix socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True
