"""Hypothesis strategies for hostile PushWeights streams, built from the generated stubs.

Used by ``test_adversarial.py``. Each ``Case`` is a whole request stream (header, buckets, commit)
that starts from a valid update to a real worker's manifest and breaks exactly one thing, together
with what the worker must answer: the acceptable ErrorInfo reasons, how many bucket acks come first,
and how many tensors it may legitimately load before the hostile part. ``random_streams`` is the
unstructured counterpart: arbitrary message sequences with arbitrary field values.
"""

from __future__ import annotations

import dataclasses
import uuid
import zlib
from collections.abc import Sequence

import torch
from hypothesis import strategies as st
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import OwnedTensor, ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Far past anything the worker accepts (its bound is 2**62) but still a valid int64.
HUGE = st.integers(min_value=2**62 + 1, max_value=INT64_MAX)
NEGATIVE = st.one_of(st.just(-1), st.just(INT64_MIN), st.integers(min_value=INT64_MIN, max_value=-1))

KNOWN_DTYPES = tuple(v for v in pb.DType.values() if v != pb.DTYPE_UNSPECIFIED)
UNKNOWN_DTYPES = st.one_of(
    st.integers(min_value=max(KNOWN_DTYPES) + 1, max_value=INT32_MAX),
    st.integers(min_value=INT32_MIN, max_value=-1),
)

# Path tricks and near misses of the "ww-" rule, plus generated text that the rule refuses.
SHM_NAME_TRICKS = (
    "../x",
    "/ww-../../etc/passwd",
    "ww-../../etc/passwd",
    "ww-a/../../etc/shadow",
    "/dev/shm/ww-a",
    "//ww-a",
    "ww-",
    "",
    "/",
    "ww",
    "xx-123",
    "WW-123",
    "ww-a\x00b",
    "ww-é",
    "ww-a b",
    "ww-a\nb",
    " ww-a",
    "ww-..",
    "ww-a..b",
    "ww-" + "a" * 201,
    "/../ww-a",
    "~/ww-a",
    "ww-a/",
    "./ww-a",
    "ww-a\n",
    "/ww-a\n",
)
_SHM_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _refused_shm_name(name: str) -> bool:
    bare = name[1:] if name.startswith("/") else name
    return not (
        bare.startswith("ww-") and 4 <= len(bare) <= 203 and set(bare) <= _SHM_OK and ".." not in bare
    )


BAD_SHM_NAMES = st.one_of(
    st.sampled_from(SHM_NAME_TRICKS),
    st.text(max_size=40).filter(_refused_shm_name),
    st.text(alphabet="/.w-", min_size=1, max_size=20).filter(_refused_shm_name),
)


@dataclasses.dataclass(frozen=True)
class Target:
    """What the strategies need to know about the worker under test.

    ``tensors`` are a few small owned tensors, ``values`` their bytes; ``shm_name`` is a real
    segment holding those bytes at the offsets ``layout`` gives (made by the test, read-only use).
    """

    manifest: ShardManifest
    own_device: DeviceRef
    tensors: tuple[OwnedTensor, ...]
    values: dict[str, torch.Tensor]
    layout: dict[str, int]
    blob: bytes
    shm_name: str

    @classmethod
    def build(
        cls, manifest: ShardManifest, values: dict[str, torch.Tensor], shm_name: str, count: int = 4
    ) -> Target:
        chosen = tuple(sorted(manifest.tensors.values(), key=lambda t: (t.nbytes, t.name))[:count])
        layout: dict[str, int] = {}
        parts: list[bytes] = []
        offset = 0
        for t in chosen:
            layout[t.name] = offset
            data = values[t.name].contiguous().view(torch.uint8).numpy().tobytes()
            parts.append(data)
            offset += len(data)
            pad = -offset % 64  # keep every tensor aligned for any element size
            parts.append(b"\0" * pad)
            offset += pad
        return cls(
            manifest,
            manifest.device,
            chosen,
            {t.name: values[t.name] for t in chosen},
            layout,
            b"".join(parts),
            shm_name,
        )

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    def spec(self, t: OwnedTensor) -> pb.TensorSpec:
        return pb.TensorSpec(
            name=t.name, dtype=t.dtype, shape=list(t.shape), offset_bytes=self.layout[t.name]
        )  # type: ignore[arg-type]

    def payload(self, kind: str) -> pb.Payload:
        p = pb.Payload(device=self.own_device.to_proto(), size_bytes=len(self.blob))
        if kind == "inline":
            p.inline_data = self.blob
        else:
            p.host_shm.name = self.shm_name
        return p

    def bucket(self, index: int, names: Sequence[OwnedTensor], kind: str) -> pb.Bucket:
        return pb.Bucket(index=index, tensors=[self.spec(t) for t in names], payloads=[self.payload(kind)])


