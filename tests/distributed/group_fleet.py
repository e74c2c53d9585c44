"""A fleet of real ``weightwire serve`` demo workers for the transfer-group tests: TP2 x PP2 in each
of ``replicas`` data-parallel replicas, each on a unix socket of a fixed path (so a killed worker
comes back at the same address) with a dump directory; plus what each worker must hold."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence

import grpc
import torch
from helpers import WorkerProcess, demo_args, load_dump, spawn_worker, spawn_workers
from weightwire.adapters.torch import default_worker_id
from weightwire.adapters.torch.demo import DemoConfig, expected_shard
from weightwire.core.manifest import ParallelRank
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

CONFIG = DemoConfig()
HERE = os.path.dirname(os.path.abspath(__file__))
QUIET_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}


@dataclasses.dataclass
class Member:
    rank: ParallelRank
    args: list[str]
    process: WorkerProcess

    @property
    def worker_id(self) -> str:
        return default_worker_id(self.rank)

    @property
    def address(self) -> str:
        return self.process.address

    def stub(self) -> pb_grpc.WeightTransferServiceStub:
        return pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(self.address))

    def status(self) -> pb.GetStatusResponse:
        return self.stub().GetStatus(pb.GetStatusRequest(), timeout=30)


class Fleet:
    def __init__(self, socket_dir: str, dump_dir: str, replicas: int = 2, extra: Sequence[str] = ()) -> None:
        self.dump_dir = dump_dir
        ranks = [
            ParallelRank(tp_rank=t, tp_size=2, pp_rank=p, pp_size=2, dp_rank=d, dp_size=replicas)
            for d in range(replicas)
            for p in range(2)
            for t in range(2)
        ]
        arg_lists = []
        for r in ranks:
            sock = os.path.join(socket_dir, f"{default_worker_id(r)}.sock")
            arg_lists.append(
                demo_args(
                    tp=(r.tp_rank, 2),
                    pp=(r.pp_rank, 2),
                    dump_dir=dump_dir,
                    listen=f"unix:{sock}",
                    extra=["--dp-rank", str(r.dp_rank), "--dp-size", str(replicas), *extra],
                )
            )
        os.environ.update(QUIET_ENV)
        processes = spawn_workers(arg_lists)
        self.members = [Member(r, a, p) for r, a, p in zip(ranks, arg_lists, processes, strict=True)]

    def replica(self, dp: int) -> list[Member]:
        return [m for m in self.members if m.rank.dp_rank == dp]

    def addresses(self, members: list[Member] | None = None) -> list[str]:
        return [m.address for m in (members if members is not None else self.members)]

    def restart(self, member: Member) -> None:
        """Start the worker again at the same address (a new process: a new instance id)."""
        member.process.stop()
        sock = member.address.removeprefix("unix:")
        if os.path.exists(sock):
            os.unlink(sock)
        member.process = spawn_worker(*member.args)

    def next_version(self, members: list[Member] | None = None) -> int:
        return max(m.status().weights_version for m in (members or self.members)) + 1

    def assert_holds(self, member: Member, version: int, full: dict[str, torch.Tensor]) -> None:
        """The worker's dump of ``version`` is bit for bit its shard of ``full``."""
        got = load_dump(self.dump_dir, member.worker_id, version)
        want = expected_shard(full, member.rank, CONFIG)
        assert sorted(got) == sorted(want), member.worker_id
        for name, t in want.items():
            assert torch.equal(got[name], t), f"{member.worker_id}: {name} differs from version {version}"

    def stop(self) -> None:
        for m in self.members:
            m.process.stop()


class Trainer:
    """``group_trainer.py`` in a process of its own."""

    def __init__(self, addresses: list[str], version: int, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "group_trainer.py"),
                "--version",
                str(version),
                *extra,
                *addresses,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **QUIET_ENV},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(
                f"trainer did not start: {line!r} {self.proc.stderr.read() if self.proc.stderr else ''}"
            )

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 120.0) -> dict[str, object]:
        out, err = self.proc.communicate(timeout=timeout)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"trainer exited with {self.proc.returncode} and no result: {err[-2000:]}")
        return json.loads(lines[-1])

    def wait(self, timeout: float = 120.0) -> int:
        self.proc.communicate(timeout=timeout)
        return self.proc.returncode
