"""What a worker concludes from a bucket's tensor specs and payload sizes alone, and the cache of it.

``weightwire.server.worker.update.Update`` runs ``check_structure`` and ``check_ownership`` on a bucket
whose layout it has not seen before and keeps the conclusion (a ``BucketLayout``) in the worker's
``LayoutCache``: a trainer sends the same buckets every update, so later updates skip these checks.
The rules that depend on the update (bucket index, names across buckets, checksum, selection, the
handle itself) are not part of a layout and run for every bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence, Set

import torch
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.server.rules.validation import (
    CheckedSpec,
    check_against_manifest,
    check_in_bounds,
    check_payload_size,
    check_result_checksums,
    check_spec,
)
from weightwire.server.rules.views import ReadPlan, ViewItem, copy_plan, in_place_plan
from weightwire.v1 import weight_transfer_pb2 as pb

# Validated bucket layouts a worker remembers (a packed push of a large model has a few hundred
# distinct ones), and the tensor specs over all of them (a bound on the cache's memory).
MAX_CACHED_LAYOUTS = 1024
MAX_CACHED_SPECS = 1 << 16
# Whole bucket messages remembered as a faster way to their layout, by their serialized bytes in
# all (a bound on that index's memory: a 400-tensor bucket serializes to ~30 KiB).
MAX_CACHED_MESSAGE_BYTES = 32 << 20
# Layouts kept under a trainer's ``Bucket.layout_id`` (a pusher names at most a few hundred), the
# specs over all of them, and the longest id taken.
MAX_LAYOUT_REFS = 1024
MAX_LAYOUT_REF_SPECS = 1 << 18
MAX_LAYOUT_ID_BYTES = 64


def layout_key(msg: pb.Bucket, payloads: Sequence[pb.Payload]) -> bytes:
    """What the layout checks depend on, as bytes: the serialized tensor specs and each payload's
    size and handle field (not the handle itself, the index or the checksum, which change between
    updates and are checked per update)."""
    specs_only = pb.Bucket()
    specs_only.tensors.MergeFrom(msg.tensors)
    return specs_only.SerializeToString() + b"|" + payload_signature(payloads).encode()


def payload_signature(payloads: Sequence[pb.Payload]) -> str:
    """Each payload's size and handle field: what a layout's bounds and handle checks depended on
    besides its specs (``layout_key``'s second part), compared when a bucket refers to its specs."""
    return ";".join(f"{p.size_bytes}:{p.WhichOneof('handle') or ''}" for p in payloads)


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """What the layout checks of one bucket concluded: every spec valid and in bounds of every
    payload, no name twice in the bucket, every payload with a handle, owned tensors matching the
    manifest. Only layouts that passed are built."""

    specs: tuple[CheckedSpec, ...]
    names: frozenset[str]
    owned: tuple[CheckedSpec, ...]
    owned_names: tuple[str, ...]
    views: tuple[ViewItem, ...]
    owned_bytes: int
    # Whether an owned spec is a delta (its view is the bytes of its encoding, not the tensor).
    owned_deltas: bool = False
    _plans: dict[int | None, ReadPlan] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, specs: Sequence[CheckedSpec], owned: Sequence[CheckedSpec]) -> BucketLayout:
        return cls(
            specs=tuple(specs),
            names=frozenset(s.name for s in specs),
            owned=tuple(owned),
            owned_names=tuple(s.name for s in owned),
            views=tuple(_view_item(s) for s in owned),
            owned_bytes=sum(s.end_bytes - s.read_start if s.delta is not None else s.nbytes for s in owned),
            owned_deltas=any(s.delta is not None for s in owned),
        )

    def read_plan(self, copy_chunk_bytes: int | None) -> ReadPlan:
        """How the owned tensors are fetched from a payload that copies in chunks of at most
        ``copy_chunk_bytes`` (None: one that is viewed in place); worked out once per chunk size."""
        plan = self._plans.get(copy_chunk_bytes)
        if plan is None:
            if copy_chunk_bytes is None:
                plan = in_place_plan(self.owned_names, self.views)
            else:
                plan = copy_plan(self.owned_names, self.views, copy_chunk_bytes)
            self._plans[copy_chunk_bytes] = plan
        return plan

    def first_seen(self, seen: Set[str]) -> str | None:
        """The first name (in spec order) that is in ``seen``, as the full check would name it."""
        if self.names.isdisjoint(seen):
            return None
        return next(s.name for s in self.specs if s.name in seen)


def _view_item(spec: CheckedSpec) -> ViewItem:
    """What the worker reads of an owned spec: the tensor, or the bytes of its delta's encoding."""
    if spec.delta is None:
        return ViewItem.of(spec.offset_bytes, spec.torch_dtype, spec.shape)
    return ViewItem.of(spec.read_start, torch.uint8, (spec.end_bytes - spec.read_start,))


def duplicate_tensor(name: str) -> WeightwireError:
    return WeightwireError(
        Reason.DUPLICATE_TENSOR, f"tensor {name!r} arrived twice in this update", tensor=name
    )