@dataclasses.dataclass(frozen=True)
class Case:
    """A hostile stream and the answer it must get."""

    label: str
    requests: tuple[pb.PushWeightsRequest, ...]
    reasons: frozenset[str]
    acks: int = 0  # bucket acks the worker sends before the error
    loaded: tuple[str, ...] = ()  # tensors the worker may load (valid buckets before the hostile part)

    def __repr__(self) -> str:  # hypothesis prints this for a failing example
        return f"Case({self.label!r}, reasons={sorted(self.reasons)}, acks={self.acks}, loaded={list(self.loaded)}, requests={list(self.requests)})"


def header(version: int, scope: int = pb.UPDATE_SCOPE_FULL, **kw: object) -> pb.PushWeightsRequest:
    return pb.PushWeightsRequest(header=pb.UpdateHeader(version=version, scope=scope, **kw))  # type: ignore[arg-type]


def bucket_msg(b: pb.Bucket) -> pb.PushWeightsRequest:
    return pb.PushWeightsRequest(bucket=b)


def commit(count: int) -> pb.PushWeightsRequest:
    return pb.PushWeightsRequest(commit=pb.UpdateCommit(bucket_count=count))


# Every structured case uses this version: far above anything the structured test installs, so
# only the intended defect can make the worker refuse.
VERSION = 1_000_000


def _case(
    label: str,
    msgs: Sequence[pb.PushWeightsRequest],
    reasons: set[str] | str,
    acks: int = 0,
    loaded: Sequence[str] = (),
) -> Case:
    rs = {reasons} if isinstance(reasons, str) else reasons
    return Case(label, tuple(msgs), frozenset(rs), acks, tuple(loaded))


@st.composite
def _prefix(
    draw: st.DrawFn, target: Target
) -> tuple[list[pb.PushWeightsRequest], list[str], OwnedTensor, str]:
    """A valid header and 0-2 valid buckets, plus the tensor and payload kind the hostile bucket uses.

    The valid buckets load real tensors first, so a later refusal must leave the worker
    INCONSISTENT with its version unchanged.
    """
    kind = draw(st.sampled_from(["inline", "shm"]))
    order = draw(st.permutations(target.tensors))
    n_valid = draw(st.integers(min_value=0, max_value=min(2, len(order) - 1)))
    scope = draw(st.sampled_from([pb.UPDATE_SCOPE_FULL, pb.UPDATE_SCOPE_PARTIAL]))
    fingerprint = draw(st.sampled_from(["", target.fingerprint]))
    msgs = [header(VERSION, scope, manifest_fingerprint=fingerprint)]
    loaded: list[str] = []
    for i in range(n_valid):
        msgs.append(bucket_msg(target.bucket(i, [order[i]], kind)))
        loaded.append(order[i].name)
    return msgs, loaded, order[n_valid], kind


