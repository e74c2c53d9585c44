"""Update planning on the trainer side: check what is pushed against the workers' manifests, then lay
tensors out into buckets and route each bucket. Pure functions over values; no gRPC, no I/O.

``WeightPusher`` (``weightwire.client.push.pusher``) calls ``check_update`` before anything is sent, so a
wrong name (an FSDP/DDP wrapper prefix), a wrong dtype or shape, or a FULL update that leaves some
worker's tensors out fails here, once, with every problem listed, instead of as N worker errors.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import torch
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef, is_own_device
from weightwire.core.errors import Reason, WeightwireError
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

DEFAULT_ALIGN_BYTES = 256
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
# What ``push`` packs a GPU bucket to when the caller gave no bucket size and the tensors must be
# packed (cast_to, verify_checksums, tensors that cannot be exported where they live): few buckets
# are what makes packing fast on a GPU, and staging then holds at most pipeline_depth (2) of these,
# never more than the update itself. Host transports keep DEFAULT_BUCKET_BYTES.
DEFAULT_CUDA_BUCKET_BYTES = 1024 * 1024 * 1024
# How many names an error message lists before it says "and N more".
_LIST_LIMIT = 12

# Module path segments that training wrappers insert into parameter names (FSDP1, activation
# checkpointing, DDP/DataParallel, torch.compile). Checkpoint names never contain them.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "module", "_orig_mod")


class PlanError(WeightwireError):
    """A problem the client found before sending anything (no worker was touched).

    ``reason`` is e.g. ``UNKNOWN_TENSOR``, ``SHAPE_MISMATCH``, ``DTYPE_MISMATCH``,
    ``INCOMPLETE_UPDATE``, ``DUPLICATE_TENSOR``, ``MANIFEST_CHANGED``, ``NO_PAYLOAD_FOR_DEVICE``.
    """


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor inside a flat buffer: checkpoint name, torch dtype, shape, byte offset."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset_bytes: int = 0

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * self.dtype.itemsize

    def to_proto(self, base_offset_bytes: int = 0) -> pb.TensorSpec:
        return pb.TensorSpec(
            name=self.name,
            dtype=dtypes.from_torch(self.dtype),
            shape=list(self.shape),
            offset_bytes=self.offset_bytes + base_offset_bytes,
        )


def _listing(names: Iterable[str]) -> str:
    items = sorted(names)
    shown = ", ".join(items[:_LIST_LIMIT])
    return shown + (f" ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else "")


def strip_wrapper_prefixes(name: str) -> str:
    """``_fsdp_wrapped_module.model.layers.0.module.mlp.w`` -> ``model.layers.0.mlp.w``."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_SEGMENTS)


# The last owners_by_name answer and the (worker, manifest) pairs it was computed from. A pusher
# asks twice per push with the same manifest objects; manifests are immutable (their fingerprint is
# cached on the same assumption), so the same objects in the same order give the same answer.
_owners_memo: tuple[tuple[tuple[str, ShardManifest], ...], dict[str, tuple[str, ...]]] | None = None


def owners_by_name(manifests: Mapping[str, ShardManifest]) -> dict[str, tuple[str, ...]]:
    """Checkpoint name -> the workers (keys of ``manifests``) that own it, in ``manifests`` order."""
    global _owners_memo
    pairs = tuple(manifests.items())
    memo = _owners_memo
    if (
        memo is not None
        and len(memo[0]) == len(pairs)
        and all(a == b and m is n for (a, m), (b, n) in zip(memo[0], pairs, strict=True))
    ):
        return dict(memo[1])
    result = _owners_by_name(manifests)
    _owners_memo = (pairs, result)
    return dict(result)


def _owners_by_name(manifests: Mapping[str, ShardManifest]) -> dict[str, tuple[str, ...]]:
    owners: dict[str, list[str]] = {}
    for worker, manifest in manifests.items():
        for name in manifest.tensors:
            owners.setdefault(name, []).append(worker)
    return {name: tuple(ws) for name, ws in owners.items()}


def _worker_label(worker: str, manifests: Mapping[str, ShardManifest]) -> str:
    wid = manifests[worker].worker_id
    return f"{wid} ({worker})" if wid else worker


