"""A transfer-group member in its own process, driven by JSON lines on stdin (one answer line each).

The tests of ``weightwire.core.transports.transfer_group`` start a few of these once per module and play the
other members themselves, so each scenario costs no process start. Every operation goes through
the real library on real gloo sockets; answers carry sha256 digests of received bytes, or the
reason and message of the refusal, and how long the operation took.

Commands (``op``): ``form`` (spec as base64 of the serialized TransferGroupSpec, identity fields,
listen host), ``recv`` / ``send`` / ``broadcast`` (group rank, sequence, byte count, seed),
``close``, ``listening`` (the TCP addresses this process listens on), ``default_group``
(whether the default process group was ever initialised) and ``exit``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
from weightwire.core.errors import WeightwireError
from weightwire.core.manifest import ParallelRank
from weightwire.core.transports.transfer_group import TransferGroup
from weightwire.core.transports.transfer_group_plan import MemberIdentity, message_tag
from weightwire.v1 import weight_transfer_pb2 as pb


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """Deterministic bytes both ends can rebuild."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def identity_of(cmd: dict[str, Any]) -> MemberIdentity:
    if cmd.get("role") == "trainer":
        return MemberIdentity.of_trainer(int(cmd.get("trainer_rank", 0)), cmd["instance_id"])
    rank = ParallelRank(**cmd["rank"])
    return MemberIdentity(pb.TRANSFER_ROLE_WORKER, cmd["instance_id"], cmd["worker_id"], rank)


def listening_addresses() -> list[str]:
    """host:port of every TCP socket this process listens on (from /proc, both families)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A = LISTEN
                continue
            hexaddr, hexport = local.split(":")
            raw = bytes.fromhex(hexaddr)
            if width == 8:
                host = ".".join(str(b) for b in raw[::-1])
            else:
                words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
                joined = b"".join(words)
                import ipaddress

                host = str(ipaddress.IPv6Address(joined))
            out.append(f"{host}:{int(hexport, 16)}")
    return sorted(out)


def main() -> None:
    group: TransferGroup | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        t0 = time.monotonic()
        answer: dict[str, Any] = {"ok": True}
        try:
            if op == "form":
                spec = pb.TransferGroupSpec.FromString(base64.b64decode(cmd["spec"]))
                if group is not None:
                    group.close()
                group = None
                group = TransferGroup.form(
                    spec, identity_of(cmd), listen_host=cmd.get("listen_host", "127.0.0.1")
                )
                answer["rank"] = group.rank
            elif op == "recv":
                assert group is not None
                buf = torch.zeros(int(cmd["nbytes"]), dtype=torch.uint8)
                group.wait(
                    group.recv(buf, int(cmd["src"]), message_tag(int(cmd["sequence"]), 0)), "receiving"
                )
                answer["sha"] = digest(buf)
            elif op == "send":
                assert group is not None
                data = pattern(int(cmd["nbytes"]), int(cmd["seed"]))
                group.wait(group.send(data, int(cmd["dst"]), message_tag(int(cmd["sequence"]), 0)), "sending")
            elif op == "broadcast":
                assert group is not None
                buf = torch.zeros(int(cmd["nbytes"]), dtype=torch.uint8)
                group.wait(group.broadcast(buf, int(cmd["subgroup"])), "receiving a broadcast")
                answer["sha"] = digest(buf)
            elif op == "close":
                if group is not None:
                    group.close()
                group = None
            elif op == "listening":
                answer["addresses"] = listening_addresses()
            elif op == "default_group":
                answer["initialized"] = torch.distributed.is_initialized()
            elif op == "exit":
                print(json.dumps(answer), flush=True)
                return
            else:
                answer = {"ok": False, "reason": "BAD_COMMAND", "message": op}
        except WeightwireError as e:
            answer = {"ok": False, "reason": e.reason, "code": e.code, "message": e.message}
        answer["elapsed_s"] = time.monotonic() - t0
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
