"""weightwire inside a real, running ``sglang.Engine`` on CPU, with SGLang 0.5.23 and 0.5.17.

Each engine is started the way a user starts one, with weightwire installed as a package (its
``sglang.srt.plugins`` entry point starts a worker in every scheduler process; nothing is patched
into SGLang): scheduler event loop, tokenizer manager, detokenizer, gloo between ranks, a real
forward pass with ``torch_native`` attention. The pytest process is the trainer: it discovers the
workers, pushes with ``WeightPusher`` over host shared memory, and checks the engine's greedy
tokens against transformers' own model on the same weights (computed here), token for token, and
the weight version SGLang reports.

One engine per (SGLang release, topology) serves every test of this module in order (module-scoped
fixture), so the state flows: each test starts from the weights the previous one left and checks
against them. Topologies cover TP1, TP2, TP2 x PP2 (and PP2 in the bfloat16 test) over Qwen2 and
Llama, one with tied embeddings, with and without ``sleep_on_idle``; the bfloat16 engine (PP2, tied) is compared with its own start-up tokens on the
same checkpoint, since bfloat16 kernels round differently from transformers.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch
from checkpoints import LLAMA, QWEN2, ModelSpec, full_checkpoint, reference_tokens, write_model_dir
from helpers import bucket, commit, header, inline_payload, pack, push
from real_engine import SGLANG_ENVS, EngineHost, engine_kwargs
from weightwire.adapters.sglang import discover
from weightwire.client import GatheredBucket, PlanError, PushError, WeightPusher, layout_flat, pack_into
from weightwire.core.devices import DeviceRef
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
# Shares no prefix with PROMPTS, so its cached KV can never be reused for them.
BACKGROUND_PROMPT = [200, 201, 202]
NEW_TOKENS = 8
# Long enough to be still decoding when the push arrives, within the KV pool (max_total_tokens).
BACKGROUND_TOKENS = 3500
# Releases whose scheduler records the weight version and reports it in every response (0.5.23);
# in 0.5.17 only the tokenizer manager's copy is reported, which POST /update_weight_version sets.
SCHEDULER_REPORTS_VERSION = {"0.5.23": True, "0.5.17": False}


@dataclasses.dataclass(frozen=True)
class Topology:
    tp: int
    pp: int
    spec: ModelSpec
    sleep_on_idle: bool


TOPOLOGIES = {
    "tp1-qwen2-tied": Topology(1, 1, ModelSpec(QWEN2, tie=True), sleep_on_idle=True),
    # (A Llama with one KV head over two TP ranks does not start in SGLang 0.5.23 itself: its
    # loader narrows past the replicated head while loading the checkpoint from disk.)
    "tp2-llama": Topology(2, 1, ModelSpec(LLAMA), sleep_on_idle=False),
    "tp2pp2-llama": Topology(2, 2, ModelSpec(LLAMA), sleep_on_idle=True),
}
ENGINES = [("0.5.23", name) for name in TOPOLOGIES] + [
    ("0.5.17", "tp1-qwen2-tied"),
    ("0.5.17", "tp2pp2-llama"),
]


@dataclasses.dataclass
class Running:
    """One running engine, its pusher, and what it should hold now."""

    release: str
    topology: Topology
    host: EngineHost
    pusher: WeightPusher
    weights: dict[str, torch.Tensor]
    version: int = 0  # 0: the checkpoint the engine started from

    @property
    def spec(self) -> ModelSpec:
        return self.topology.spec

    def expected_tokens(self) -> list[list[int]]:
        return reference_tokens(self.spec, self.weights, PROMPTS, NEW_TOKENS)

    def push_full(self, seed: int) -> None:
        """Pause (abort), push checkpoint ``seed`` as the next version, resume."""
        weights = full_checkpoint(self.spec, seed)
        self.host.pause("abort")
        results = self.pusher.push(weights, version=self.version + 1)
        self.host.resume()
        assert {r.version for r in results.values()} == {self.version + 1}
        assert {r.state for r in results.values()} == {"CONSISTENT"}
        self.weights, self.version = weights, self.version + 1

    def check_generates_expected(self) -> list[list[int]]:
        """The engine's greedy tokens are transformers' on the weights it should hold, and it
        reports the version it should be at."""
        outputs = self.host.generate(PROMPTS, NEW_TOKENS)
        assert [o["output_ids"] for o in outputs] == self.expected_tokens()
        expected_version = str(self.version) if self.version else "default"
        if not SCHEDULER_REPORTS_VERSION[self.release] and self.version:
            # SGLang 0.5.17 reports the tokenizer manager's copy, which the trainer sets with
            # POST /update_weight_version (docs/sglang.md); the workers cannot reach it.
            self.host.call("update_weight_version", version=self.version)
            outputs = self.host.generate(PROMPTS, NEW_TOKENS)
            assert [o["output_ids"] for o in outputs] == self.expected_tokens()
        assert {o["weight_version"] for o in outputs} == {expected_version}
        return [o["output_ids"] for o in outputs]

    def worker_versions(self) -> set[tuple[int, int]]:
        return {(st.weights_version, st.state) for st in self.pusher.status().values()}


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{r}-{t}" for r, t in ENGINES])
def running(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    release, name = request.param
    env = SGLANG_ENVS[release]
    if not env.available():
        pytest.skip(f"no SGLang {release} environment: `make install-sglang` makes it")
    topo = TOPOLOGIES[name]
    root = tmp_path_factory.mktemp(f"{release}-{name}")
    weights = full_checkpoint(topo.spec, seed=1)
    model = write_model_dir(topo.spec, str(root / "model"), weights)
    # Unix socket paths are limited to 107 bytes; pytest's temp paths can be long.
    socket_dir = f"/tmp/ww-sgl-{uuid.uuid4().hex[:10]}"
    host = EngineHost(
        env,
        engine_kwargs(
            model, tp=topo.tp, pp=topo.pp, dtype=topo.spec.dtype_name, sleep_on_idle=topo.sleep_on_idle
        ),
        socket_dir=socket_dir,
        log_path=str(root / "engine.log"),
    )
    try:
        assert host.sglang_version == release
        endpoints = discover(socket_dir, count=topo.tp * topo.pp, timeout_s=60)
        with WeightPusher(endpoints, transport="host_shm", timeout_s=120) as pusher:
            yield Running(release, topo, host, pusher, weights)
    finally:
        host.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_engine_started_from_disk_generates_reference_tokens(running: Running) -> None:
    # The reference agrees with the engine before any push: later comparisons mean something.
    running.check_generates_expected()
    manifests = running.pusher.manifests()
    assert len(manifests) == running.topology.tp * running.topology.pp
    assert {m.engine for m in manifests.values()} == {"sglang"}


def test_full_push_generates_with_the_new_checkpoint(running: Running) -> None:
    before = running.host.tokens(PROMPTS, NEW_TOKENS)
    running.push_full(seed=2)
    after = running.check_generates_expected()
    assert after != before, "checkpoints 1 and 2 must give different tokens, or this test shows nothing"
    assert running.worker_versions() == {(running.version, pb.WORKER_STATE_CONSISTENT)}


def test_partial_push_of_the_output_embedding(running: Running) -> None:
    # Tied: lm_head.weight is not a checkpoint name; the embedding is both input and output.
    name = "model.embed_tokens.weight" if running.spec.tie else "lm_head.weight"
    new = full_checkpoint(running.spec, seed=3)[name]
    before = running.host.tokens(PROMPTS, NEW_TOKENS)
    running.host.pause("abort")
    results = running.pusher.push({name: new}, version=running.version + 1, scope="partial")
    running.host.resume()
    assert {r.state for r in results.values()} == {"CONSISTENT"}
    running.weights, running.version = {**running.weights, name: new}, running.version + 1
    assert running.check_generates_expected() != before


def test_several_versions_in_sequence(running: Running) -> None:
    for seed in (4, 5, 6):
        running.push_full(seed)
        assert running.worker_versions() == {(running.version, pb.WORKER_STATE_CONSISTENT)}
    running.check_generates_expected()


def test_push_while_requests_run_unpaused_is_refused(running: Running) -> None:
    running.host.call("start_background", input_ids=BACKGROUND_PROMPT, max_new_tokens=BACKGROUND_TOKENS)
    try:
        with pytest.raises(PushError) as refused:
            running.pusher.push(full_checkpoint(running.spec, seed=7), version=running.version + 1)
        reasons = {e.reason for e in refused.value.failures.values()}
        assert "ENGINE_NOT_PAUSED" in reasons and reasons <= {"ENGINE_NOT_PAUSED", "CANCELLED"}, refused.value
        assert all(
            "pause_generation" in e.message
            for e in refused.value.failures.values()
            if e.reason == "ENGINE_NOT_PAUSED"
        )
        assert not refused.value.results
    finally:
        running.host.pause("abort")
        background = running.host.call("finish_background")
    assert background["finish_reason"] == "abort"
    running.host.resume()
    assert running.worker_versions() == {(running.version, pb.WORKER_STATE_CONSISTENT)}
    running.check_generates_expected()


def test_in_place_pause_with_requests_left(running: Running) -> None:
    """An in-place pause keeps requests in the batch. The normal loop honours it, so the push goes
    in; SGLang's pipeline-parallel loop does not, so with PP > 1 the workers refuse."""
    running.host.call("start_background", input_ids=BACKGROUND_PROMPT, max_new_tokens=BACKGROUND_TOKENS)
    running.host.pause("in_place")
    weights = full_checkpoint(running.spec, seed=8)
    try:
        if running.topology.pp > 1:
            with pytest.raises(PushError) as refused:
                running.pusher.push(weights, version=running.version + 1)
            assert any('"mode": "abort"' in e.message for e in refused.value.failures.values()), refused.value
            assert running.worker_versions() == {(running.version, pb.WORKER_STATE_CONSISTENT)}
        else:
            results = running.pusher.push(weights, version=running.version + 1)
            assert {r.state for r in results.values()} == {"CONSISTENT"}
            running.weights, running.version = weights, running.version + 1
    finally:
        # An abort reaches requests only while batches run: resume first, then abort.
        running.host.resume()
        running.host.pause("abort")
        assert running.host.call("finish_background")["finish_reason"] == "abort"
    # SGLang refuses to flush its prefix cache while requests sit in the batch, so the KV of
    # PROMPTS computed with the old weights survived the in-place update: flush it, as
    # docs/sglang.md tells the trainer to.
    assert running.host.call("flush_cache") is True
    running.host.resume()
    running.check_generates_expected()