def check_update(
    pushed: Sequence[TensorSpec],
    manifests: Mapping[str, ShardManifest],
    *,
    scope: int,
    allow_unowned: bool = False,
) -> list[str]:
    """Validate one update against the manifests of the workers it goes to.

    Returns the names no worker owns (empty unless ``allow_unowned``; the caller drops those).
    Raises ``PlanError`` for a name pushed twice, unknown names (with a hint when a wrapper prefix
    explains it), a dtype or shape that differs from what an owning worker expects, and, for FULL
    scope, any worker whose owned tensors are not all pushed.
    """
    counts = collections.Counter(s.name for s in pushed)
    seen = set(counts)
    dupes = {name for name, n in counts.items() if n > 1}
    if dupes:
        raise PlanError(
            Reason.DUPLICATE_TENSOR, f"tensors pushed more than once in one update: {_listing(dupes)}"
        )

    owners = owners_by_name(manifests)
    unknown = [s.name for s in pushed if s.name not in owners]
    if unknown and not allow_unowned:
        raise PlanError(
            Reason.UNKNOWN_TENSOR, _unknown_message(unknown, owners), unknown=",".join(unknown[:100])
        )

    problems: list[tuple[str, str]] = []  # (kind, message)
    for spec in pushed:
        for worker in owners.get(spec.name, ()):
            want = manifests[worker].tensors[spec.name]
            got_dtype = dtypes.from_torch(spec.dtype)
            if want.dtype != got_dtype:
                problems.append(
                    (
                        "dtype",
                        f"{spec.name}: pushed dtype {dtypes.name(got_dtype)}, {_worker_label(worker, manifests)} expects {dtypes.name(want.dtype)}",
                    )
                )
                break
            if tuple(want.shape) != tuple(spec.shape):
                problems.append(
                    (
                        "shape",
                        f"{spec.name}: pushed shape {list(spec.shape)}, {_worker_label(worker, manifests)} expects the full checkpoint shape {list(want.shape)}",
                    )
                )
                break
    if problems:
        lines = [msg for _, msg in problems]
        raise PlanError(
            Reason.DTYPE_MISMATCH if all(kind == "dtype" for kind, _ in problems) else Reason.SHAPE_MISMATCH,
            f"{len(lines)} tensor(s) do not match what the workers expect (nothing was sent):\n  "
            + "\n  ".join(lines[:_LIST_LIMIT])
            + (f"\n  ... and {len(lines) - _LIST_LIMIT} more" if len(lines) > _LIST_LIMIT else "")
            + (
                "\nA dtype is never converted silently: to convert on the way (e.g. fp32 master weights into a "
                "bf16 engine) pass cast_to=torch.bfloat16 (or a {from: to} map) to push."
                if any(kind == "dtype" for kind, _ in problems)
                else ""
            ),
        )

    if scope == pb.UPDATE_SCOPE_FULL:
        missing_by_worker = {
            worker: sorted(set(m.tensors) - seen) for worker, m in manifests.items() if set(m.tensors) - seen
        }
        if missing_by_worker:
            all_missing = sorted({n for names in missing_by_worker.values() for n in names})
            lines = [
                f"{_worker_label(w, manifests)} would miss {len(names)}: {_listing(names)}"
                for w, names in missing_by_worker.items()
            ]
            raise PlanError(
                Reason.INCOMPLETE_UPDATE,
                f"a FULL update must carry every tensor each worker owns; {len(all_missing)} owned tensor(s) "
                "are not pushed (push them, or use scope='partial'):\n  " + "\n  ".join(lines),
                missing=",".join(all_missing[:200]),
            )
    return unknown


_LM_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def _unknown_message(unknown: Sequence[str], owners: Mapping[str, object]) -> str:
    hints = []
    for name in unknown:
        stripped = strip_wrapper_prefixes(name)
        if stripped != name and stripped in owners:
            hints.append(f"{name} -> {stripped}")
    msg = f"{len(unknown)} pushed tensor name(s) are owned by no worker (nothing was sent): {_listing(unknown)}."
    if hints:
        msg += (
            " These look like parameter names of a wrapped module (FSDP '_fsdp_wrapped_module.', DDP "
            "'module.', torch.compile '_orig_mod.'); strip the wrapper segments (weightwire.client."
            "strip_wrapper_prefixes) to get the checkpoint names:\n  "
            + "\n  ".join(hints[:_LIST_LIMIT])
            + (f"\n  ... and {len(hints) - _LIST_LIMIT} more" if len(hints) > _LIST_LIMIT else "")
            + "\n"
        )
    elif any(strip_wrapper_prefixes(n) != n for n in unknown):
        msg += " Some carry wrapper segments ('_fsdp_wrapped_module.', 'module.', '_orig_mod.'); workers expect checkpoint names."
    tied = [n for n in unknown if n.endswith(_LM_HEAD) and n[: -len(_LM_HEAD)] + _EMBEDDING in owners]
    if tied:
        msg += (
            f" {tied[0]}: the workers' model ties its output layer to {tied[0][: -len(_LM_HEAD)] + _EMBEDDING}"
            " (tie_word_embeddings) and fills it from the embedding; leave it out of the push."
        )
    msg += (
        "" if msg.endswith("\n") else " "
    ) + "Pass allow_unowned=True to skip names no worker owns on purpose."
    return msg


