"""A store that lies about its sizes does not decide how much a worker allocates: the caller of
JoinTransferGroup names the store, and one that answers the handshake and then claims a 384 MiB
value is refused (GROUP_STORE_UNREACHABLE) within the join's timeout, the worker's peak memory
grows by far less than the claim, and the next honest join and push work.

The hostile store is a real socket server written here. It speaks whichever protocol the member
greets it with: torch's TCPStore (validate and ping answered, then a 384 MiB length for the first
value asked for) or weightwire's own (greeting answered, then a frame that claims 384 MiB). One
`weightwire serve` worker process for the module; the test process is the honest trainer.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch
from helpers import WorkerProcess, error_info, header, pack, push
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
from weightwire.core.manifest import ShardManifest
from weightwire.core.transports.transfer_group import TransferGroup
from weightwire.core.transports.transfer_group_plan import (
    ANNOUNCEMENT_INDEX,
    MemberIdentity,
    message_tag,
    plan_group,
)
from weightwire.core.transports.transfer_group_store import StoreServer
from weightwire.core.transports.whole_messages import announce, last_byte
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

from .common import proc_memory_kib, start_worker

HOST = "127.0.0.1"
NORM = "model.norm.weight"
CLAIM = 384 << 20
JOIN_TIMEOUT_MS = 3000
# Far below the claim, far above what the first join of a fresh worker costs on its own: it loads
# torch.distributed's gloo and starts threads (8.2 MiB of peak seen once on a loaded 2-core host).
MAX_GROWTH_KIB = 64 * 1024
_TORCH_VALIDATE, _TORCH_WAIT, _TORCH_PING = 0, 6, 13


class LyingStore:
    """Accepts members and lies to each about the size of the first value it is asked for, then
    stays silent (the connection open) until closed."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind((HOST, 0))
        self.listener.listen(16)
        self.address = f"{HOST}:{self.listener.getsockname()[1]}"
        self.greetings: list[bytes] = []
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._lie, args=(conn,), daemon=True).start()

    @staticmethod
    def _exactly(conn: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError
            buf += chunk
        return buf

    def _lie(self, conn: socket.socket) -> None:
        try:
            first = self._exactly(conn, 8)
            self.greetings.append(first)
            if first[0] == _TORCH_VALIDATE and first[5] == _TORCH_PING:
                # torch: VALIDATE + magic, then PING + nonce, answered with the nonce.
                conn.sendall(first[6:8] + self._exactly(conn, 2))
                while True:
                    request = conn.recv(65536)
                    if not request:
                        return
                    if request[0] == _TORCH_WAIT:
                        conn.sendall(b"\x00")  # "stop waiting": the key is there
                        continue
                    conn.sendall(struct.pack("<Q", CLAIM))  # a value's length, and no value
                    break
            else:
                # weightwire's store: greet back, then claim a 384 MiB reply frame.
                conn.sendall(first)
                conn.recv(65536)
                conn.sendall(struct.pack(">I", CLAIM))
            while conn.recv(65536):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


@dataclasses.dataclass
class Worker:
    proc: WorkerProcess
    stub: pb_grpc.WeightTransferServiceStub
    manifest: ShardManifest


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    proc = start_worker()
    channel = proc.channel()
    stub = pb_grpc.WeightTransferServiceStub(channel)
    manifest = ShardManifest.from_proto(stub.GetManifest(pb.GetManifestRequest(), timeout=30).manifest)
    yield Worker(proc, stub, manifest)
    channel.close()
    proc.stop()


def _spec(
    manifest: ShardManifest, store_address: str, timeout_ms: int
) -> tuple[pb.TransferGroupSpec, MemberIdentity]:
    trainer = MemberIdentity.of_trainer(0, uuid.uuid4().hex)
    plan = plan_group(
        {"w": manifest},
        trainer=trainer,
        group_id=f"lying-{uuid.uuid4().hex[:12]}",
        backend=pb.TRANSFER_BACKEND_GLOO,
        store_address=store_address,
        timeout_ms=timeout_ms,
        max_bucket_bytes=1 << 20,
        broadcast=False,
    )
    return plan.spec, trainer


def test_a_store_that_claims_a_huge_value_is_refused_without_the_allocation(worker: Worker) -> None:
    proc, stub, manifest = worker.proc, worker.stub, worker.manifest
    liar = LyingStore()
    try:
        before = proc_memory_kib(proc.proc.pid)
        spec, _ = _spec(manifest, liar.address, JOIN_TIMEOUT_MS)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            stub.JoinTransferGroup(pb.JoinTransferGroupRequest(spec=spec), timeout=30)
        took = time.monotonic() - started
        after = proc_memory_kib(proc.proc.pid)
        assert liar.greetings, "the join never reached the lying store"
        growth = after["VmHWM"] - before["VmHWM"]
        assert growth < MAX_GROWTH_KIB, f"the worker's peak memory grew by {growth / 1024:.0f} MiB"
        err = refused.value
        assert error_info(err)[0] == "GROUP_STORE_UNREACHABLE", err.details()  # type: ignore[attr-defined]
        assert took < JOIN_TIMEOUT_MS / 1000 + 2.0, took
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
        assert status.transfer_group.state == pb.TRANSFER_GROUP_STATE_NONE
    finally:
        liar.close()

    # The next honest join forms, and a push over the group lands.
    store = StoreServer(HOST, 0)
    spec, trainer = _spec(manifest, store.address, 60_000)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    try:
        mine = pool.submit(TransferGroup.form, spec, trainer, listen_host=HOST, store=store.store)
        joined = stub.JoinTransferGroup(pb.JoinTransferGroupRequest(spec=spec), timeout=60)
        assert joined.group_rank == 1
        formed = mine.result(timeout=60)
        version = stub.GetStatus(pb.GetStatusRequest(), timeout=30).weights_version + 1
        packed = pack({NORM: full_checkpoint(DemoConfig(), version)[NORM]})
        data = torch.frombuffer(bytearray(packed.data), dtype=torch.uint8)
        handle = pb.TransferGroupHandle(
            group_id=spec.group_id,
            source_rank=0,
            mode=pb.TRANSFER_MODE_POINT_TO_POINT,
            sequence=1,
            ranges=[pb.ByteRange(offset_bytes=0, size_bytes=data.numel())],
        )
        payload = pb.Payload(
            device=manifest.device.to_proto(), size_bytes=data.numel(), transfer_group=handle
        )
        reqs = [
            header(version, scope=pb.UPDATE_SCOPE_PARTIAL),
            pb.PushWeightsRequest(bucket=pb.Bucket(index=0, tensors=list(packed.specs), payloads=[payload])),
            pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=1)),
        ]
        pushed = pool.submit(push, stub, reqs, timeout=60)
        note = announce([(data.numel(), last_byte(data))], data.device)
        for work, what in [
            (formed.send(note, 1, message_tag(1, ANNOUNCEMENT_INDEX)), "announcement"),
            (formed.send(data, 1, message_tag(1, 0)), "message"),
        ]:
            formed.wait(work, what)
        out = pushed.result(timeout=60)
        assert out.code == grpc.StatusCode.OK, (out.code, out.reason, out.message)
        assert out.result is not None and out.result.bytes_received == data.numel()
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
        assert status.weights_version == version
        assert status.state == pb.WORKER_STATE_CONSISTENT
        formed.close()
    finally:
        pool.shutdown()
        store.close()
