"""The shared-memory segments a test's SGLang engine leaves in /dev/shm, found and removed.

SGLang ends its processes with SIGKILL (``kill_process_tree``; a test's teardown does the same to
what is left of an engine), which skips every unlink: the broadcast queues (``sgl_shm_mq_<pid>_*``),
the load-snapshot file (``sglang_loads_*``) and multiprocessing's named semaphores (``sem.mp-*``)
stay behind, ~25 MiB per engine. SGLang's own sweep runs only in its CI and deletes by prefix, which
on a machine shared with other engines would take theirs.

So the engine's segments are attributed, not guessed: ``GroupShm.sample`` reads, while the engine
runs, which /dev/shm files each process of its process group has open or mapped (and remembers the
group's pids, which SGLang stamps into some names, and the listing of /dev/shm); once the group is
gone, ``remove_leftovers`` unlinks those of them, and those of the families above that appeared
after the last sample (the engine's shutdown makes a few), that no living process holds. Called by
``real_engine.stop_process_group``, which every test engine's teardown goes through.
"""

from __future__ import annotations

import contextlib
import os

SHM = "/dev/shm"
# Segment families an SGLang engine creates (Python's SharedMemory default is psm_*).
FAMILIES = ("sgl_shm_", "sglang_loads_", "sem.mp-", "psm_", "multi_tokenizer_args_")


def _group_pids(pgid: int) -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            pids.add(int(entry))
    return pids


def _held_by(pid: int) -> set[str]:
    """Names of the /dev/shm files process ``pid`` has open or mapped."""
    names = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM + "/"):
                    names.add(target[len(SHM) + 1 :].removesuffix(" (deleted)"))
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith(SHM + "/"):
                names.add(path[len(SHM) + 1 :].removesuffix(" (deleted)"))
    return names


def held_by_anyone() -> set[str]:
    names: set[str] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            names |= _held_by(int(entry))
    return names


def _stamped_pid(name: str) -> int | None:
    """The creator's pid in a pid-stamped SGLang name (``sgl_shm_<kind>_<pid>_<rand>``)."""
    parts = name.split("_")
    if name.startswith("sgl_shm_") and len(parts) >= 4 and parts[-2].isdigit():
        return int(parts[-2])
    return None


class GroupShm:
    """The /dev/shm segments of one process group (an engine started with ``start_new_session``)."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.pids: set[int] = set()
        self.names: set[str] = set()
        self.listed: set[str] | None = None

    def sample(self) -> None:
        """Record what the group's processes hold now, and what /dev/shm holds (call while the
        engine runs, last just before its stop)."""
        with contextlib.suppress(OSError):
            self.listed = set(os.listdir(SHM))
        for pid in _group_pids(self.pgid):
            self.pids.add(pid)
            self.names |= {n for n in _held_by(pid) if n.startswith(FAMILIES)}

    def remove_leftovers(self) -> list[str]:
        """Unlink the group's segments that no living process holds; the names removed."""
        try:
            present = set(os.listdir(SHM))
        except OSError:
            return []
        ours = {n for n in present if n in self.names or _stamped_pid(n) in self.pids}
        # Its shutdown creates a few more (multiprocessing semaphores) after the last sample.
        ours |= {n for n in present - (self.listed or present) if n.startswith(FAMILIES)}
        if not ours:
            return []
        held = held_by_anyone()
        removed = []
        for name in sorted(ours - held):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM, name))
                removed.append(name)
        return removed
