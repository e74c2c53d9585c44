"""docs/rl-setup.md's across-machines script runs as written: two FSDP2 gloo trainer ranks under
``torchrun`` on this CPU, into ``sglang.launch_server`` (SGLang 0.5.23, TP=2) whose workers listen on
TCP with a token, as the page starts it. The script's own last check compares the engine's greedy
tokens with the trainer's; this test checks what it printed against the workers' manifests (each
worker received its slices, less than the model) and that training changed the tokens."""

from __future__ import annotations

import ast
import os
import re
import secrets
import subprocess
import sys

import pytest
from checkpoints import QWEN2, ModelSpec, full_checkpoint, reference_tokens, write_model_dir
from http_server import http_server
from ports import free_port
from real_engine import SGLANG_ENVS
from weightwire.adapters.sglang import discover
from weightwire.client import WeightPusher

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "rl-setup.md")
MARKER = "# rl_across_machines.py:"
SPEC = ModelSpec(QWEN2)
TP = 2


def page_script() -> str:
    with open(PAGE, encoding="utf-8") as f:
        blocks = [b for b in re.findall(r"```python\n(.*?)```", f.read(), flags=re.S) if b.startswith(MARKER)]
    assert len(blocks) == 1, f"docs/rl-setup.md has one block starting with {MARKER!r}"
    return blocks[0]


def test_the_pages_across_machines_script_runs_as_written(tmp_path: pytest.TempPathFactory) -> None:
    if not SGLANG_ENVS["0.5.23"].available():
        pytest.skip("no SGLang 0.5.23 environment: `make install-sglang` makes it")
    source = page_script()
    script = tmp_path / "rl_across_machines.py"  # type: ignore[operator]
    script.write_text(source)
    initial = full_checkpoint(SPEC, seed=1)
    model = write_model_dir(SPEC, str(tmp_path / "model"), initial)  # type: ignore[operator]
    token, base = secrets.token_hex(16), free_port()
    engine_env = {
        "WEIGHTWIRE_SGLANG_HOST": "127.0.0.1",
        "WEIGHTWIRE_SGLANG_BASE_PORT": str(base),
        "WEIGHTWIRE_TOKEN": token,
    }
    with http_server(model, tp=TP, log_path=str(tmp_path / "server.log"), env=engine_env) as srv:  # type: ignore[operator]
        first_worker = f"127.0.0.1:{base}"
        # The command line of the script's first line, with this machine's engine.
        command = source.splitlines()[0].removeprefix(MARKER).split()
        assert command[:3] == ["torchrun", "--nproc-per-node", "2"], command
        args = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", *command[1:3], str(script)),
            *(model, srv.url, first_worker, str(TP)),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", MY_ADDRESS="127.0.0.1", WEIGHTWIRE_TOKEN=token)
        out = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, check=False)
        said = out.stdout + out.stderr
        assert out.returncode == 0, said[-6000:]

        with WeightPusher(discover(base_address=first_worker, count=TP), token=token) as reader:
            manifests = {m.worker_id: m for m in reader.manifests().values()}
        steps = dict(re.findall(r"^step (\d+): (\{.*\})$", out.stdout, flags=re.M))
        assert sorted(steps) == ["2", "3"], said[-6000:]
        for step, printed in steps.items():
            got = ast.literal_eval(printed)
            assert set(got) == set(manifests), got
            for worker, (version, received) in got.items():
                m = manifests[worker]
                assert version == int(step)
                assert received == m.kept_bytes < m.total_bytes, (worker, received, m.kept_bytes)
        tokens = re.search(r"^engine tokens == trainer tokens: (\[.*\])$", out.stdout, flags=re.M)
        assert tokens is not None, said[-6000:]
        trained = ast.literal_eval(tokens.group(1))
        assert trained != reference_tokens(SPEC, initial, [[1, 2, 3, 4, 5]], 8)[0], "training changed nothing"
        assert srv.call("/model_info")["weight_version"] == "3"
