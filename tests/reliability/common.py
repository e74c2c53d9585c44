"""Shared pieces of the reliability tests: raw-stub pushes with the exact ErrorInfo count, worker
processes (through ``tests/helpers.py``), shared-memory bookkeeping and /proc readings.

Raw pushes talk to workers the way an arbitrary client would (generated stubs, no weightwire client
code), so the tests see exactly what the wire carries.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model
from weightwire.core.devices import DeviceRef
from weightwire.core.errors import ERROR_DOMAIN, Reason
from weightwire.core.manifest import ParallelRank
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

from . import helpers

SHM_DIR = "/dev/shm"
RPC_TIMEOUT_S = 60.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Filled by the adversarial tests (kind of case -> examples run); printed at the end of the session.
CASES_RUN: collections.Counter[str] = collections.Counter()
# Filled by the load tests (one summary line per run); printed at the end of the session.
LOAD_REPORTS: list[str] = []
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
    whole: bool = False,
) -> Outcome:
    """Send a request stream and collect every response and the final status (never raises RpcError).
    With ``whole``, the same messages go as one PushUpdate call (a failed call has no responses)."""
    responses: list[pb.PushWeightsResponse] = []
    if whole:
        try:
            reply = stub.PushUpdate(
                pb.PushUpdateRequest(messages=list(requests)), timeout=timeout, metadata=metadata
            )
        except grpc.RpcError as err:
            return failed_outcome(err)
        return Outcome(list(reply.messages), grpc.StatusCode.OK, "", None, 0)
    call = stub.PushWeights(iter(list(requests)), timeout=timeout, metadata=metadata)
    try:
        for resp in call:
            responses.append(resp)
    except grpc.RpcError as err:
        return failed_outcome(err, responses)
    return Outcome(responses, grpc.StatusCode.OK, "", None, 0)


def failed_outcome(err: grpc.RpcError, responses: Sequence[pb.PushWeightsResponse] = ()) -> Outcome:
    """The Outcome of a stream that ended with ``err`` after ``responses``."""
    info, n = error_info(err)
    return Outcome(list(responses), err.code(), err.details() or "", info, n)  # type: ignore[attr-defined]


def assert_weightwire_error(outcome: Outcome, reasons: Iterable[str] | str) -> str:
    """The status carries exactly one ErrorInfo of our domain whose reason is expected and whose
    code is the one the reason table gives; returns the reason."""
    want = {reasons} if isinstance(reasons, str) else set(reasons)
    assert outcome.code != grpc.StatusCode.OK, f"expected {sorted(want)}, got success: {outcome.describe()}"
    assert outcome.info is not None and outcome.error_infos == 1, f"no single ErrorInfo: {outcome.describe()}"
    assert outcome.info.domain == ERROR_DOMAIN, outcome.describe()
    assert outcome.info.reason in want, f"expected {sorted(want)}, got {outcome.describe()}"
    assert outcome.code.name == Reason[outcome.info.reason].code, (
        f"code does not match reason: {outcome.describe()}"
    )
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
# Updates, workers and /proc
# ---------------------------------------------------------------------------------------------


def inline_update(
    named: Mapping[str, torch.Tensor], version: int, **header_kw: object
) -> list[pb.PushWeightsRequest]:
    """A complete valid update in one inline bucket (header, bucket, commit)."""
    return helpers.full_update_requests(version, named, None, buckets=1, **header_kw)


def demo_adapter(seed: int = 0) -> TorchAdapter:
    """The demo model (one rank, CPU) behind the torch adapter, as `weightwire serve` builds it."""
    config = DemoConfig()
    rank = ParallelRank()
    return TorchAdapter(
        build_demo_model(config, rank, "cpu", seed),
        rank=rank,
        device=torch.device("cpu"),
        own_device=DeviceRef.host(),
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
    )


# ---------------------------------------------------------------------------------------------
# Worker processes (`weightwire serve`) and /proc
# ---------------------------------------------------------------------------------------------


def serve_args(
    *,
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
    listen: str | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`weightwire serve` arguments of a CPU demo worker (helpers.demo_args plus the device)."""
    return helpers.demo_args(
        tp=tp, pp=pp, listen=listen, dump_dir=dump_dir, extra=["--device", "cpu", *extra]
    )


def serve_command(**kw: Any) -> list[str]:
    return helpers.serve_command(*serve_args(**kw))


def start_worker(**kw: Any) -> helpers.WorkerProcess:
    return helpers.spawn_worker(*serve_args(**kw), timeout=120.0)


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


wait_until = helpers.wait_until
