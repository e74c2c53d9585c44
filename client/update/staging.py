"""Staging: where a bucket's bytes live until every worker that got it has acked.

``Staging`` keeps one pusher's exporters and their ``StagingPool``s across updates; a pool bounds
the reusable staging buffers of one exporter (double buffering). A ``Job`` is one bucket to send
(its specs, its recipients, and how to stage and export its bytes); the builders here (``packer``,
``flat_exporter_job``, ``gathered_job``) make the ``prepare`` step of each entry point's jobs
(``weightwire.client.update.jobs``), which ``weightwire.client.update.session`` calls in order while it streams.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from weightwire.client.inputs import plan as planning
from weightwire.client.inputs.plan import PlanError, TensorSpec
from weightwire.client.transports import exporter as exp
from weightwire.client.transports.cuda_ipc import CudaIpcExporter
from weightwire.client.transports.route import ExportedRoute, PerWorkerRoute, Route
from weightwire.core.errors import Reason
from weightwire.core.transports import table as transports
from weightwire.v1 import weight_transfer_pb2 as pb


class Stopped(Exception):
    """The update failed elsewhere while this thread waited for a staging buffer."""


class StagingPool:
    """At most ``depth`` reusable staging buffers of one exporter (depth 2 = double buffering).

    A buffer big enough is reused; when none is free and the pool is full, the caller waits for a
    release; a free buffer that is too small is replaced by a bigger one (a tensor larger than a
    bucket), so memory stays bounded by ``depth`` x the largest bucket.
    """

    def __init__(self, exporter: exp.Exporter, bucket_bytes: int, depth: int = 2) -> None:
        self.exporter = exporter
        self.bucket_bytes = bucket_bytes
        self.depth = depth
        self._free: list[exp.StagingBuffer] = []
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, nbytes: int, stopped: Callable[[], bool], deadline: float) -> exp.StagingBuffer:
        with self._cond:
            while True:
                if stopped():
                    raise Stopped
                if self._closed:
                    raise RuntimeError("the pusher is closed")
                fits = [b for b in self._free if b.capacity_bytes >= nbytes]
                if fits:
                    buf = min(fits, key=lambda b: b.capacity_bytes)
                    self._free.remove(buf)
                    return buf
                if self._count < self.depth:
                    self._count += 1
                    break
                if self._free:
                    self._free.pop().close()
                    self._count -= 1
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        "no staging buffer came free before the deadline (workers did not ack)"
                    )
                self._cond.wait(min(remaining, 1.0))
        try:
            return self.exporter.allocate(max(nbytes, self.bucket_bytes))
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify_all()
            raise

    def release(self, buf: exp.StagingBuffer) -> None:
        with self._cond:
            if self._closed:
                buf.close()
            else:
                self._free.append(buf)
            self._cond.notify_all()

    def discard(self, buf: exp.StagingBuffer) -> None:
        """Drop a buffer a cancelled worker might still read: never hand it out again."""
        buf.close()
        with self._cond:
            self._count -= 1
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            free, self._free = self._free, []
            self._cond.notify_all()
        for buf in free:
            buf.close()


class Staging:
    """One pusher's exporters (one per transport and source device) and their staging pools, kept
    across updates so segments and device buffers are reused; plus the caller's ``host_buffer``s."""

    def __init__(
        self,
        bucket_size_bytes: int,
        pipeline_depth: int,
        *,
        bucket_size_given: bool = True,
        fresh_pool_bytes: int | None = None,
    ) -> None:
        self.bucket_size_bytes = bucket_size_bytes
        # The CUDA IPC exporters' fresh-tensor pool bound (``CudaIpcExporter.pool_limit_bytes``).
        self.fresh_pool_bytes = fresh_pool_bytes
        self.pipeline_depth = pipeline_depth
        # False: the caller left the bucket size to the pusher, and ``push`` packs GPU buckets of
        # ``plan.DEFAULT_CUDA_BUCKET_BYTES`` (a host transport keeps ``bucket_size_bytes``).
        self.bucket_size_given = bucket_size_given
        self._exporters: dict[str, exp.Exporter] = {}
        self._pools: dict[str, StagingPool] = {}
        self._user_buffers: list[exp.StagingBuffer] = []

    def exporter(self, name: str, source: torch.device) -> exp.Exporter:
        row = transports.by_name(name)
        key = f"{name}:{source}" if row is not None and row.per_source_device else name
        if key not in self._exporters:
            exporter = exp.make_exporter(name, source)
            if isinstance(exporter, CudaIpcExporter):
                exporter.pool_limit_bytes = self.fresh_pool_bytes
            self._exporters[key] = exporter
        return self._exporters[key]

    def add_exporter(self, exporter: exp.Exporter) -> None:
        """Use ``exporter`` for its transport from now on (an exporter bound to something of the
        pusher's, such as its transfer group, instead of one the transport table makes)."""
        self._exporters[exporter.name] = exporter

    def pool(self, exporter: exp.Exporter, bucket_bytes: int | None = None) -> StagingPool:
        """The pool of ``exporter``'s staging buffers of ``bucket_bytes`` (default: the pusher's bucket size)."""
        size = self.bucket_size_bytes if bucket_bytes is None else bucket_bytes
        key = next(k for k, v in self._exporters.items() if v is exporter)
        pool = self._pools.get(key)
        if pool is None or pool.bucket_bytes != size:
            if pool is not None:
                pool.close()
            pool = self._pools[key] = StagingPool(exporter, size, self.pipeline_depth)
        return pool

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        seg = self.exporter(transports.HOST_SHM.name, torch.device("cpu")).allocate(nbytes)
        self._user_buffers.append(seg)
        return seg.tensor()[:nbytes]

    def local_exporter(self, device: torch.device) -> exp.Exporter:
        """The exporter of a caller's own buffer on ``device``, labelled with that device."""
        return self.exporter(transports.for_local_buffer(device.type).name, device)

    def export_in_place(self, raw: torch.Tensor, size_bytes: int | None) -> pb.Payload:
        """``raw`` (a flat uint8 tensor) exported without a copy as a payload labelled with its device."""
        exporter = self.local_exporter(raw.device)
        staged = exporter.wrap(raw)
        if staged is None or exporter.label is None:
            raise PlanError(
                Reason.HANDLE_MISSING,
                "export_payload needs a buffer from WeightPusher.host_buffer (CPU) or a CUDA tensor",
            )
        if staged.base_offset_bytes:
            raise PlanError(
                Reason.INVALID_OFFSET,
                "export_payload needs a buffer that starts at its allocation's first byte",
            )
        staged.ready()
        size = raw.numel() if size_bytes is None else int(size_bytes)
        return exporter.export(staged, size, exporter.label)

    def close_user_buffers(self) -> None:
        for buf in self._user_buffers:
            buf.close()
        self._user_buffers.clear()

    def close(self) -> None:
        """Close every pool, then every exporter (which unlinks what it still owns). Idempotent."""
        for pool in self._pools.values():
            pool.close()
        for exporter in self._exporters.values():
            exporter.close()


