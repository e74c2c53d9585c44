"""weightwire with SGLang's HTTP server: ``python -m sglang.launch_server`` (SGLang 0.5.23, TP2) as a
user runs it, weightwire loaded by its entry point; the test is the trainer, using the server's
own routes (/pause_generation, /continue_generation, /generate, /update_weight_version,
/model_info) around a ``WeightPusher`` push, and checks the tokens against transformers.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest
from checkpoints import LLAMA, ModelSpec, full_checkpoint, reference_tokens, write_model_dir
from http_server import Server, http_server
from real_engine import SGLANG_ENVS
from weightwire.adapters.sglang import discover
from weightwire.client import WeightPusher
from weightwire.v1 import weight_transfer_pb2 as pb

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

SPEC = ModelSpec(LLAMA, tie=True)
PROMPTS = [[5, 6, 7, 8], [42, 1]]
NEW_TOKENS = 8
TP = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    if not SGLANG_ENVS["0.5.23"].available():
        pytest.skip("no SGLang 0.5.23 environment: `make install-sglang` makes it")
    root = tmp_path_factory.mktemp("http")
    model = write_model_dir(SPEC, str(root / "model"), full_checkpoint(SPEC, seed=1))
    socket_dir = f"/tmp/ww-sgl-{uuid.uuid4().hex[:10]}"
    try:
        with http_server(
            model, tp=TP, log_path=str(root / "server.log"), env={"WEIGHTWIRE_SGLANG_SOCKET_DIR": socket_dir}
        ) as srv:
            yield srv, socket_dir
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_http_server_generate_push_generate(server: tuple[Server, str]) -> None:
    srv, socket_dir = server
    before = srv.generate(PROMPTS, NEW_TOKENS)
    assert [o["output_ids"] for o in before] == reference_tokens(
        SPEC, full_checkpoint(SPEC, 1), PROMPTS, NEW_TOKENS
    )

    endpoints = discover(socket_dir, count=TP, timeout_s=60)
    new = full_checkpoint(SPEC, seed=2)
    with WeightPusher(endpoints, transport="host_shm", timeout_s=120) as pusher:
        srv.call("/pause_generation", {"mode": "abort"})
        results = pusher.push(new, version=2)
        srv.call("/update_weight_version", {"new_version": "2", "abort_all_requests": False})
        srv.call("/continue_generation", {})
        assert {(r.version, r.state) for r in results.values()} == {(2, "CONSISTENT")}
        assert {(s.weights_version, s.state) for s in pusher.status().values()} == {
            (2, pb.WORKER_STATE_CONSISTENT)
        }

    after = srv.generate(PROMPTS, NEW_TOKENS)
    assert [o["output_ids"] for o in after] == reference_tokens(SPEC, new, PROMPTS, NEW_TOKENS)
    assert {o["meta_info"]["weight_version"] for o in after} == {"2"}
    assert srv.call("/model_info")["weight_version"] == "2"