def _mutated_spec_cases(target: Target) -> st.SearchStrategy[Case]:
    """One tensor spec of the hostile bucket broken in one way."""

    @st.composite
    def build(draw: st.DrawFn) -> Case:
        msgs, loaded, t, kind = draw(_prefix(target))
        index = len(loaded)
        b = target.bucket(index, [t], kind)
        spec = b.tensors[0]
        itemsize = dtypes.itemsize(t.dtype)
        what = draw(
            st.sampled_from(
                [
                    "dtype_unspecified",
                    "dtype_unknown",
                    "dtype_other",
                    "shape_other",
                    "shape_negative",
                    "shape_huge",
                    "offset_negative",
                    "offset_huge",
                    "offset_misaligned",
                    "offset_past_end",
                    "name_empty",
                    "duplicate_in_bucket",
                    "duplicate_across_buckets",
                ]
            )
        )
        reasons: set[str]
        acks = index
        if what == "dtype_unspecified":
            spec.dtype = pb.DTYPE_UNSPECIFIED
            reasons = {"DTYPE_UNSPECIFIED"}
        elif what == "dtype_unknown":
            spec.dtype = draw(UNKNOWN_DTYPES)  # type: ignore[assignment]
            reasons = {"DTYPE_UNSPECIFIED"}
        elif what == "dtype_other":
            spec.dtype = draw(st.sampled_from([d for d in KNOWN_DTYPES if d != t.dtype]))  # type: ignore[assignment]
            # a wider dtype may also run past the buffer or be misaligned; either refusal is right
            reasons = {"DTYPE_MISMATCH", "TENSOR_OUT_OF_BOUNDS", "INVALID_OFFSET"}
        elif what == "shape_other":
            shape = draw(
                st.lists(st.integers(min_value=0, max_value=300), min_size=0, max_size=4).filter(
                    lambda s: tuple(s) != t.shape
                )
            )
            spec.ClearField("shape")
            spec.shape.extend(shape)
            reasons = {"SHAPE_MISMATCH", "TENSOR_OUT_OF_BOUNDS"}
        elif what == "shape_negative":
            shape = list(t.shape)
            shape[draw(st.integers(min_value=0, max_value=len(shape) - 1))] = draw(NEGATIVE)
            spec.ClearField("shape")
            spec.shape.extend(shape)
            reasons = {"INVALID_SHAPE"}
        elif what == "shape_huge":
            shape = [*t.shape, draw(HUGE)] if draw(st.booleans()) else [draw(HUGE), draw(HUGE)]
            spec.ClearField("shape")
            spec.shape.extend(shape)
            reasons = {"INVALID_SHAPE"}
        elif what == "offset_negative":
            spec.offset_bytes = draw(NEGATIVE)
            reasons = {"INVALID_OFFSET"}
        elif what == "offset_huge":
            spec.offset_bytes = draw(HUGE)
            reasons = {"INVALID_OFFSET", "TENSOR_OUT_OF_BOUNDS"}
        elif what == "offset_misaligned":
            # an unaligned offset is allowed (the worker copies); one that also runs past the end is not
            lo = len(target.blob) - t.nbytes + 1
            spec.offset_bytes = draw(
                st.integers(min_value=lo, max_value=lo + 10**6).filter(
                    lambda o: o % itemsize != 0 or itemsize == 1
                )
            )
            reasons = {"TENSOR_OUT_OF_BOUNDS"}
        elif what == "offset_past_end":
            # aligned, but the tensor's end lies beyond the payload: the classic out-of-bounds read
            lo = (len(target.blob) - t.nbytes) // itemsize + 1
            spec.offset_bytes = draw(st.integers(min_value=lo, max_value=lo + 10**6)) * itemsize
            reasons = {"TENSOR_OUT_OF_BOUNDS"}
        elif what == "name_empty":
            spec.name = ""
            reasons = {"MALFORMED_STREAM"}
        elif what == "duplicate_in_bucket":
            b.tensors.append(target.spec(t))
            reasons = {"DUPLICATE_TENSOR"}
        else:  # duplicate_across_buckets: a valid bucket with t, then t again
            msgs.append(bucket_msg(target.bucket(index, [t], kind)))
            loaded.append(t.name)
            acks = index + 1
            b = target.bucket(index + 1, [t], kind)
            reasons = {"DUPLICATE_TENSOR"}
        msgs.append(bucket_msg(b))
        msgs.append(commit(acks + 1))
        return _case(f"spec:{what}:{kind}", msgs, reasons, acks, loaded)

    return build()


