"""Helpers of the client tests: engines of real ``weightwire serve`` processes (started
concurrently, once per module) and bit-exact checks of their parameters through the dump files.

Worker processes come from ``helpers.spawn_worker`` (tests/helpers.py); this module only adds
starting several at once and checking a whole engine.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from helpers import WorkerProcess, demo_args, load_dump, spawn_worker
from weightwire.adapters.torch.demo import DemoConfig, expected_shard
from weightwire.core.manifest import ParallelRank, ShardManifest

CONFIG = DemoConfig()


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    tp: tuple[int, int] = (0, 1)
    pp: tuple[int, int] = (0, 1)
    extra: tuple[str, ...] = ()
    listen: str | None = None


def layout(tp: int, pp: int) -> list[WorkerSpec]:
    return [WorkerSpec((t, tp), (p, pp)) for p in range(pp) for t in range(tp)]


@dataclasses.dataclass
class Engine:
    """Worker processes of one engine, all writing their state to ``dump_dir`` after each commit."""

    workers: list[WorkerProcess]
    specs: list[WorkerSpec]
    dump_dir: str

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    def restart(self, i: int) -> WorkerProcess:
        """Stop worker ``i`` and start it again with the same arguments (same address if it had one)."""
        self.workers[i].stop()
        self.workers[i] = _spawn(self.specs[i], self.dump_dir)
        return self.workers[i]

    def stop(self) -> None:
        for w in self.workers:  # signal all first: they shut down in parallel
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            w.stop()


def _spawn(spec: WorkerSpec, dump_dir: str) -> WorkerProcess:
    return spawn_worker(
        *demo_args(tp=spec.tp, pp=spec.pp, listen=spec.listen, dump_dir=dump_dir, extra=spec.extra)
    )


def start_engine(specs: Sequence[WorkerSpec], dump_dir: str | os.PathLike[str]) -> Engine:
    """Start every worker at once (each imports torch; in parallel this costs one start, not N)."""
    dump = str(dump_dir)
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        futures = [pool.submit(_spawn, s, dump) for s in specs]
        started: list[WorkerProcess] = []
        errors: list[BaseException] = []
        for f in futures:
            try:
                started.append(f.result())
            except BaseException as e:
                errors.append(e)
    if errors:
        for w in started:
            w.stop()
        raise errors[0]
    return Engine(started, list(specs), dump)


def shard_mismatches(
    dump_dir: str, manifests: Mapping[str, ShardManifest], full: Mapping[str, torch.Tensor], version: int
) -> dict[str, list[str]]:
    """Per worker, the names whose dumped v``version`` parameters differ from ``expected_shard``
    (missing or extra names included); empty when every worker holds exactly its shard of ``full``."""
    out: dict[str, list[str]] = {}
    for m in manifests.values():
        got = load_dump(dump_dir, m.worker_id, version)
        want = expected_shard(dict(full), m.rank, CONFIG)
        bad = sorted(set(got) ^ set(want)) + [
            n for n in want if n in got and not torch.equal(got[n], want[n])
        ]
        if bad:
            out[m.worker_id] = bad
    return out


def dump_exists(dump_dir: str, worker_id: str, version: int) -> bool:
    return os.path.exists(os.path.join(dump_dir, f"{worker_id}-v{version}.safetensors"))


__all__ = [
    "CONFIG",
    "Engine",
    "ParallelRank",
    "WorkerSpec",
    "dump_exists",
    "layout",
    "shard_mismatches",
    "start_engine",
]