# --------------------------------------------------------------------------------------------
# Bucket layout
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """One bucket: tensor specs with offsets inside its buffer, its byte size, and the workers it
    goes to (those owning at least one of its tensors). ``items`` index the input sequence."""

    specs: tuple[TensorSpec, ...]
    items: tuple[int, ...]
    size_bytes: int
    recipients: tuple[str, ...]


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def plan_buckets(
    tensors: Sequence[TensorSpec],
    owners: Mapping[str, Sequence[str]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    align_bytes: int = DEFAULT_ALIGN_BYTES,
) -> list[BucketPlan]:
    """Lay ``tensors`` (their offsets are ignored) out into buckets of at most ``bucket_bytes``.

    Tensors with the same set of owners share buckets (so a pipeline stage's bucket goes only to
    that stage's workers); within a group input order is kept; offsets are aligned to
    ``align_bytes``. A tensor larger than ``bucket_bytes`` gets a bucket of its own sized to fit.
    Tensors nobody owns are left out.
    """
    if bucket_bytes < 1 or align_bytes < 1:
        raise ValueError("bucket_bytes and align_bytes must be positive")
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, spec in enumerate(tensors):
        key = tuple(sorted(owners.get(spec.name, ())))
        if key:
            groups.setdefault(key, []).append(i)

    plans: list[BucketPlan] = []
    for recipients, indices in groups.items():
        plans.extend(_fill_group(tensors, indices, recipients, bucket_bytes, align_bytes))
    return plans


def _fill_group(
    tensors: Sequence[TensorSpec],
    indices: Sequence[int],
    recipients: tuple[str, ...],
    bucket_bytes: int,
    align_bytes: int,
) -> list[BucketPlan]:
    out: list[BucketPlan] = []
    specs: list[TensorSpec] = []
    items: list[int] = []
    end = 0
    for i in indices:
        spec = tensors[i]
        nbytes = spec.nbytes
        if nbytes > bucket_bytes:
            out.append(BucketPlan((dataclasses.replace(spec, offset_bytes=0),), (i,), nbytes, recipients))
            continue
        offset = align_up(end, align_bytes)
        if specs and offset + nbytes > bucket_bytes:
            out.append(BucketPlan(tuple(specs), tuple(items), end, recipients))
            specs, items, offset = [], [], 0
        specs.append(dataclasses.replace(spec, offset_bytes=offset))
        items.append(i)
        end = offset + nbytes
    if specs:
        out.append(BucketPlan(tuple(specs), tuple(items), end, recipients))
    return out


def layout_flat(
    tensors: Sequence[tuple[str, torch.Tensor]], *, align_bytes: int = DEFAULT_ALIGN_BYTES
) -> tuple[list[TensorSpec], int]:
    """Specs for packing ``tensors`` back to back (aligned) into one flat buffer, and its size.

    For callers that build their own flat buffers (``WeightPusher.push_flat``/``push_gathered``).
    """
    specs: list[TensorSpec] = []
    end = 0
    for name, t in tensors:
        offset = align_up(end, align_bytes)
        spec = TensorSpec(name, t.dtype, tuple(t.shape), offset)
        specs.append(spec)
        end = offset + spec.nbytes
    return specs, end


def pack_into(buffer: torch.Tensor, specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor]) -> None:
    """Copy each tensor into its spec's place in the flat uint8 ``buffer`` (any strides, any device)."""
    for spec, t in zip(specs, tensors, strict=True):
        if spec.nbytes == 0:
            continue
        dst = buffer.narrow(0, spec.offset_bytes, spec.nbytes).view(spec.dtype).view(spec.shape)
        dst.copy_(t.detach(), non_blocking=False)


def check_flat_specs(specs: Sequence[TensorSpec], size_bytes: int, where: str) -> None:
    """Every spec must lie inside the buffer and not overlap the next one (client-side, before sending)."""
    for spec in specs:
        if spec.offset_bytes < 0 or any(d < 0 for d in spec.shape):
            raise PlanError(Reason.INVALID_OFFSET, f"{where}: {spec.name} has a negative offset or dimension")
        if spec.offset_bytes + spec.nbytes > size_bytes:
            raise PlanError(
                Reason.TENSOR_OUT_OF_BOUNDS,
                f"{where}: {spec.name} ends at byte {spec.offset_bytes + spec.nbytes} but the buffer holds {size_bytes}",
            )


def device_mismatches(
    recipients: Iterable[str], labels: Sequence[DeviceRef], manifests: Mapping[str, ShardManifest]
) -> dict[str, str]:
    """Workers among ``recipients`` whose own device is not among the payload ``labels``, with a
    message each."""
    refs = list(labels)
    out: dict[str, str] = {}
    for w in recipients:
        own = manifests[w].device
        if not any(is_own_device(lb, own) for lb in refs):
            out[w] = (
                f"{_worker_label(w, manifests)} is on {own}; the bucket carries payloads for {', '.join(map(str, refs)) or 'no device'}"
            )
    return out


__all__ = [
    "DEFAULT_ALIGN_BYTES",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CUDA_BUCKET_BYTES",
    "WRAPPER_SEGMENTS",
    "BucketPlan",
    "PlanError",
    "TensorSpec",
    "align_up",
    "check_flat_specs",
    "check_update",
    "device_mismatches",
    "layout_flat",
    "owners_by_name",
    "pack_into",
    "plan_buckets",
    "strip_wrapper_prefixes",
]
