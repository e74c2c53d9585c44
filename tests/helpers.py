"""Shared test helpers: spawn a real ``weightwire serve`` process, build raw PushWeights requests from
the generated stubs (not the client library), make shared-memory payloads, read statuses back.

Used by tests/server and by other test suites that need a real worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from multiprocessing import shared_memory
from typing import Any

import grpc
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ParallelRank, ShardManifest
from weightwire.core.transports.shm import new_shm_name
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

LISTENING_PREFIX = "weightwire-serve listening "
ALIGN = 64

# ---------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class WorkerProcess:
    """A ``weightwire serve`` subprocess; ``address`` is the gRPC target it printed."""

    proc: subprocess.Popen[str]
    address: str
    args: list[str]
    stderr_lines: list[str]

    def channel(self, **kw: Any) -> grpc.Channel:
        return grpc.insecure_channel(self.address, **kw)

    def stub(self) -> pb_grpc.WeightTransferServiceStub:
        return pb_grpc.WeightTransferServiceStub(self.channel())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the worker and wait for it; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def stderr_text(self) -> str:
        return "".join(self.stderr_lines)


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "weightwire.client.cli.main", "serve", *args]


def spawn_worker(
    *args: str,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    command: Sequence[str] | None = None,
) -> WorkerProcess:
    """Start ``weightwire serve ARGS`` (or ``command``: a test's own worker script that prints the same
    ``listening`` line) and wait for its ``listening`` line (raises if it dies first)."""
    cmd = list(command) if command is not None else serve_command(*args)
    proc_env = dict(os.environ)
    proc_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        proc_env.update(env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=proc_env)
    stderr_lines: list[str] = []
    lines: queue.Queue[str | None] = queue.Queue()

    def pump_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def pump_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            stderr_lines.append(line)

    threading.Thread(target=pump_stdout, daemon=True).start()
    threading.Thread(target=pump_stderr, daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"worker did not report listening within {timeout}s: {cmd}\n{''.join(stderr_lines)}"
            ) from None
        if line is None:
            proc.wait()
            raise RuntimeError(
                f"worker exited with {proc.returncode} before listening: {cmd}\n{''.join(stderr_lines)}"
            )
        if line.startswith(LISTENING_PREFIX):
            return WorkerProcess(proc, line[len(LISTENING_PREFIX) :].strip(), cmd, stderr_lines)


def spawn_workers(arg_lists: Sequence[Sequence[str]], timeout: float = 90.0) -> list[WorkerProcess]:
    """Start several workers at once (their imports overlap) and wait until all listen."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(arg_lists))) as pool:
        futures = [pool.submit(spawn_worker, *args, timeout=timeout) for args in arg_lists]
    workers, errors = [], []
    for f in futures:
        try:
            workers.append(f.result())
        except Exception as e:
            errors.append(e)
    if errors:
        for w in workers:
            w.stop()
        raise errors[0]
    return workers


