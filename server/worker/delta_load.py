"""The deltas of one update on a worker: a bucket's delta specs read and checked whole, batch by
batch, before anything of the batch is written, then applied by the adapter (``AppliesDeltas``) and
each kept part verified against the trainer's result checksum; the counts the result reports.

A batch's tensors are verified on ``delta_threads()`` threads (the CRCs release the GIL), each
tensor on one, and a mismatch is raised for the first tensor in the batch's order that has one."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import torch
from weightwire.core.delta import Delta, check_delta, read_delta, verify_result
from weightwire.core.delta.threads import delta_threads
from weightwire.core.errors import Reason, WeightwireError
from weightwire.server.rules.layout import BucketLayout
from weightwire.server.rules.validation import CheckedSpec
from weightwire.server.rules.views import ReadBatch, batch_views
from weightwire.server.transports.importer import ImportedPayload
from weightwire.server.worker.adapter import AppliesDeltas, EngineAdapter
from weightwire.v1 import weight_transfer_pb2 as pb


class DeltaLoads:
    """What one update's delta buckets did: tensors applied, elements changed, checksums verified."""

    def __init__(self) -> None:
        self.tensors = 0
        self.changed_elements = 0
        self.checksums_verified = 0

    def load(
        self,
        index: int,
        layout: BucketLayout,
        mapping: ImportedPayload,
        engine: EngineAdapter,
        *,
        will_write: Callable[[], None],
    ) -> None:
        """A bucket of this worker's deltas (and perhaps whole tensors), batch by batch; ``will_write``
        is called once a batch passed its checks, just before its first write."""
        specs = {s.name: s for s in layout.owned}
        adapter = cast(AppliesDeltas, engine)
        for batch in layout.read_plan(mapping.copy_chunk_bytes):
            views = batch_views(mapping, batch)
            try:
                whole, deltas = _read_batch(batch, views, specs)
                will_write()
                try:
                    if whole:
                        engine.load(whole)
                    adapter.apply_deltas(deltas)
                except WeightwireError:
                    raise
                except Exception as e:
                    raise WeightwireError(
                        Reason.LOAD_FAILED,
                        f"the engine failed to load bucket {index}: {e!r}",
                        bucket=str(index),
                    ) from e
                self.checksums_verified += _verify_batch(deltas, specs, adapter)
                for _, delta in deltas:
                    self.tensors += 1
                    self.changed_elements += delta.changed_count
            finally:
                del views

    def count_regions(self, payloads: Sequence[pb.Payload]) -> None:
        """A filled bucket's regions with deltas (every trainer rank a source): each counts as a
        delta applied with its one result checksum (the region's) verified."""
        for payload in payloads:
            for s in payload.transfer_group.slices:
                if s.HasField("delta"):
                    self.tensors += 1
                    self.changed_elements += s.delta.changed_count
                    self.checksums_verified += 1

    def fill_result(self, result: pb.UpdateResult, header: pb.UpdateHeader) -> None:
        """The result's encoding fields: DELTA with its counts, or FULL echoing the header's fallback."""
        if header.HasField("delta_base"):
            result.encoding = pb.UPDATE_ENCODING_DELTA
            result.base_version = header.delta_base.base_version
            result.delta_tensors = self.tensors
            result.changed_elements = self.changed_elements
            result.result_checksums_verified = self.checksums_verified
        else:
            result.encoding = pb.UPDATE_ENCODING_FULL
            result.delta_fallback = header.delta_fallback


def _verify_batch(
    deltas: Sequence[tuple[str, Delta]], specs: Mapping[str, CheckedSpec], adapter: AppliesDeltas
) -> int:
    """Every kept part of the batch's tensors checked against the trainer's result checksums; the
    count verified. The first tensor (in order) that fails raises."""
    jobs = []
    for name, _ in deltas:
        msg = specs[name].delta
        assert msg is not None
        jobs.append((msg.result_checksums, adapter.delta_parts(name), name))
    threads = min(delta_threads(), len(jobs))
    if threads < 2:
        return sum(verify_result(sums, parts, tensor=name) for sums, parts, name in jobs)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(verify_result, sums, parts, tensor=name) for sums, parts, name in jobs]
        return sum(f.result() for f in futures)


def _read_batch(
    batch: ReadBatch, views: list[torch.Tensor], specs: Mapping[str, CheckedSpec]
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, Delta]]]:
    whole: list[tuple[str, torch.Tensor]] = []
    deltas: list[tuple[str, Delta]] = []
    for name, view in zip(batch.names, views, strict=True):
        spec = specs[name]
        if spec.delta is None:
            whole.append((name, view))
            continue
        # ``view`` holds the payload's bytes from ``read_start``: the delta's offsets, moved there.
        msg = pb.TensorDelta(
            encoding=spec.delta.encoding,
            changed_count=spec.delta.changed_count,
            index_dtype=spec.delta.index_dtype,
            values_offset_bytes=spec.delta.values_offset_bytes - spec.read_start,
        )
        delta = read_delta(
            msg, spec.torch_dtype, spec.numel, view, spec.offset_bytes - spec.read_start, tensor=name
        )
        # The target's elements and dtype are all the check needs of it (no bytes are read).
        check_delta(torch.empty(spec.shape, dtype=spec.torch_dtype, device="meta"), delta, tensor=name)
        deltas.append((name, delta))
    return whole, deltas
