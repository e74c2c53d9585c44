"""Shared pieces of the reliability tests: raw-stub pushes, ErrorInfo extraction, worker processes,
shared-memory bookkeeping and /proc readings.

Everything here talks to workers the way an arbitrary client would (generated stubs, no weightwire
client code), so the tests see exactly what the wire carries.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

import grpc
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import ERROR_DOMAIN, Reason
from weightwire.core.manifest import ParallelRank
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

SHM_DIR = "/dev/shm"
READY_PREFIX = "weightwire-serve listening "
RPC_TIMEOUT_S = 60.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Filled by the adversarial tests (kind of case -> examples run); printed at the end of the session.
CASES_RUN: collections.Counter[str] = collections.Counter()
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


# ---------------------------------------------------------------------------------------------
# Raw-stub pushes and errors
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """What one PushWeights stream got back: the responses, then the final status."""

    responses: list[pb.PushWeightsResponse]
    code: grpc.StatusCode
    message: str
    info: error_details_pb2.ErrorInfo | None
    error_infos: int  # how many ErrorInfo details the status carried (the contract says exactly one)

    @property
    def acks(self) -> list[pb.BucketAck]:
        return [r.ack for r in self.responses if r.WhichOneof("message") == "ack"]

    @property
    def result(self) -> pb.UpdateResult | None:
        results = [r.result for r in self.responses if r.WhichOneof("message") == "result"]
        return results[-1] if results else None

    @property
    def reason(self) -> str | None:
        return self.info.reason if self.info is not None else None

    def describe(self) -> str:
        return f"{self.code.name} reason={self.reason} message={self.message!r} acks={len(self.acks)} result={self.result is not None}"


def error_info(err: grpc.RpcError) -> tuple[error_details_pb2.ErrorInfo | None, int]:
    """The status's ErrorInfo (the first) and how many there were."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    infos: list[error_details_pb2.ErrorInfo] = []
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                infos.append(info)
    return (infos[0] if infos else None), len(infos)


def push_raw(
    stub: pb_grpc.WeightTransferServiceStub,
    requests: Iterable[pb.PushWeightsRequest],
    *,
    timeout: float = RPC_TIMEOUT_S,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> Outcome:
    """Send a request stream and collect every response and the final status (never raises RpcError)."""
    responses: list[pb.PushWeightsResponse] = []
    call = stub.PushWeights(iter(list(requests)), timeout=timeout, metadata=metadata)
    try:
        for resp in call:
            responses.append(resp)
    except grpc.RpcError as err:
        info, n = error_info(err)
        return Outcome(responses, err.code(), err.details() or "", info, n)
    return Outcome(responses, grpc.StatusCode.OK, "", None, 0)


def assert_weightwire_error(outcome: Outcome, reasons: Iterable[str] | str) -> str:
    """The status carries exactly one ErrorInfo of our domain whose reason is expected and whose
    code is the one the reason table gives; returns the reason."""
    want = {reasons} if isinstance(reasons, str) else set(reasons)
    assert outcome.code != grpc.StatusCode.OK, f"expected {sorted(want)}, got success: {outcome.describe()}"
    assert outcome.info is not None and outcome.error_infos == 1, f"no single ErrorInfo: {outcome.describe()}"
    assert outcome.info.domain == ERROR_DOMAIN, outcome.describe()
    assert outcome.info.reason in want, f"expected {sorted(want)}, got {outcome.describe()}"
    assert outcome.code.name == Reason[outcome.info.reason].code, f"code does not match reason: {outcome.describe()}"
    assert outcome.message, "an error must carry a message a person can act on"
    return outcome.info.reason


def rpc_error_of(fn: object, *args: object, **kw: object) -> grpc.RpcError:
    """Call a unary stub method that must fail; return its RpcError."""
    try:
        fn(*args, **kw)  # type: ignore[operator]
    except grpc.RpcError as err:
        return err
    raise AssertionError(f"{fn} succeeded but should have failed")


# ---------------------------------------------------------------------------------------------
# Building valid updates by hand (inline or in a test-owned segment)
# ---------------------------------------------------------------------------------------------


def pack(named: Mapping[str, torch.Tensor], align: int = 64) -> tuple[bytes, list[pb.TensorSpec]]:
    """Lay tensors out back to back (aligned) in one byte string; return it and the specs."""
    parts: list[bytes] = []
    specs: list[pb.TensorSpec] = []
    offset = 0
    for name, t in named.items():
        data = t.detach().contiguous().view(torch.uint8).numpy().tobytes()
        specs.append(pb.TensorSpec(name=name, dtype=dtypes.from_torch(t.dtype), shape=list(t.shape), offset_bytes=offset))  # type: ignore[arg-type]
        parts.append(data)
        offset += len(data)
        pad = -offset % align
        parts.append(b"\0" * pad)
        offset += pad
    return b"".join(parts), specs


def inline_update(
    named: Mapping[str, torch.Tensor],
    version: int,
    device: DeviceRef,
    *,
    scope: int = pb.UPDATE_SCOPE_FULL,
    fingerprint: str = "",
) -> list[pb.PushWeightsRequest]:
    """A complete valid update (header, one inline bucket, commit)."""
    blob, specs = pack(named)
    bucket = pb.Bucket(
        index=0, tensors=specs, payloads=[pb.Payload(device=device.to_proto(), size_bytes=len(blob), inline_data=blob)]
    )
    return [
        pb.PushWeightsRequest(header=pb.UpdateHeader(version=version, scope=scope, manifest_fingerprint=fingerprint)),  # type: ignore[arg-type]
        pb.PushWeightsRequest(bucket=bucket),
        pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=1)),
    ]