def demo_args(
    *,
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
    seed: int = 0,
    listen: str | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """Arguments of ``weightwire serve`` for a demo worker of rank (tp, pp)."""
    args = [
        "--model",
        "demo",
        "--tp-rank",
        str(tp[0]),
        "--tp-size",
        str(tp[1]),
        "--pp-rank",
        str(pp[0]),
        "--pp-size",
        str(pp[1]),
        "--seed",
        str(seed),
        "--log-level",
        "WARNING",
    ]
    if listen:
        args += ["--listen", listen]
    if dump_dir is not None:
        args += ["--dump-dir", str(dump_dir)]
    return [*args, *extra]


def load_dump(dump_dir: str | os.PathLike[str], worker_id: str, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(str(dump_dir), f"{worker_id}-v{version}.safetensors"))


# ---------------------------------------------------------------------------------------------
# Shared memory and packing
# ---------------------------------------------------------------------------------------------


class ShmSegments:
    """Creates ``ww-`` shared-memory segments for a test and unlinks them all on ``close``."""

    def __init__(self) -> None:
        self.segments: list[shared_memory.SharedMemory] = []

    def create(
        self, data: bytes | bytearray | memoryview, *, size: int | None = None, name: str | None = None
    ) -> shared_memory.SharedMemory:
        size = max(size if size is not None else len(data), 1)
        seg = shared_memory.SharedMemory(name=name or new_shm_name("test"), create=True, size=size)
        n = min(len(data), size)
        seg.buf[:n] = bytes(data[:n])
        self.segments.append(seg)
        return seg

    def close(self) -> None:
        for seg in self.segments:
            with contextlib.suppress(Exception):
                seg.close()
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()
        self.segments.clear()


@dataclasses.dataclass
class Packed:
    """Tensors packed into one row-major buffer with their specs (the layout of one bucket)."""

    data: bytearray
    specs: list[pb.TensorSpec]


def pack(
    named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], align: int = ALIGN
) -> Packed:
    items = list(named.items()) if isinstance(named, Mapping) else list(named)
    specs: list[pb.TensorSpec] = []
    chunks: list[tuple[int, bytes]] = []
    offset = 0
    for name, t in items:
        offset = (offset + align - 1) // align * align
        raw = t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        specs.append(
            pb.TensorSpec(
                name=name, dtype=dtypes.from_torch(t.dtype), shape=list(t.shape), offset_bytes=offset
            )
        )  # type: ignore[arg-type]
        chunks.append((offset, raw))
        offset += len(raw)
    data = bytearray(offset)
    for off, raw in chunks:
        data[off : off + len(raw)] = raw
    return Packed(data, specs)