def _mutated_payload_cases(target: Target) -> st.SearchStrategy[Case]:
    """The payload list or one payload of the hostile bucket broken in one way."""

    @st.composite
    def build(draw: st.DrawFn) -> Case:
        msgs, loaded, t, kind = draw(_prefix(target))
        index = len(loaded)
        b = target.bucket(index, [t], kind)
        p = b.payloads[0]
        what = draw(
            st.sampled_from(
                [
                    "no_payloads",
                    "no_label",
                    "kind_unspecified",
                    "kind_unknown",
                    "uuid_empty",
                    "uuid_not_a_device",
                    "foreign_host",
                    "foreign_cuda",
                    "foreign_cuda_peer",
                    "own_label_twice",
                    "handle_missing",
                    "size_negative",
                    "size_huge",
                    "size_too_small",
                    "inline_size_differs",
                    "shm_size_beyond_segment",
                    "shm_bad_name",
                    "shm_missing",
                    "cuda_handle_on_host",
                    "checksum_wrong",
                    "checksum_algorithm",
                ]
            )
        )
        if what == "no_payloads":
            b.ClearField("payloads")
            reasons = {"NO_PAYLOAD_FOR_DEVICE", "PAYLOAD_COUNT_MISMATCH"}
        elif what == "no_label":
            p.ClearField("device")
            reasons = {"PAYLOAD_LABEL_MISSING"}
        elif what == "kind_unspecified":
            p.device.kind = pb.DEVICE_KIND_UNSPECIFIED
            reasons = {"DEVICE_KIND_UNSPECIFIED"}
        elif what == "kind_unknown":
            p.device.kind = draw(
                st.one_of(
                    st.integers(min_value=3, max_value=INT32_MAX),
                    st.integers(min_value=INT32_MIN, max_value=-1),
                )
            )  # type: ignore[assignment]
            reasons = {"DEVICE_KIND_UNSPECIFIED"}
        elif what == "uuid_empty":
            p.device.uuid = draw(st.sampled_from(["", " ", "GPU-", "mig-", "\t"]))
            reasons = {"PAYLOAD_LABEL_MISSING"}
        elif what == "uuid_not_a_device":
            # Not a device UUID once normalised: a second prefix on the own UUID, too long, odd text.
            own = target.own_device.uuid
            p.device.uuid = draw(st.sampled_from(["GPU-GPU-" + own, "MIG-GPU-" + own, own * 4, own + " x"]))
            reasons = {"PAYLOAD_LABEL_MISSING"}
        elif what == "foreign_host":
            p.device.uuid = str(uuid.UUID(int=draw(st.integers(min_value=0, max_value=2**128 - 1))))
            reasons = {"NO_PAYLOAD_FOR_DEVICE"}
        elif what in ("foreign_cuda", "foreign_cuda_peer"):
            p.device.kind = pb.DEVICE_KIND_CUDA
            p.device.uuid = "GPU-" + str(uuid.UUID(int=draw(st.integers(min_value=0, max_value=2**128 - 1))))
            if p.WhichOneof("handle") == "host_shm":
                # Host shared memory cannot live on a GPU: every payload is checked for that,
                # before selection looks for this worker's own payload.
                reasons = {"TRANSPORT_UNAVAILABLE"}
                if what == "foreign_cuda_peer":
                    msgs[0].header.allow_peer_device_import = True
            elif what == "foreign_cuda_peer":
                msgs[0].header.allow_peer_device_import = True
                reasons = {"PEER_DEVICE_UNAVAILABLE"}
            else:
                reasons = {"NO_PAYLOAD_FOR_DEVICE"}
        elif what == "own_label_twice":
            b.payloads.append(target.payload(draw(st.sampled_from(["inline", "shm"]))))
            reasons = {"DUPLICATE_PAYLOAD_LABEL"}
        elif what == "handle_missing":
            p.ClearField(p.WhichOneof("handle"))  # type: ignore[arg-type]
            reasons = {"HANDLE_MISSING"}
        elif what == "size_negative":
            p.size_bytes = draw(NEGATIVE)
            reasons = {"INVALID_SIZE"}
        elif what == "size_huge":
            p.size_bytes = draw(HUGE)
            reasons = {"INVALID_SIZE"}
        elif what == "size_too_small":
            # the payload claims fewer bytes than the tensor needs
            p.size_bytes = draw(st.integers(min_value=0, max_value=target.layout[t.name] + t.nbytes - 1))
            reasons = {"TENSOR_OUT_OF_BOUNDS", "INVALID_SIZE"}
        elif what == "inline_size_differs":
            p.ClearField("host_shm")
            p.inline_data = target.blob
            p.size_bytes = draw(st.integers(min_value=len(target.blob) + 1, max_value=2**40))
            reasons = {"INVALID_SIZE"}
        elif what == "shm_size_beyond_segment":
            p.ClearField("inline_data")
            p.host_shm.name = target.shm_name
            p.size_bytes = draw(st.integers(min_value=len(target.blob) + 1, max_value=2**40))
            reasons = {"INVALID_SIZE", "HANDLE_OPEN_FAILED"}
        elif what == "shm_bad_name":
            p.ClearField("inline_data")
            p.host_shm.name = draw(BAD_SHM_NAMES)
            reasons = {"INVALID_SHM_NAME"}
        elif what == "shm_missing":
            p.ClearField("inline_data")
            p.host_shm.name = f"ww-0-missing-{draw(st.integers(min_value=0, max_value=10**9))}"
            reasons = {"HANDLE_OPEN_FAILED"}
        elif what == "cuda_handle_on_host":
            p.ClearField(p.WhichOneof("handle"))  # type: ignore[arg-type]
            p.cuda_ipc.memory_handle = draw(st.binary(max_size=64))
            p.cuda_ipc.storage_size_bytes = p.size_bytes
            reasons = {"TRANSPORT_UNAVAILABLE", "HANDLE_OPEN_FAILED"}
        elif what == "checksum_wrong":
            msgs[0].header.verify_checksums = True
            b.checksum.algorithm = pb.CHECKSUM_ALGORITHM_CRC32
            good = zlib.crc32(target.blob)
            b.checksum.value = draw(st.integers(min_value=0, max_value=2**32 - 1).filter(lambda v: v != good))
            reasons = {"CHECKSUM_MISMATCH"}
        else:  # checksum_algorithm
            msgs[0].header.verify_checksums = True
            b.checksum.algorithm = draw(st.sampled_from([pb.CHECKSUM_ALGORITHM_UNSPECIFIED, 2, 99, -1]))  # type: ignore[assignment]
            b.checksum.value = 0
            reasons = {"INVALID_CHECKSUM"}
        msgs.append(bucket_msg(b))
        msgs.append(commit(index + 1))
        return _case(f"payload:{what}:{kind}", msgs, reasons, index, loaded)

    return build()


