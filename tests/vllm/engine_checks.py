"""What every tests/vllm module checks on its real engine: manifests against the checkpoint, tokens
against the transformers reference of the weights the engine should hold, versions and states.

``Expected`` tracks the weights and version the engine must have after each committed push, so
each test starts from wherever the previous one left the shared engine and checks it first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Iterator, Mapping

import grpc
import torch
from helpers import RequestFeed, ShmSegments, bucket, header, pack, push, shm_payload
from vllm_cpu import CpuEngine, ModelSpec, greedy_slack, reference
from weightwire.adapters.vllm import update_window
from weightwire.client import GatheredBucket, PushError, PushResult, WeightPusher, layout_flat, pack_into
from weightwire.core import dtypes
from weightwire.core.devices import DeviceRef
from weightwire.core.manifest import ShardManifest
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

# vLLM's CPU logits differ from transformers' by ~2e-5 (float32, other summation order; measured
# on TP=2). A reference whose best and second-best logits are closer than this could flip, so the
# tests require every reference to be at least this unambiguous (a property of the test's fixed
# weights, checked rather than assumed).
MIN_REFERENCE_GAP = 1e-3


@dataclasses.dataclass
class Expected:
    """The weights (full checkpoint) and version the engine must hold now."""

    spec: ModelSpec
    weights: dict[str, torch.Tensor]
    version: int = 0

    def tokens(self) -> list[list[int]]:
        ref = reference(self.spec, self.weights)
        assert ref.min_logit_gap > MIN_REFERENCE_GAP, (
            f"the reference is ambiguous (top-2 logit gap {ref.min_logit_gap:.2e}): pick other test weights"
        )
        return ref.tokens

    def check_generated(self, tokens: list[list[int]]) -> None:
        """``tokens`` (an engine's greedy continuations) are greedy under these weights: every token
        taken is within ``MIN_REFERENCE_GAP`` of the best logit. For weights no test chose (a sampled
        training run's), whose greedy path may hold a near tie vLLM's and transformers' sums break
        differently. Where no step is that close this is ``tokens == self.tokens()``: at the first
        token that differs, the one taken would trail the best by the whole gap."""
        slack = greedy_slack(self.spec, self.weights, tokens)
        assert slack <= MIN_REFERENCE_GAP, (
            f"the engine's tokens are not greedy under the weights it should hold: a token taken trails "
            f"the best by {slack:.2e} (tokens {tokens}, greedy {reference(self.spec, self.weights).tokens})"
        )

    def with_tensors(self, update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**self.weights, **update}


def check_manifests(engine: CpuEngine, pusher: WeightPusher, checkpoint: Mapping[str, torch.Tensor]) -> None:
    """Every rank's manifest: its ranks, this stage's layers, full checkpoint shapes; together they
    own exactly the checkpoint's tensors."""
    spec_layers = len({n.split(".")[2] for n in checkpoint if n.startswith("model.layers.")})
    manifests = list(pusher.manifests().values())
    assert sorted((m.rank.pp_rank, m.rank.tp_rank) for m in manifests) == [
        (p, t) for p in range(engine.pp) for t in range(engine.tp)
    ]
    owned: set[str] = set()
    for m in manifests:
        assert (m.rank.tp_size, m.rank.pp_size) == (engine.tp, engine.pp)
        assert m.engine == "vllm" and m.worker_id == f"tp{m.rank.tp_rank}-pp{m.rank.pp_rank}"
        assert m.device == DeviceRef.host()
        per_stage = spec_layers // engine.pp
        assert (m.layer_start, m.layer_end, m.num_layers) == (
            m.rank.pp_rank * per_stage,
            (m.rank.pp_rank + 1) * per_stage,
            spec_layers,
        )
        for name, t in m.tensors.items():
            assert t.shape == tuple(checkpoint[name].shape), name
            assert dtypes.to_torch(t.dtype) == checkpoint[name].dtype, name
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            if layer is not None:
                assert m.layer_start <= layer < m.layer_end, f"{m.worker_id} owns {name}"
        owned |= set(m.tensors)
    assert owned == set(checkpoint)
    check_slices_tile(manifests, engine.tp)


def check_slices_tile(manifests: list[ShardManifest], tp: int) -> None:
    """The slice geometry vLLM's layers state: within a stage, each tensor is kept whole by every
    TP rank or its ranks' pieces tile it (each index of the sliced dimension exactly once), and under
    TP > 1 the attention projections are sliced."""
    by_stage: dict[int, list[ShardManifest]] = {}
    for m in manifests:
        by_stage.setdefault(m.rank.pp_rank, []).append(m)
    for stage in by_stage.values():
        for name, t in stage[0].tensors.items():
            kept = [r.tensors[name] for r in stage]
            if all(k.whole for k in kept):
                assert tp == 1 or not name.endswith(("q_proj.weight", "o_proj.weight")), name
                continue
            pieces = sorted((p.dim, p.offset, p.end) for k in kept for p in k.pieces)
            assert len({d for d, _, _ in pieces}) == 1, name
            edge = 0
            for _, start, end in pieces:
                assert start == edge, f"{name}: pieces {pieces} leave a gap or overlap"
                edge = end
            assert edge == t.shape[pieces[0][0]], name


def push_in_window(
    engine: CpuEngine,
    pusher: WeightPusher,
    expected: Expected,
    tensors: Mapping[str, torch.Tensor],
    *,
    scope: str = "full",
) -> dict[str, PushResult]:
    """Push as a user does (inside vLLM's update window), then check tokens, versions, states."""
    version = expected.version + 1
    with update_window(engine.llm, version):
        results = pusher.push(tensors, version=version, scope=scope)  # type: ignore[arg-type]
    assert {r.version for r in results.values()} == {version}
    assert {r.state for r in results.values()} == {"CONSISTENT"}
    expected.weights = expected.with_tensors(tensors)
    expected.version = version
    check_engine(engine, pusher, expected)
    return results


def check_engine(
    engine: CpuEngine, pusher: WeightPusher, expected: Expected, *, state: int = pb.WORKER_STATE_CONSISTENT
) -> None:
    """Greedy tokens equal the reference of the expected weights; every worker is at the expected
    version and state; vLLM reports the expected version for its outputs."""
    assert engine.generate() == expected.tokens()
    statuses = pusher.status().values()
    assert {(s.weights_version, s.state) for s in statuses} == {(expected.version, state)}
    assert engine.llm.get_weight_version() == (str(expected.version) if expected.version else "default")


def refused(err: PushError, reasons: Iterable[str]) -> set[str]:
    """The reasons the workers reported; fails unless every one is among ``reasons``."""
    got = {e.reason for e in err.failures.values()}
    assert got <= set(reasons), f"unexpected reasons {got}: {err}"
    return got


class UpdateWindow:
    """vLLM's update window without a version (refusal tests): ``start_weight_update`` on entry,
    ``finish_weight_update()`` on exit."""

    def __init__(self, engine: CpuEngine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        self.engine.llm.start_weight_update()

    def __exit__(self, *exc: object) -> None:
        self.engine.llm.finish_weight_update()


def push_mislabelled(pusher: WeightPusher, tensors: Mapping[str, torch.Tensor], version: int) -> PushError:
    """Push ``tensors`` in one host-memory payload labelled with another machine's boot id; returns
    the PushError (every worker must refuse: it imports only its own device's payload)."""
    items = list(tensors.items())
    specs, size = layout_flat(items)
    flat = pusher.host_buffer(size)
    pack_into(flat, specs, [t for _, t in items])
    payload = pusher.export_payload(flat, size)
    payload.device.uuid = "00000000-0000-4000-8000-000000000000"
    try:
        pusher.push_gathered(
            [GatheredBucket(specs, [payload], size)], version=version, scope="partial", precheck_labels=False
        )
    except PushError as err:
        return err
    raise AssertionError("a payload labelled with a foreign device was accepted")


@contextlib.contextmanager
def updates_held_open(pusher: WeightPusher, version: int) -> Iterator[None]:
    """A raw PushWeights stream with only a header on every worker, so each one has an update in
    progress; on exit the streams end without a commit (each worker fails that update)."""
    feeds, calls = [], []
    for address in pusher.endpoints:
        feed = RequestFeed()
        calls.append(
            pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(address)).PushWeights(
                iter(feed), timeout=120
            )
        )
        feed.send(header(version, scope=pb.UPDATE_SCOPE_PARTIAL))
        feeds.append(feed)
    deadline = time.monotonic() + 30
    while {s.state for s in pusher.status().values()} != {pb.WORKER_STATE_UPDATING}:
        assert time.monotonic() < deadline, f"the held updates did not start: {pusher.status()}"
        time.sleep(0.05)
    try:
        yield
    finally:
        for feed in feeds:
            feed.end()
        for call in calls:
            with contextlib.suppress(grpc.RpcError):
                list(call)


def push_wrong_shape_raw(
    address: str, version: int, name: str, tensor: torch.Tensor
) -> tuple[grpc.StatusCode, str]:
    """Send one bucket holding ``tensor`` under ``name`` straight to a worker (no client checks)."""
    stub = pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(address))
    packed = pack([(name, tensor)])
    segments = ShmSegments()
    try:
        seg = segments.create(packed.data)
        outcome = push(
            stub,
            [
                header(version, scope=pb.UPDATE_SCOPE_PARTIAL),
                bucket(0, packed.specs, [shm_payload(seg, len(packed.data))]),
            ],
        )
    finally:
        segments.close()
    return outcome.code, outcome.reason
