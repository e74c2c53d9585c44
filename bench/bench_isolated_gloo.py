"""A worker's gloo receives through its receiving process (``isolated_gloo``) against the same
receives in the worker's own process, between the same two processes, same run.

    .venv/bin/python bench/bench_isolated_gloo.py [--messages 8x16MiB,512x256KiB] [--reps 7] [--out DIR]

Two processes on loopback: a sender (a ``ProcessGroupGloo`` of its own, serving weightwire's store)
and a receiver that receives each batch of messages into tensors of its own, either through a
``ReceivingProcess`` (``recv_staged``, then ``land``: what a worker's every-rank-a-source receive
does, the bytes copied from the shared segments into the tensors at the commit) or through a
``ProcessGroupGloo`` in its own process (what ``WEIGHTWIRE_ISOLATED_GLOO=0`` does). Between
barriers, per repetition: the receive (posted to every message arrived), the landing copy, and the
two together. Ratio = in-process / isolated (1.0: the isolation costs nothing). Medians.
Results go to ``DIR/isolated_gloo.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import torch
from weightwire.core.transports.isolated_gloo import ReceivingProcess
from weightwire.core.transports.transfer_group import BACKENDS
from weightwire.core.transports.transfer_group_store import StoreServer, connect_store
from weightwire.v1 import weight_transfer_pb2 as pb

HOST = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=120)
_, _gloo = BACKENDS[pb.TRANSFER_BACKEND_GLOO]


def _sizes(spec: str) -> list[tuple[int, int]]:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    out = []
    for item in spec.split(","):
        count, size = item.split("x")
        unit = next(u for u in units if size.endswith(u))
        out.append((int(count), int(float(size.removesuffix(unit)) * units[unit])))
    return out


def _sender(port: int, batches: list[tuple[int, int]], reps: int) -> None:
    server = StoreServer(HOST, port)
    groups = [
        _gloo(torch.distributed.PrefixStore(prefix, server.store), 0, 2, TIMEOUT, HOST, torch.device("cpu"))
        for prefix in ("pg", "iso")  # the receiver's in-process group, then its isolated one
    ]
    for count, size in batches:
        bufs = [torch.randint(0, 255, (size,), dtype=torch.uint8) for _ in range(count)]
        for pg in groups:
            for _ in range(reps + 1):
                pg.barrier().wait(TIMEOUT)
                for work in [pg.send([b], 1, 0) for b in bufs]:
                    work.wait(TIMEOUT)
    groups[0].barrier().wait(TIMEOUT)
    server.close()


def _receiver(port: int, batches: list[tuple[int, int]], reps: int) -> dict[str, object]:
    address = f"{HOST}:{port}"
    deadline = time.monotonic() + 120
    while True:  # the sender is still importing torch
        try:
            base = connect_store(address, 60)  # kept: the process group holds it from C++ only
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    inproc = _gloo(torch.distributed.PrefixStore("pg", base), 1, 2, TIMEOUT, HOST, torch.device("cpu"))
    receiving = ReceivingProcess()
    receiving.wait_ready(60)
    isolated = receiving.process_group(address, ["iso"], 1, 2, TIMEOUT, HOST)
    rows = []
    for count, size in batches:
        into = [torch.zeros(size, dtype=torch.uint8) for _ in range(count)]
        row: dict[str, object] = {"messages": count, "message_bytes": size}
        for mode in ("in_process", "isolated"):
            receive, land, total = [], [], []
            for rep in range(reps + 1):  # the first repetition warms up (page faults, segments)
                pg = isolated if mode == "isolated" else inproc
                pg.barrier().wait(TIMEOUT)
                t0 = time.perf_counter()
                if mode == "isolated":
                    works = [pg.recv_staged([t], 0, 0) for t in into]
                else:
                    works = [pg.recv([t], 0, 0) for t in into]
                for work in works:
                    work.wait(TIMEOUT)
                t1 = time.perf_counter()
                for work in works:
                    if mode == "isolated":
                        work.land()
                t2 = time.perf_counter()
                if rep:
                    receive.append((t1 - t0) * 1e3)
                    land.append((t2 - t1) * 1e3)
                    total.append((t2 - t0) * 1e3)
            row[mode] = {
                "receive_ms": statistics.median(receive),
                "land_ms": statistics.median(land),
                "total_ms": statistics.median(total),
                "gb_per_s": count * size / statistics.median(total) / 1e6,
            }
        row["ratio"] = row["in_process"]["total_ms"] / row["isolated"]["total_ms"]  # type: ignore[index]
        rows.append(row)
    inproc.barrier().wait(TIMEOUT)
    receiving.kill()
    return {"rows": rows, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", default="8x16MiB,512x256KiB", help="COUNTxSIZE,... batches of messages")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="")
    p.add_argument("--role", default="main", choices=["main", "sender"])
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    batches = _sizes(args.messages)
    if args.role == "sender":
        _sender(args.port, batches, args.reps)
        return
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = int(s.getsockname()[1])
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")
    sender = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "sender",
            "--port",
            str(port),
            "--messages",
            args.messages,
            "--reps",
            str(args.reps),
        ],
        env=env,
    )
    time.sleep(0.5)
    try:
        result = _receiver(port, batches, args.reps)
    finally:
        sender.wait(120)
    for row in result["rows"]:  # type: ignore[attr-defined]
        i, s = row["in_process"], row["isolated"]
        print(
            f"{row['messages']} x {row['message_bytes'] >> 10} KiB: in-process {i['total_ms']:.1f} ms, "
            f"isolated {s['total_ms']:.1f} ms (receive {s['receive_ms']:.1f} + land {s['land_ms']:.1f}), "
            f"ratio {row['ratio']:.2f}"
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "isolated_gloo.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