def _stream_cases(target: Target) -> st.SearchStrategy[Case]:
    """Broken stream structure, headers and commits."""

    @st.composite
    def build(draw: st.DrawFn) -> Case:
        kind = draw(st.sampled_from(["inline", "shm"]))
        t = draw(st.sampled_from(target.tensors))
        good_bucket = bucket_msg(target.bucket(0, [t], kind))
        what = draw(
            st.sampled_from(
                [
                    "bucket_first",
                    "commit_first",
                    "empty_first",
                    "two_headers",
                    "empty_after_header",
                    "version_not_positive",
                    "scope_unspecified",
                    "scope_unknown",
                    "fingerprint_other",
                    "bucket_count_wrong",
                    "incomplete_full",
                    "duplicate_bucket_index",
                    "unowned_only",
                    "no_commit",
                ]
            )
        )
        h = header(VERSION)
        if what == "bucket_first":
            return _case(what, [good_bucket, commit(1)], "MALFORMED_STREAM")
        if what == "commit_first":
            return _case(what, [commit(0)], "MALFORMED_STREAM")
        if what == "empty_first":
            return _case(what, [pb.PushWeightsRequest(), commit(0)], "MALFORMED_STREAM")
        if what == "two_headers":
            return _case(what, [h, header(VERSION + 1)], "MALFORMED_STREAM")
        if what == "empty_after_header":
            return _case(what, [h, pb.PushWeightsRequest()], "MALFORMED_STREAM")
        if what == "version_not_positive":
            return _case(
                what,
                [header(draw(st.one_of(st.just(0), NEGATIVE))), commit(0)],
                {"INVALID_VERSION", "STALE_VERSION"},
            )
        if what == "scope_unspecified":
            return _case(what, [header(VERSION, pb.UPDATE_SCOPE_UNSPECIFIED), commit(0)], "SCOPE_UNSPECIFIED")
        if what == "scope_unknown":
            scope = draw(
                st.one_of(
                    st.integers(min_value=3, max_value=INT32_MAX),
                    st.integers(min_value=INT32_MIN, max_value=-1),
                )
            )
            return _case(what, [header(VERSION, scope), commit(0)], "SCOPE_UNSPECIFIED")
        if what == "fingerprint_other":
            fp = draw(st.text(min_size=1, max_size=64).filter(lambda s: s != target.fingerprint))
            return _case(what, [header(VERSION, manifest_fingerprint=fp), commit(0)], "MANIFEST_CHANGED")
        if what == "bucket_count_wrong":
            n = draw(st.one_of(NEGATIVE, st.just(0), st.integers(min_value=2, max_value=INT64_MAX)))
            return _case(
                what,
                [header(VERSION, pb.UPDATE_SCOPE_PARTIAL), good_bucket, commit(n)],
                "BUCKET_COUNT_MISMATCH",
                1,
                [t.name],
            )
        if what == "incomplete_full":
            return _case(what, [h, good_bucket, commit(1)], "INCOMPLETE_UPDATE", 1, [t.name])
        if what == "duplicate_bucket_index":
            other = draw(st.sampled_from([x for x in target.tensors if x != t]))
            again = bucket_msg(target.bucket(0, [other], kind))
            return _case(what, [h, good_bucket, again, commit(2)], "DUPLICATE_BUCKET", 1, [t.name])
        if what == "unowned_only":
            # names nobody owns are skipped without opening the handle (a missing segment proves it)
            names = draw(
                st.lists(
                    st.text(min_size=1, max_size=30).filter(lambda s: s not in target.manifest.tensors),
                    min_size=1,
                    max_size=4,
                    unique=True,
                )
            )
            b = pb.Bucket(
                index=0,
                payloads=[
                    pb.Payload(
                        device=target.own_device.to_proto(),
                        size_bytes=4,
                        host_shm=pb.HostShmHandle(name="ww-0-never-created"),
                    )
                ],
            )
            for n in names:
                b.tensors.add(name=n, dtype=pb.DTYPE_FLOAT32, shape=[1], offset_bytes=0)
            return _case(what, [h, bucket_msg(b), commit(1)], "INCOMPLETE_UPDATE", 1)
        # no_commit: the client half-closes after a valid bucket without committing
        return _case(what, [h, good_bucket], {"MALFORMED_STREAM", "INCOMPLETE_UPDATE"}, 1, [t.name])

    return build()