def crc32_checksum(value: int) -> pb.Checksum:
    return pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32, value=value)


def export_staged(
    exporter: exp.Exporter,
    buf: exp.StagingBuffer,
    size: int,
    verify: bool,
    release: Callable[[bool], None],
    base_offset_bytes: int = 0,
) -> ExportedRoute:
    buf.ready()
    checksum = crc32_checksum(buf.crc32(size)) if verify else None
    label = exporter.label
    if label is not None:
        return ExportedRoute(
            (exporter.export(buf, size, label),),
            checksum=checksum,
            releaser=release,
            base_offset_bytes=base_offset_bytes,
            staged=buf,
        )
    return ExportedRoute(
        (),
        lambda dev: exporter.export(buf, size, dev),
        checksum=checksum,
        releaser=release,
        base_offset_bytes=base_offset_bytes,
        staged=buf,
    )


def pool_release(pool: StagingPool, buf: exp.StagingBuffer) -> Callable[[bool], None]:
    def release(ok: bool) -> None:
        if ok:
            pool.release(buf)
        else:
            pool.discard(buf)

    return release


def packer(
    pool: StagingPool,
    exporter: exp.Exporter,
    plan: planning.BucketPlan,
    tensors: list[torch.Tensor],
    verify: bool,
) -> Callable[[Callable[[], bool], float], Route]:
    def prepare(stopped: Callable[[], bool], deadline: float) -> Route:
        buf = pool.acquire(plan.size_bytes, stopped, deadline)
        try:
            planning.pack_into(buf.tensor(), plan.specs, tensors)
            return export_staged(exporter, buf, plan.size_bytes, verify, pool_release(pool, buf))
        except BaseException:
            pool.discard(buf)
            raise

    return prepare


