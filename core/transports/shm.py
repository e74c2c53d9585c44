"""Naming rules for POSIX shared-memory segments that weightwire creates and opens.

The client only creates segments named ``ww-<pid>-<random>-<n>``; the server only opens names that
pass ``check_shm_name`` (the project's prefix, no path tricks), so a hostile request cannot make a
worker map an arbitrary segment.
"""

from __future__ import annotations

import os
import re
import secrets

from weightwire.core.errors import Reason, WeightwireError

SHM_PREFIX = "ww-"
# Matched with fullmatch: a pattern ending in `$` would also accept a name with a final newline.
_NAME_RE = re.compile(r"ww-[A-Za-z0-9._-]{1,200}")


def new_shm_name(tag: str = "") -> str:
    """A fresh segment name under the project's prefix."""
    suffix = f"-{tag}" if tag else ""
    return f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}{suffix}"


def check_shm_name(name: str) -> str:
    """Return the bare name (no leading '/') if it is one of ours, else raise INVALID_SHM_NAME."""
    bare = name[1:] if name.startswith("/") else name
    if not _NAME_RE.fullmatch(bare) or ".." in bare:
        raise WeightwireError(
            Reason.INVALID_SHM_NAME,
            f"shared-memory name {name!r} is not allowed: it must start with {SHM_PREFIX!r} and contain "
            "only [A-Za-z0-9._-] (no '/', no '..')",
            name=name,
        )
    return bare


_OWNER_RE = re.compile(r"^ww-(\d+)-")
SHM_DIR = "/dev/shm"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def sweep_orphans(directory: str = SHM_DIR) -> list[str]:
    """Unlink ``ww-<pid>-...`` segments whose creating process is gone; return the names removed.

    A trainer that is SIGKILLed cannot unlink its own segments, and nothing else owns them (workers
    never unlink). Trainers call this at start (and tests after killing one) to reclaim that memory.
    Only segments owned by this user are touched, and a live pid keeps its segments even if the pid
    was reused, so the sweep never removes memory a running sender of this PID namespace may still
    be writing. Pids are looked up in this process's PID namespace: do not sweep a /dev/shm shared
    with containers that have their own (e.g. ``docker --ipc=host`` without ``--pid=host``), where
    a live trainer's pid would look dead.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    uid = os.geteuid()
    for entry in entries:
        m = _OWNER_RE.match(entry.name)
        if not m:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid or not entry.is_file(follow_symlinks=False):
                continue
        except OSError:
            continue
        if _pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue  # another sweeper got there first
        removed.append(entry.name)
    return removed