def split_buckets(named: Mapping[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Round-robin split into ``n`` non-empty buckets (fewer if there are fewer tensors)."""
    names = list(named)
    groups = [names[i::n] for i in range(n)]
    return [{k: named[k] for k in g} for g in groups if g]


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


def host_device() -> pb.DeviceId:
    return DeviceRef.host().to_proto()


def header(version: int, *, scope: int = pb.UPDATE_SCOPE_FULL, **kw: Any) -> pb.PushWeightsRequest:
    return pb.PushWeightsRequest(header=pb.UpdateHeader(version=version, scope=scope, **kw))  # type: ignore[arg-type]


def shm_payload(
    seg: shared_memory.SharedMemory | str, size_bytes: int, device: pb.DeviceId | None = None
) -> pb.Payload:
    name = seg if isinstance(seg, str) else seg.name
    return pb.Payload(
        device=device if device is not None else host_device(),
        size_bytes=size_bytes,
        host_shm=pb.HostShmHandle(name=name),
    )


def inline_payload(
    data: bytes | bytearray, device: pb.DeviceId | None = None, size_bytes: int | None = None
) -> pb.Payload:
    return pb.Payload(
        device=device if device is not None else host_device(),
        size_bytes=len(data) if size_bytes is None else size_bytes,
        inline_data=bytes(data),
    )


def bucket(
    index: int, specs: Sequence[pb.TensorSpec], payloads: Sequence[pb.Payload], **kw: Any
) -> pb.PushWeightsRequest:
    return pb.PushWeightsRequest(
        bucket=pb.Bucket(index=index, tensors=list(specs), payloads=list(payloads), **kw)
    )


def commit(bucket_count: int) -> pb.PushWeightsRequest:
    return pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=bucket_count))


def full_update_requests(
    version: int,
    named: Mapping[str, torch.Tensor],
    segments: ShmSegments | None,
    *,
    buckets: int = 2,
    **header_kw: Any,
) -> list[pb.PushWeightsRequest]:
    """A complete update: header, ``buckets`` buckets (shm if ``segments`` else inline), commit."""
    reqs = [header(version, **header_kw)]
    groups = split_buckets(named, buckets)
    for i, group in enumerate(groups):
        packed = pack(group)
        if segments is not None:
            seg = segments.create(packed.data)
            payload = shm_payload(seg, len(packed.data))
        else:
            payload = inline_payload(packed.data)
        reqs.append(bucket(i, packed.specs, [payload]))
    reqs.append(commit(len(groups)))
    return reqs


def sparse_step(old: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """About 1% of every tensor's elements set to new random values (enough to change an engine's
    tokens), the rest as in ``old``; the delta tests' weights after one step."""
    gen = torch.Generator().manual_seed(seed)
    new = {}
    for name, t in old.items():
        flat = t.clone().view(-1)
        mask = torch.rand(flat.numel(), generator=gen) < 0.01
        flat[mask] = torch.randn(int(mask.sum()), generator=gen, dtype=t.dtype)
        new[name] = flat.view(t.shape)
    return new


def delta_update_requests(
    manifests: Iterable[ShardManifest], name: str, old: torch.Tensor, new: torch.Tensor, base: int
) -> list[pb.PushWeightsRequest]:
    """A PARTIAL delta update (version ``base + 1``) of ``name`` from ``old`` to ``new``, inline,
    with the CRC-32 result checksum of every part the workers of ``manifests`` keep of it."""
    from weightwire.core.delta import checksum, encode, pack_delta, packed_size_bytes

    delta = encode(old, new)
    buffer = torch.zeros(packed_size_bytes(delta, 0), dtype=torch.uint8)
    sums = []
    for m in manifests:
        pieces = m.tensors[name].pieces
        for p in pieces or [None]:
            value = new if p is None else new.narrow(p.dim, p.offset, p.length)
            msg = pb.DeltaChecksum(
                checksum=pb.Checksum(
                    algorithm=pb.CHECKSUM_ALGORITHM_CRC32, value=checksum(value, pb.CHECKSUM_ALGORITHM_CRC32)
                )
            )
            if p is not None:
                msg.piece.CopyFrom(pb.TensorPiece(dim=p.dim, offset=p.offset, length=p.length))
            sums.append(msg)
    spec = pb.TensorSpec(
        name=name,
        dtype=dtypes.from_torch(new.dtype),
        shape=list(new.shape),
        offset_bytes=0,
        delta=pack_delta(delta, buffer, 0, sums),
    )
    return [
        header(base + 1, scope=pb.UPDATE_SCOPE_PARTIAL, delta_base=pb.DeltaBase(base_version=base)),
        bucket(0, [spec], [inline_payload(buffer.numpy().tobytes())]),
        commit(1),
    ]


# ---------------------------------------------------------------------------------------------
# Calls and statuses
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PushOutcome:
    responses: list[pb.PushWeightsResponse]
    code: grpc.StatusCode
    message: str = ""
    reason: str = ""
    domain: str = ""
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def acks(self) -> list[pb.BucketAck]:
        return [r.ack for r in self.responses if r.WhichOneof("message") == "ack"]

    @property
    def result(self) -> pb.UpdateResult | None:
        results = [r.result for r in self.responses if r.WhichOneof("message") == "result"]
        return results[-1] if results else None


def error_info(err: grpc.RpcError) -> tuple[str, str, dict[str, str]]:
    """(reason, domain, metadata) of the one ErrorInfo in a failed call's status details."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None:
        return "", "", {}
    infos = []
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            infos.append(info)
    if len(infos) != 1:
        return "", "", {}
    return infos[0].reason, infos[0].domain, dict(infos[0].metadata)


def push(
    stub: pb_grpc.WeightTransferServiceStub,
    requests: Iterable[pb.PushWeightsRequest],
    *,
    metadata: Sequence[tuple[str, str]] | None = None,
    timeout: float = 60.0,
    whole: bool = False,
) -> PushOutcome:
    """Run one PushWeights stream to its end and collect responses and the final status. With
    ``whole``, send the same messages as one PushUpdate call instead (a failed call has no responses)."""
    responses: list[pb.PushWeightsResponse] = []
    try:
        if whole:
            responses.extend(
                stub.PushUpdate(
                    pb.PushUpdateRequest(messages=list(requests)), metadata=metadata, timeout=timeout
                ).messages
            )
        else:
            for resp in stub.PushWeights(iter(list(requests)), metadata=metadata, timeout=timeout):
                responses.append(resp)
    except grpc.RpcError as err:
        reason, domain, md = error_info(err)
        return PushOutcome(responses, err.code(), err.details() or "", reason, domain, md)  # type: ignore[attr-defined]
    return PushOutcome(responses, grpc.StatusCode.OK)


def unary_error(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """Run a unary call expected to fail: (code, reason, metadata)."""
    try:
        call()
    except grpc.RpcError as err:
        reason, _, md = error_info(err)
        return err.code(), reason, md  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, "", {}


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The ``env://`` variables of trainer rank ``rank`` of a world on loopback whose rank 0 serves
    the store on ``port`` (for ``init_process_group`` in a process a test starts)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until true; False if it never became true (tests then fail on the state)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class RequestFeed:
    """A request iterator the test feeds message by message (to interleave with acks and status)."""

    _END = object()

    def __init__(self) -> None:
        self._q: queue.Queue[object] = queue.Queue()

    def send(self, req: pb.PushWeightsRequest) -> None:
        self._q.put(req)

    def end(self) -> None:
        self._q.put(self._END)

    def __iter__(self) -> Iterator[pb.PushWeightsRequest]:
        while True:
            item = self._q.get()
            if item is self._END:
                return
            yield item  # type: ignore[misc]


@dataclasses.dataclass
class InProcessWorker:
    """A real gRPC worker server running in the test process, with the demo model."""

    server: object  # weightwire.server.RunningServer
    adapter: TorchAdapter
    rank: ParallelRank
    config: DemoConfig

    @property
    def address(self) -> str:
        return self.server.address  # type: ignore[attr-defined]

    @property
    def service(self) -> object:
        return self.server.service  # type: ignore[attr-defined]

    def stub(self) -> pb_grpc.WeightTransferServiceStub:
        import grpc

        return pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(self.address))

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.adapter.state().items()}


def delta_algorithms_sent(pusher: Any) -> list[int]:
    """A spy on a ``WeightPusher``'s delta keeper: the result checksum algorithm of each delta update
    it computes, in order (a FULL update computes none)."""
    keeper = pusher.delta_keeper
    seen: list[int] = []
    update_all = keeper.update_all

    def spied(items: Any, algorithm: int) -> Any:
        seen.append(algorithm)
        return update_all(items, algorithm)

    keeper.update_all = spied
    return seen


def start_demo_worker(
    rank: ParallelRank | None = None, *, seed: int = 0, **serve_kw: object
) -> InProcessWorker:
    from weightwire.server import serve

    rank = rank or ParallelRank()
    config = DemoConfig()
    model = build_demo_model(config, rank, "cpu", seed)
    adapter = TorchAdapter(
        model,
        rank=rank,
        device=torch.device("cpu"),
        own_device=None,
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
    )
    server = serve(adapter, **serve_kw)  # type: ignore[arg-type]
    return InProcessWorker(server, adapter, rank, config)


# --- every trainer rank a source: trainer ranks of one gloo world, each its own process --------------

SLICE_RANK_DIED_EXIT_CODE = 3


class TrainerRanks:
    """``world`` processes of ``python script *args`` as the ranks of one gloo world (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT set; tests/ on PYTHONPATH), each answering one JSON line per
    command line; ``script`` runs ``slice_trainer_main``. Used by the engine suites' slices tests."""

    def __init__(
        self, script: str, args: Sequence[str], *, world: int = 2, drop_env: Sequence[str] = ()
    ) -> None:
        from ports import free_port

        port = free_port()
        tests = os.path.dirname(os.path.abspath(__file__))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p),
        }
        for key in drop_env:
            env.pop(key, None)
        self.procs = [
            subprocess.Popen(
                [sys.executable, os.path.abspath(script), *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=os.path.dirname(os.path.abspath(script)),
                env={**env, **rank_env(r, world, port)},
            )
            for r in range(world)
        ]
        for r in range(world):
            assert self.read(r).get("ready"), r

    def read(self, rank: int) -> dict[str, Any]:
        out = self.procs[rank].stdout
        assert out is not None
        while True:
            line = out.readline()
            if not line:
                err = self.procs[rank].stderr
                raise RuntimeError(f"trainer rank {rank} ended: {err.read()[-3000:] if err else ''}")
            if line.startswith("{"):
                return json.loads(line)  # type: ignore[no-any-return]

    def send(self, rank: int, text: str) -> None:
        stdin = self.procs[rank].stdin
        assert stdin is not None
        stdin.write(text + "\n")
        stdin.flush()

    def push(self, **cmd: Any) -> list[dict[str, Any]]:
        """Every rank pushes (``slice_trainer_main``'s push command); their answers, by rank."""
        for r in range(len(self.procs)):
            self.send(r, json.dumps({"op": "push", **cmd}))
        return [self.read(r) for r in range(len(self.procs))]

    def close(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    self.send(r, json.dumps({"op": "quit"}))
        for p in self.procs:
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()


class DiesAtItsFirstData:
    """A trainer rank's process group, until the rank's first data message: its announcements go
    out (so every worker starts receiving, and lands the other ranks' bytes), then the process
    exits with ``SLICE_RANK_DIED_EXIT_CODE`` (a send to a peer already sent to is a message)."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg
        self._announced: set[int] = set()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        if dst in self._announced:
            time.sleep(2)  # the other rank's messages arrive meanwhile
            os._exit(SLICE_RANK_DIED_EXIT_CODE)  # lost mid-push: no cleanup, like a crash
        self._announced.add(dst)
        work = self._pg.send(tensors, dst, tag)
        work.wait()
        return work

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)


def slice_trainer_main(
    addresses: list[str],
    checkpoint: Callable[[int], Mapping[str, torch.Tensor]],
    bucket_size_bytes: int | None = None,
) -> int:
    """One trainer rank of ``TrainerRanks``: a ``WeightPusher`` over a transfer group on loopback to
    ``addresses`` (with ``bucket_size_bytes`` when given: each worker's part then comes as buckets
    of at most that); reads one JSON command a line, answers one JSON line:
    {"op": "push", "version": V, "seed": S, "single": bool, "pause": bool, "sparse": [seed...],
    "delta": bool} pushes ``checkpoint(S)`` after ``sparse_step`` with each of ``sparse`` in turn,
    as DTensor shards of one ``Shard(0)`` mesh over the world (every rank a source), or with
    ``single`` as plain tensors from rank 0 alone, with ``delta`` as ``push(..., delta=True)``;
    with ``pause`` it prints {"paused": true} right
    before this rank's sends and waits for "go", or "die": send the announcements, then exit with
    ``SLICE_RANK_DIED_EXIT_CODE`` at the first data message, once the other rank's bytes reached the
    workers. {"op": "quit"} ends it."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from weightwire.client import PushError, WeightPusher, WeightwireError
    from weightwire.client.ranks import slice_push
    from weightwire.client.transports.transfer_group import TransferGroupOptions

    real_send = slice_push.send_slices
    pause = [False]

    def paused_send(pg: Any, *args: Any, **kwargs: Any) -> int:
        if pause[0]:
            print(json.dumps({"paused": True}), flush=True)
            if sys.stdin.readline().strip() == "die":
                pg = DiesAtItsFirstData(pg)
        return real_send(pg, *args, **kwargs)

    slice_push.send_slices = paused_send  # type: ignore[assignment]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    pusher = WeightPusher(
        addresses,
        transfer_group=TransferGroupOptions(host="127.0.0.1", timeout_s=20),
        timeout_s=60,
        bucket_size_bytes=bucket_size_bytes,
    )
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            full = checkpoint(int(cmd["seed"]))
            for step in cmd.get("sparse", ()):
                full = sparse_step(full, int(step))
            if cmd.get("single"):
                if dist.get_rank() != 0:
                    print(json.dumps({"ok": True}), flush=True)
                    continue
                tensors: Mapping[str, Any] = full
            else:
                tensors = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
            pause[0] = bool(cmd.get("pause"))
            try:
                results = pusher.push(tensors, version=int(cmd["version"]), delta=bool(cmd.get("delta")))
                answer = {"ok": True, "results": {a: dataclasses.asdict(r) for a, r in results.items()}}
            except (PushError, WeightwireError) as e:
                failures = getattr(e, "failures", {})
                answer = {
                    "ok": False,
                    "reason": getattr(e, "reason", "PUSH_FAILED"),
                    "message": str(e)[:3000],
                    "failures": {
                        a: {"reason": f.reason, "message": f.message[:1000]} for a, f in failures.items()
                    },
                }
            finally:
                pause[0] = False
            print(json.dumps(answer), flush=True)
    finally:
        pusher.close()
        dist.destroy_process_group()
    return 0