def check_structure(
    msg: pb.Bucket, payloads: Sequence[pb.Payload], seen: Set[str], *, deltas: bool = False
) -> list[CheckedSpec]:
    """Specs, names (also against ``seen``, the names of earlier buckets), payload count, sizes,
    handles and bounds, in the order the rules apply; raises on the first failure. ``deltas``: the
    update has a delta base, so a spec may carry a TensorDelta."""
    specs = [check_spec(s, deltas=deltas) for s in msg.tensors]
    names_here: set[str] = set()
    for spec in specs:
        if spec.name in names_here or spec.name in seen:
            raise duplicate_tensor(spec.name)
        names_here.add(spec.name)
    if specs and not payloads:
        raise WeightwireError(
            Reason.PAYLOAD_COUNT_MISMATCH,
            f"bucket {msg.index} describes {len(specs)} tensors but carries no payload",
            bucket=str(msg.index),
        )
    for i, payload in enumerate(payloads):
        check_payload_size(payload, i)
        if payload.WhichOneof("handle") is None:
            raise WeightwireError(
                Reason.HANDLE_MISSING,
                f"payload {i} of bucket {msg.index} has no handle (cuda_ipc, host_shm or inline_data)",
            )
        for spec in specs:
            check_in_bounds(spec, payload.size_bytes)
    return specs


def check_ownership(specs: Sequence[CheckedSpec], manifest: ShardManifest) -> list[CheckedSpec]:
    """The specs this worker owns (in its manifest); each must match the manifest exactly."""
    owned: list[CheckedSpec] = []
    for spec in specs:
        expected = manifest.tensors.get(spec.name)
        if expected is not None:
            check_against_manifest(spec, expected)
            if spec.delta is not None:
                check_result_checksums(spec, expected)
            owned.append(spec)
    return owned


class LayoutCache:
    """Bucket layouts that passed, keyed by ``layout_key`` and the manifest fingerprint; the oldest
    go first beyond ``max_layouts`` layouts or ``max_specs`` specs. Only the thread running the
    worker's one update at a time adds to it."""

    def __init__(
        self,
        max_layouts: int = MAX_CACHED_LAYOUTS,
        max_specs: int = MAX_CACHED_SPECS,
        max_message_bytes: int = MAX_CACHED_MESSAGE_BYTES,
    ) -> None:
        self._max_layouts = max_layouts
        self._max_specs = max_specs
        self._max_message_bytes = max_message_bytes
        self._layouts: dict[tuple[bytes, str], BucketLayout] = {}
        self._specs = 0
        # Serialized bucket message and fingerprint -> the layout key it resolved to.
        self._by_message: dict[tuple[bytes, str], tuple[bytes, str]] = {}
        self._message_bytes = 0
        # (Bucket.layout_id, fingerprint) -> the payload signature its specs were accepted with and
        # their layout. Held here, not by key: a layout that left ``_layouts`` stays valid.
        self._refs: dict[tuple[bytes, str], tuple[str, BucketLayout]] = {}
        self._ref_specs = 0

    def __len__(self) -> int:
        return len(self._layouts)

    def get(self, key: tuple[bytes, str]) -> BucketLayout | None:
        return self._layouts.get(key)

    def get_message(self, message: bytes, fingerprint: str) -> BucketLayout | None:
        """The layout of a bucket whose serialized message is byte for byte one seen before
        (``put_message``); None if not, or if that layout has left the cache since. Building the
        message's bytes costs a fraction of ``layout_key``; they hold everything the key does."""
        key = self._by_message.get((message, fingerprint))
        return None if key is None else self._layouts.get(key)

    def put_message(self, message: bytes, fingerprint: str, key: tuple[bytes, str]) -> None:
        """Remember that ``message`` has the layout cached under ``key``; oldest first out."""
        if key not in self._layouts or len(message) > self._max_message_bytes:
            return
        entry = (message, fingerprint)
        if entry in self._by_message:
            return
        while self._by_message and self._message_bytes + len(message) > self._max_message_bytes:
            oldest = next(iter(self._by_message))
            del self._by_message[oldest]
            self._message_bytes -= len(oldest[0])
        self._by_message[entry] = key
        self._message_bytes += len(message)

    def put(self, key: tuple[bytes, str], layout: BucketLayout) -> None:
        while self._layouts and (
            len(self._layouts) >= self._max_layouts or self._specs + len(layout.specs) > self._max_specs
        ):
            self._specs -= len(self._layouts.pop(next(iter(self._layouts))).specs)
        if len(layout.specs) <= self._max_specs:
            self._layouts[key] = layout
            self._specs += len(layout.specs)

    def keep_ref(self, layout_id: bytes, fingerprint: str, signature: str, layout: BucketLayout) -> bool:
        """Keep ``layout`` (checked with payloads of ``signature``) under the trainer's id for this
        manifest, replacing what the id named before; the oldest go first beyond the bounds. False
        when it cannot be kept (more specs than the whole bound)."""
        if len(layout.specs) > MAX_LAYOUT_REF_SPECS:
            return False
        entry = (layout_id, fingerprint)
        old = self._refs.pop(entry, None)
        if old is not None:
            self._ref_specs -= len(old[1].specs)
        while self._refs and (
            len(self._refs) >= MAX_LAYOUT_REFS or self._ref_specs + len(layout.specs) > MAX_LAYOUT_REF_SPECS
        ):
            self._ref_specs -= len(self._refs.pop(next(iter(self._refs)))[1].specs)
        self._refs[entry] = (signature, layout)
        self._ref_specs += len(layout.specs)
        return True

    def by_ref(self, layout_id: bytes, fingerprint: str) -> tuple[str, BucketLayout] | None:
        """The payload signature and layout kept under ``layout_id`` for this manifest, or None."""
        return self._refs.get((layout_id, fingerprint))