def test_refused_updates_leave_the_old_tokens(running: Running) -> None:
    old = running.check_generates_expected()
    running.host.pause("abort")
    try:
        # A payload labelled with another machine's host id: real shared memory, right bytes.
        weights = full_checkpoint(running.spec, seed=9)
        specs, size = layout_flat(list(weights.items()))
        buf = running.pusher.host_buffer(size)
        pack_into(buf, specs, list(weights.values()))
        mislabelled = running.pusher.export_payload(buf)
        mislabelled.device.CopyFrom(DeviceRef.host(str(uuid.uuid4())).to_proto())
        with pytest.raises(PushError) as wrong_label:
            running.pusher.push_gathered(
                [GatheredBucket(list(specs), [mislabelled], size)],
                version=running.version + 1,
                precheck_labels=False,
            )
        reasons = {e.reason for e in wrong_label.value.failures.values()}
        assert "NO_PAYLOAD_FOR_DEVICE" in reasons and reasons <= {"NO_PAYLOAD_FOR_DEVICE", "CANCELLED"}
        assert not wrong_label.value.results

        # A tensor of the wrong shape, sent straight to the worker that owns it (the client would
        # refuse it before sending): the worker inside the engine refuses it.
        owner, manifest = next(
            (a, m) for a, m in running.pusher.manifests().items() if "model.norm.weight" in m.tensors
        )
        hidden = running.spec.hidden_size
        packed = pack({"model.norm.weight": torch.ones(hidden + 1, dtype=running.spec.dtype)})
        stub = pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(owner))
        outcome = push(
            stub,
            [
                header(running.version + 1, scope=pb.UPDATE_SCOPE_PARTIAL),
                bucket(0, packed.specs, [inline_payload(packed.data, device=manifest.device.to_proto())]),
                commit(1),
            ],
        )
        assert outcome.code == grpc.StatusCode.FAILED_PRECONDITION, outcome
        assert outcome.reason == "SHAPE_MISMATCH" and "model.norm.weight" in outcome.message, outcome

        # A name no worker of this engine consumes: refused before anything is sent.
        with pytest.raises(PlanError) as unknown:
            running.pusher.push(
                {"model.layers.0.mlp.no_such_proj.weight": torch.zeros(4)},
                version=running.version + 1,
                scope="partial",
            )
        assert unknown.value.reason == "UNKNOWN_TENSOR" and "no_such_proj" in str(unknown.value)
    finally:
        running.host.resume()
    assert running.worker_versions() == {(running.version, pb.WORKER_STATE_CONSISTENT)}
    assert running.check_generates_expected() == old


