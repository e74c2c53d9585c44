"""The pytest side of the fake-scheduler test (test_sglang_fake_scheduler.py): start rank processes
(``rank_worker.py``) and talk to them, and what each rank should hold, computed from the model
config alone (never from SGLang's loaders).

No sglang import here: the rank processes do that.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import torch
from checkpoints import ModelSpec
from ports import free_port
from weightwire.core.topology import pp_layer_span

HERE = os.path.dirname(os.path.abspath(__file__))
READY_TIMEOUT_S = 240.0


def _rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    step = t.shape[0] // size
    return t[rank * step : (rank + 1) * step]


def _cols(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    step = t.shape[1] // size
    return t[:, rank * step : (rank + 1) * step]


def _kv_rows(t: torch.Tensor, spec: ModelSpec, rank: int, size: int) -> torch.Tensor:
    if size >= spec.kv_heads:  # fewer KV heads than ranks: each head is replicated
        head = rank // (size // spec.kv_heads)
        return t[head * spec.head_dim : (head + 1) * spec.head_dim]
    return _rows(t, rank, size)


def expected_params(
    spec: ModelSpec, full: dict[str, torch.Tensor], tp_rank: int, tp_size: int, pp_rank: int, pp_size: int
) -> dict[str, torch.Tensor]:
    """What rank (tp, pp)'s SGLang parameters (SGLang names, local shards) hold after loading ``full``."""
    span = pp_layer_span(spec.num_layers, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, torch.Tensor] = {}
    if first:
        out["model.embed_tokens.weight"] = _rows(full["model.embed_tokens.weight"], tp_rank, tp_size)
    if last:
        out["model.norm.weight"] = full["model.norm.weight"]
        if not spec.tie:
            out["lm_head.weight"] = _rows(full["lm_head.weight"], tp_rank, tp_size)
        elif not first:
            out["lm_head.weight"] = _rows(full["model.embed_tokens.weight"], tp_rank, tp_size)
    for layer in range(span.start, span.end):
        p = f"model.layers.{layer}."
        a, m = p + "self_attn.", p + "mlp."
        for leaf in ("weight", "bias") if spec.has_qkv_bias else ("weight",):
            out[a + "qkv_proj." + leaf] = torch.cat(
                [
                    _rows(full[a + "q_proj." + leaf], tp_rank, tp_size),
                    _kv_rows(full[a + "k_proj." + leaf], spec, tp_rank, tp_size),
                    _kv_rows(full[a + "v_proj." + leaf], spec, tp_rank, tp_size),
                ]
            )
        out[a + "o_proj.weight"] = _cols(full[a + "o_proj.weight"], tp_rank, tp_size)
        out[m + "gate_up_proj.weight"] = torch.cat(
            [
                _rows(full[m + "gate_proj.weight"], tp_rank, tp_size),
                _rows(full[m + "up_proj.weight"], tp_rank, tp_size),
            ]
        )
        out[m + "down_proj.weight"] = _cols(full[m + "down_proj.weight"], tp_rank, tp_size)
        out[p + "input_layernorm.weight"] = full[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = full[p + "post_attention_layernorm.weight"]
    return out


# ------------------------------------------------------------------------------------------------
# the engine's processes
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen[str]
    lines: queue.Queue[str | None]
    stderr: list[str]
    address: str = ""
    worker_id: str = ""
    tp_rank: int = -1
    pp_rank: int = -1

    def next_line(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(
                f"rank {self.rank} said nothing for {timeout:g}s:\n{''.join(self.stderr[-40:])}"
            ) from None
        if line is None:
            self.proc.wait()
            raise RuntimeError(
                f"rank {self.rank} exited with {self.proc.returncode}:\n{''.join(self.stderr[-40:])}"
            )
        return line.strip()


class CpuEngine:
    """``tp * pp`` rank processes of one model, each serving its worker in ``socket_dir``."""

    def __init__(self, spec: ModelSpec, *, tp: int, pp: int, socket_dir: str, dump_dir: str) -> None:
        self.spec, self.tp, self.pp = spec, tp, pp
        self.socket_dir, self.dump_dir = socket_dir, dump_dir
        os.makedirs(socket_dir, mode=0o700, exist_ok=True)
        os.makedirs(dump_dir, exist_ok=True)
        world = tp * pp
        port = free_port()
        self.ranks: list[RankProcess] = []
        dtype = spec.dtype_name
        for rank in range(world):
            cmd = [
                sys.executable,
                os.path.join(HERE, "rank_worker.py"),
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--tp",
                str(tp),
                "--pp",
                str(pp),
                "--init-port",
                str(port),
                "--family",
                spec.family,
                "--dtype",
                dtype,
                "--kv-heads",
                str(spec.kv_heads),
                "--socket-dir",
                socket_dir,
                "--dump-dir",
                dump_dir,
            ] + (["--tie"] if spec.tie else [])
            sizes = {
                f: getattr(spec, f)
                for f in (
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "num_layers",
                    "num_heads",
                    "fp8_block",
                )
            }
            cmd += ["--spec", json.dumps(sizes)]
            env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
            self.ranks.append(RankProcess(rank, proc, queue.Queue(), []))
        for r in self.ranks:
            threading.Thread(target=_pump, args=(r.proc.stdout, r.lines), daemon=True).start()
            threading.Thread(target=_collect, args=(r.proc.stderr, r.stderr), daemon=True).start()
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            for r in self.ranks:
                line = r.next_line(max(1.0, deadline - time.monotonic()))
                if not line.startswith("ready "):
                    raise RuntimeError(f"rank {r.rank}: unexpected first line {line!r}")
                r.address = line.removeprefix("ready ")
                # The worker named its socket after the ranks SGLang gave it: tpN-ppM.sock.
                r.worker_id = os.path.basename(r.address).removesuffix(".sock")
                tp_part, pp_part = r.worker_id.split("-")[:2]
                r.tp_rank, r.pp_rank = int(tp_part[2:]), int(pp_part[2:])
        except BaseException:
            self.stop()
            raise

    def rank_of(self, tp_rank: int, pp_rank: int) -> RankProcess:
        return next(r for r in self.ranks if (r.tp_rank, r.pp_rank) == (tp_rank, pp_rank))

    def command(self, cmd: str, ranks: list[RankProcess] | None = None) -> None:
        """Send a command to ranks (default all) and wait until each confirmed it."""
        targets = self.ranks if ranks is None else ranks
        for r in targets:
            assert r.proc.stdin is not None
            r.proc.stdin.write(cmd + "\n")
            r.proc.stdin.flush()
        for r in targets:
            line = r.next_line(60.0)
            if line != f"ok {cmd}":
                raise RuntimeError(f"rank {r.rank}: expected 'ok {cmd}', got {line!r}")

    def dump(self, r: RankProcess, version: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(os.path.join(self.dump_dir, f"{r.worker_id}-v{version}.safetensors"))

    def dump_exists(self, r: RankProcess, version: int) -> bool:
        return os.path.exists(os.path.join(self.dump_dir, f"{r.worker_id}-v{version}.safetensors"))

    def stop(self) -> None:
        for r in self.ranks:
            if r.proc.stdin is not None and not r.proc.stdin.closed:
                try:
                    r.proc.stdin.close()
                except OSError:
                    pass
        for r in self.ranks:
            try:
                r.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _collect(stream: Any, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)
