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
_NAME_RE = re.compile(r"^ww-[A-Za-z0-9._-]{1,200}$")


def new_shm_name(tag: str = "") -> str:
    """A fresh segment name under the project's prefix."""
    suffix = f"-{tag}" if tag else ""
    return f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}{suffix}"


def check_shm_name(name: str) -> str:
    """Return the bare name (no leading '/') if it is one of ours, else raise INVALID_SHM_NAME."""
    bare = name[1:] if name.startswith("/") else name
    if not _NAME_RE.match(bare) or ".." in bare:
        raise WeightwireError(
            Reason.INVALID_SHM_NAME,
            f"shared-memory name {name!r} is not allowed: it must start with {SHM_PREFIX!r} and contain "
            "only [A-Za-z0-9._-] (no '/', no '..')",
            name=name,
        )
    return bare