class TestSegment:
    """A shared-memory segment created by the test itself (``ww-<pid>-...``), unlinked on close."""

    __test__ = False  # not a pytest class

    def __init__(self, name: str, data: bytes) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def demo_adapter(seed: int = 0) -> TorchAdapter:
    """The demo model (one rank, CPU) behind the torch adapter, as `weightwire serve` builds it."""
    config = DemoConfig()
    rank = ParallelRank()
    return TorchAdapter(
        build_demo_model(config, rank, "cpu", seed), rank=rank, device=torch.device("cpu"),
        own_device=DeviceRef.host(), tp_rules=DEMO_TP_RULES, num_layers=config.num_layers,
    )


# ---------------------------------------------------------------------------------------------
# Worker processes (`weightwire serve`) and /proc
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class WorkerProcess:
    proc: subprocess.Popen[str]
    address: str
    args: tuple[str, ...]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def channel(self, **kw: object) -> grpc.Channel:
        return grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)

    def stub(self) -> pb_grpc.WeightTransferServiceStub:
        return pb_grpc.WeightTransferServiceStub(self.channel())

    def stop(self) -> None:
        stop_process(self.proc)


def serve_command(
    *,
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
    listen: str | None = None,
    seed: int = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    cmd = [
        sys.executable, "-m", "weightwire.client.cli", "serve", "--model", "demo",
        "--tp-rank", str(tp[0]), "--tp-size", str(tp[1]), "--pp-rank", str(pp[0]), "--pp-size", str(pp[1]),
        "--seed", str(seed), "--device", "cpu",
    ]
    if listen is not None:
        cmd += ["--listen", listen]
    return [*cmd, *extra]


def start_worker(cmd: Sequence[str], *, timeout: float = 120.0, env: Mapping[str, str] | None = None) -> WorkerProcess:
    """Start a `weightwire serve` process and wait for its 'listening ADDR' line."""
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
        env=dict(env) if env is not None else None,
    )
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=0.5):
                line = proc.stdout.readline()
                if line.startswith(READY_PREFIX):
                    return WorkerProcess(proc, line[len(READY_PREFIX):].strip(), tuple(cmd))
    finally:
        sel.close()
    stop_process(proc)
    err = proc.stderr.read() if proc.stderr else ""
    raise RuntimeError(f"worker did not start (exit {proc.returncode}): {' '.join(cmd)}\n{err[-4000:]}")


def stop_process(proc: subprocess.Popen[str], timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


@contextlib.contextmanager
def workers(cmds: Sequence[Sequence[str]]) -> Iterator[list[WorkerProcess]]:
    """Start several workers concurrently-ish (each waits for its ready line) and stop them all."""
    started: list[WorkerProcess] = []
    try:
        for cmd in cmds:
            started.append(start_worker(cmd))
        yield started
    finally:
        for w in started:
            w.stop()


def proc_memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak resident) of a process, in KiB, from /proc/<pid>/status."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0])
    return out


def shm_segments() -> set[str]:
    """Every ``ww-`` segment in /dev/shm now."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("ww-")}
    except FileNotFoundError:
        return set()


def segments_of(pids: Iterable[int]) -> set[str]:
    """``ww-<pid>-`` segments created by these processes (the naming rule of core.shm)."""
    prefixes = tuple(f"ww-{pid}-" for pid in pids)
    return {n for n in shm_segments() if n.startswith(prefixes)}


def wait_for(predicate: object, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll ``predicate()`` until true or timeout (for asynchronous cleanup, never for timing)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():  # type: ignore[operator]
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