def hostile_cases(target: Target) -> st.SearchStrategy[Case]:
    """Every structured hostile case: broken stream, spec or payload, each after a valid prefix."""
    return st.one_of(_stream_cases(target), _mutated_spec_cases(target), _mutated_payload_cases(target))


# ---------------------------------------------------------------------------------------------
# Unstructured: arbitrary messages with arbitrary values (names mostly from the manifest so some
# reach deep into validation).
# ---------------------------------------------------------------------------------------------


def random_streams(target: Target) -> st.SearchStrategy[list[pb.PushWeightsRequest]]:
    names = st.one_of(st.sampled_from(sorted(target.manifest.tensors)), st.text(max_size=20))
    ints = st.one_of(
        st.integers(min_value=-3, max_value=3), st.integers(min_value=INT64_MIN, max_value=INT64_MAX)
    )
    enums = st.one_of(
        st.integers(min_value=-1, max_value=14), st.integers(min_value=INT32_MIN, max_value=INT32_MAX)
    )
    devices = st.builds(
        pb.DeviceId,
        kind=enums,
        uuid=st.one_of(st.just(target.own_device.uuid), st.text(max_size=40)),
    )

    @st.composite
    def spec(draw: st.DrawFn) -> pb.TensorSpec:
        return pb.TensorSpec(
            name=draw(names),
            dtype=draw(enums),
            shape=draw(st.lists(ints, max_size=4)),
            offset_bytes=draw(st.one_of(st.sampled_from(list(target.layout.values())), ints)),
        )

    @st.composite
    def payload(draw: st.DrawFn) -> pb.Payload:
        p = pb.Payload(size_bytes=draw(st.one_of(st.just(len(target.blob)), ints)))
        if draw(st.booleans()):
            p.device.CopyFrom(draw(devices))
        handle = draw(st.sampled_from(["none", "inline", "shm", "shm_bad", "cuda"]))
        if handle == "inline":
            p.inline_data = draw(st.one_of(st.just(target.blob), st.binary(max_size=256)))
        elif handle == "shm":
            p.host_shm.name = target.shm_name
        elif handle == "shm_bad":
            p.host_shm.name = draw(st.one_of(BAD_SHM_NAMES, st.text(max_size=30)))
        elif handle == "cuda":
            p.cuda_ipc.memory_handle = draw(st.binary(max_size=64))
            p.cuda_ipc.storage_size_bytes = draw(ints)
        return p

    @st.composite
    def message(draw: st.DrawFn) -> pb.PushWeightsRequest:
        which = draw(st.sampled_from(["header", "bucket", "commit", "empty"]))
        if which == "header":
            return header(
                draw(ints),
                draw(enums),
                manifest_fingerprint=draw(
                    st.one_of(st.just(""), st.just(target.fingerprint), st.text(max_size=40))
                ),
                verify_checksums=draw(st.booleans()),
                allow_peer_device_import=draw(st.booleans()),
                update_id=draw(st.text(max_size=20)),
            )
        if which == "bucket":
            b = pb.Bucket(
                index=draw(ints),
                tensors=draw(st.lists(spec(), max_size=3)),
                payloads=draw(st.lists(payload(), max_size=3)),
            )
            if draw(st.booleans()):
                b.checksum.algorithm = draw(enums)
                b.checksum.value = draw(ints)
            return bucket_msg(b)
        if which == "commit":
            return commit(draw(ints))
        return pb.PushWeightsRequest()

    return st.lists(message(), min_size=1, max_size=5)