@pytest.fixture(scope="module")
def bf16_pp2(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EngineHost, WeightPusher, ModelSpec]]:
    env = SGLANG_ENVS["0.5.23"]
    if not env.available():
        pytest.skip("no SGLang 0.5.23 environment: `make install-sglang` makes it")
    spec = ModelSpec(QWEN2, tie=True, dtype=torch.bfloat16)
    root = tmp_path_factory.mktemp("bf16-pp2")
    model = write_model_dir(spec, str(root / "model"), full_checkpoint(spec, seed=11))
    socket_dir = f"/tmp/ww-sgl-{uuid.uuid4().hex[:10]}"
    host = EngineHost(
        env,
        engine_kwargs(model, pp=2, dtype="bfloat16"),
        socket_dir=socket_dir,
        log_path=str(root / "engine.log"),
    )
    try:
        with WeightPusher(
            discover(socket_dir, count=2, timeout_s=60), transport="host_shm", timeout_s=120
        ) as pusher:
            yield host, pusher, spec
    finally:
        host.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_bfloat16_pp2_tied_push_gives_the_tokens_of_a_fresh_engine(
    bf16_pp2: tuple[EngineHost, WeightPusher, ModelSpec],
) -> None:
    """bfloat16 kernels round differently from transformers, so the reference here is the engine
    itself freshly started from checkpoint A: pushing B changes its tokens, pushing A back (FULL,
    then the tied embedding alone as a PARTIAL update) gives exactly the start-up tokens again."""
    host, pusher, spec = bf16_pp2
    a, b = full_checkpoint(spec, seed=11), full_checkpoint(spec, seed=12)
    fresh = host.tokens(PROMPTS, NEW_TOKENS)
    last = next(m for m in pusher.manifests().values() if m.rank.pp_rank == 1)
    assert "model.embed_tokens.weight" in last.tensors and "lm_head.weight" not in last.tensors

    def push(weights: dict[str, torch.Tensor], version: int, scope: str = "full") -> list[list[int]]:
        host.pause("abort")
        results = pusher.push(weights, version=version, scope=scope)  # type: ignore[arg-type]
        host.resume()
        assert {(r.version, r.state) for r in results.values()} == {(version, "CONSISTENT")}
        outputs = host.generate(PROMPTS, NEW_TOKENS)
        assert {o["weight_version"] for o in outputs} == {str(version)}
        return [o["output_ids"] for o in outputs]

    assert push(b, 1) != fresh
    assert push(a, 2) == fresh
    name = "model.embed_tokens.weight"
    assert push({name: b[name]}, 3, "partial") != fresh
    assert push({name: a[name]}, 4, "partial") == fresh
