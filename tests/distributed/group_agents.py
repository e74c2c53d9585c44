"""Test helpers for transfer groups: ``Agent`` (a ``group_agent.py`` member process driven over its
stdin/stdout) and builders for plans the tests hand out, right or deliberately wrong."""

from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import threading
import uuid
from typing import Any

from weightwire.core.manifest import ParallelRank
from weightwire.core.transports.transfer_group_plan import MemberIdentity
from weightwire.v1 import weight_transfer_pb2 as pb

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "group_agent.py")
# The c10d layer logs every retry with a stack trace; tests read reasons from the answers instead.
QUIET_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"}


class Agent:
    """One ``group_agent.py`` process. ``identity`` is who it claims to be in plans."""

    def __init__(self, worker_id: str, rank: ParallelRank) -> None:
        self.identity = MemberIdentity(pb.TRANSFER_ROLE_WORKER, uuid.uuid4().hex, worker_id, rank)
        self.proc = subprocess.Popen(
            [sys.executable, AGENT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **QUIET_ENV},
        )
        self._answers: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._answers.put(line)
        self._answers.put(None)

    def send(self, op: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 60.0) -> dict[str, Any]:
        line = self._answers.get(timeout=timeout)
        if line is None:
            raise RuntimeError(f"agent {self.identity.worker_id} exited with {self.proc.wait()}")
        return json.loads(line)

    def call(self, op: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        self.send(op, **fields)
        return self.answer(timeout)

    def form(self, spec: pb.TransferGroupSpec, **fields: Any) -> None:
        """Start forming (answer later with ``answer()``: forming blocks until all members met)."""
        ident = self.identity
        assert ident.rank is not None
        self.send(
            "form",
            spec=base64.b64encode(spec.SerializeToString()).decode(),
            instance_id=fields.pop("instance_id", ident.instance_id),
            worker_id=ident.worker_id,
            rank={
                f: getattr(ident.rank, f)
                for f in ("tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank", "dp_size")
            },
            **fields,
        )

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=10)
            except Exception:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def spec_of(
    group_id: str,
    store_address: str,
    members: list[MemberIdentity],
    *,
    subgroups: list[list[int]] = (),  # type: ignore[assignment]
    world_size: int | None = None,
    timeout_ms: int = 20_000,
    backend: int = pb.TRANSFER_BACKEND_GLOO,
) -> pb.TransferGroupSpec:
    """A spec listing ``members`` at group ranks 0.. in order (each subgroup rooted at rank 0)."""
    return pb.TransferGroupSpec(
        group_id=group_id,
        backend=backend,  # type: ignore[arg-type]
        store_address=store_address,
        world_size=world_size if world_size is not None else len(members),
        members=[m.to_proto(i) for i, m in enumerate(members)],
        subgroups=[
            pb.TransferSubgroup(subgroup_id=i, member_ranks=ranks, root_rank=0)
            for i, ranks in enumerate(subgroups)
        ],
        timeout_ms=timeout_ms,
        max_bucket_bytes=1 << 20,
    )