@runtime_checkable
class PacksTensors(Protocol):
    """An export of tensors where they live that packs some of them first (the CUDA IPC exporter's
    fresh-tensor pool): ``pack`` copies them on the current stream before the payload's event is
    recorded; ``discard`` after a failed push, whose workers may still read what was packed."""

    def pack(self, tensors: Sequence[torch.Tensor]) -> None: ...

    def discard(self) -> None: ...


def in_place_job(
    exporter: exp.Exporter, exported: object, complete: bool, tensors: Sequence[torch.Tensor] = ()
) -> Callable[[Callable[[], bool], float], Route]:
    """A bucket of the caller's own CUDA tensors, exported where they live (``CudaIpcExporter.
    export_tensors``), the fresh ones among them packed into the exporter's pool first: nothing
    else staged; each worker's payload names its own shares of the storages and carries the event
    of the writes queued so far, the packing included (or this waits for them)."""
    packer = exported if isinstance(exported, PacksTensors) else None

    def release(ok: bool) -> None:
        if not ok and packer is not None:
            packer.discard()

    def prepare(stopped: Callable[[], bool], deadline: float) -> Route:
        if packer is not None:
            packer.pack(tensors)
        payloads = exporter.tensors_payloads(exported, complete=complete)
        return PerWorkerRoute(payloads, releaser=release)

    return prepare


def stage_flat(
    pool: StagingPool,
    exporter: exp.Exporter,
    flat: torch.Tensor,
    stopped: Callable[[], bool],
    deadline: float,
) -> tuple[exp.StagingBuffer, Callable[[bool], None]]:
    """``flat`` exported in place, or copied once into a pooled staging buffer."""
    wrapped = exporter.wrap(flat)
    if wrapped is not None:
        return wrapped, lambda ok: None
    buf = pool.acquire(flat.numel(), stopped, deadline)
    try:
        buf.tensor()[: flat.numel()].copy_(flat)
    except BaseException:
        pool.discard(buf)
        raise
    return buf, pool_release(pool, buf)


def flat_exporter_job(
    pool: StagingPool, exporter: exp.Exporter, flat: torch.Tensor, specs: list[TensorSpec], verify: bool
) -> Callable[[Callable[[], bool], float], Route]:
    def prepare(stopped: Callable[[], bool], deadline: float) -> Route:
        buf, release = stage_flat(pool, exporter, flat, stopped, deadline)
        base = buf.base_offset_bytes
        return export_staged(exporter, buf, base + flat.numel(), verify, release, base_offset_bytes=base)

    return prepare


def gathered_job(
    fixed: list[pb.Payload],
    local: list[tuple[StagingPool, tuple[exp.Exporter, torch.Tensor]]],
    size: int,
    verify: bool,
) -> Callable[[Callable[[], bool], float], Route]:
    def prepare(stopped: Callable[[], bool], deadline: float) -> Route:
        payloads = list(fixed)
        releases: list[Callable[[bool], None]] = []
        checksum: pb.Checksum | None = None
        try:
            for pool, (exporter, flat) in local:
                buf, release = stage_flat(pool, exporter, flat[:size], stopped, deadline)
                releases.append(release)
                buf.ready()
                if buf.base_offset_bytes:
                    raise PlanError(
                        Reason.INVALID_OFFSET,
                        "a gathered local buffer must start at the beginning of its shared-memory buffer "
                        "(all payloads of a bucket share one layout)",
                    )
                label = exporter.label
                if label is None:
                    raise PlanError(
                        Reason.PAYLOAD_LABEL_MISSING,
                        f"transport {exporter.name} cannot label a local payload",
                    )
                payloads.append(exporter.export(buf, size, label))
                if verify and checksum is None:
                    checksum = crc32_checksum(buf.crc32(size))
        except BaseException:
            for r in releases:
                r(False)
            raise
        if verify and checksum is None:
            inline = next(
                (p.inline_data for p in fixed if p.WhichOneof("handle") == transports.INLINE.handle_field),
                None,
            )
            if inline is not None:
                checksum = crc32_checksum(
                    exp.crc32_of(torch.frombuffer(bytearray(inline[:size]), dtype=torch.uint8))
                )

        def release_all(ok: bool) -> None:
            for r in releases:
                r(ok)

        return ExportedRoute(tuple(payloads), checksum=checksum, releaser=release_all)

    return prepare
