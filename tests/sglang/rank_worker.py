"""One rank of a fake-scheduler "SGLang engine" in its own process, for test_sglang_fake_scheduler.py.

Everything the real-engine tests (test_sglang_real_engine.py) show is shown there; this exists
for what a real engine cannot be made to do: a ``load_weights`` that silently drops a tensor it
was given (SGLang's loaders skip names they do not know with at most a log line, so the adapter
checks every tensor was consumed, and that check can only be provoked by such a loader).

Builds SGLang's real model class (Qwen2 or Llama) under SGLang's real parallel state (gloo), wraps
it in a ``FakeScheduler`` that carries what the plugin reads from a real ``Scheduler`` (a real
SGLang ``WeightUpdater`` for the begin/end steps), and starts the worker through the plugin's own
``start_worker``. A ``FakeSchedulerLoop`` thread stands in for SGLang's event loop: it calls the
plugin's ``after_process_input_requests`` hook over and over, so every update step runs on that
thread as it would between batches.

Protocol: prints ``ready <address>`` on stdout once serving. Reads commands on stdin, answering
``ok <command>``: ``skip NAME`` (``load_weights`` silently drops NAME, as SGLang's loaders do with
names they do not know), ``unskip``. Exits on EOF.
After each committed update it writes its parameters (local shards, SGLang names) to
``<dump-dir>/<worker_id>-v<version>.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sglang_cpu
import torch
from checkpoints import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class FakeScheduler:
    """The attributes of ``sglang.srt.managers.scheduler.Scheduler`` that the plugin uses."""

    def __init__(self, model: torch.nn.Module, config: Any, dump_dir: str, *, sessions: bool = True) -> None:
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        weight_updater = WeightUpdater(
            tp_rank=0,
            device="cpu",
            gpu_id=0,
            model_config=SimpleNamespace(hf_config=config),  # type: ignore[arg-type]
            custom_weight_loaders={},
            get_model=lambda: model,
            update_model_fields=lambda *a, **k: None,
            recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: None,  # type: ignore[arg-type,return-value]
        )
        runner = SimpleNamespace(
            model=model,
            device="cpu",
            gpu_id=0,
            model_config=SimpleNamespace(hf_config=config),
            weight_updater=weight_updater if sessions else SimpleNamespace(),
        )
        self.tp_worker = SimpleNamespace(model_runner=runner)
        self.server_args = SimpleNamespace(port=None, sleep_on_idle=False)
        self.draft_worker = None
        self._engine_paused = False
        self.waiting_queue: list[object] = []
        self.running_batch = SimpleNamespace(reqs=[])
        self.dump_dir = dump_dir
        self.model = model
        self.flushes = 0

    def is_fully_idle(self) -> bool:
        return not self.waiting_queue and not self.running_batch.reqs

    def flush_cache(self, empty_cache: bool = True) -> bool:
        if not self.is_fully_idle():
            return False
        self.flushes += 1
        return True

    def record_weight_version_change(self, new_version: str | None) -> None:
        from safetensors.torch import save_file
        from weightwire.adapters.sglang.plugin import SchedulerWorker

        worker: SchedulerWorker = self._weightwire_worker  # type: ignore[attr-defined]
        state = {n: p.detach().clone().contiguous() for n, p in self.model.named_parameters()}
        path = os.path.join(self.dump_dir, f"{worker.adapter.worker_id}-v{new_version}.safetensors")
        save_file(state, path + ".tmp")
        os.replace(path + ".tmp", path)


class FakeSchedulerLoop(threading.Thread):
    """Stands in for SGLang's event loop: runs the plugin's ingest hook until stopped."""

    def __init__(self, scheduler: FakeScheduler) -> None:
        super().__init__(name="fake-scheduler-loop", daemon=True)
        self.scheduler = scheduler
        self.stopped = threading.Event()

    def run(self) -> None:
        from weightwire.adapters.sglang.plugin import after_process_input_requests

        while not self.stopped.is_set():
            after_process_input_requests(None, self.scheduler, [])
            time.sleep(0.001)


def load_weights_skipping(model: torch.nn.Module, skipped: str) -> Any:
    """``model.load_weights`` that drops one name without a word (what SGLang does with an unknown one)."""
    original = type(model).load_weights

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        return original(model, [(n, t) for n, t in weights if n != skipped])

    return load_weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--init-port", type=int, required=True)
    ap.add_argument("--family", choices=[sglang_cpu.QWEN2, sglang_cpu.LLAMA], required=True)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--socket-dir", required=True)
    ap.add_argument("--dump-dir", required=True)
    ap.add_argument("--spec", default="{}", help="JSON object of ModelSpec fields (sizes, fp8_block)")
    args = ap.parse_args()

    sglang_cpu.prepare_cpu_import()
    sglang_cpu.init_parallel(
        rank=args.rank, world_size=args.world, tp_size=args.tp, pp_size=args.pp, init_port=args.init_port
    )
    spec = ModelSpec(args.family, tie=args.tie, kv_heads=args.kv_heads, **json.loads(args.spec))
    config = spec.hf_config()
    quant = sglang_cpu.fp8_config(spec.fp8_block) if spec.fp8_block else None
    model = sglang_cpu.build_model(args.family, config, DTYPES[args.dtype], quant)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # a slot no update wrote stays visibly unwritten

    os.environ["WEIGHTWIRE_SGLANG_SOCKET_DIR"] = args.socket_dir
    from weightwire.adapters.sglang.plugin import start_worker

    scheduler = FakeScheduler(model, config, args.dump_dir, sessions=quant is None)
    worker = start_worker(scheduler)
    loop = FakeSchedulerLoop(scheduler)
    loop.start()
    print(f"ready {worker.address}", flush=True)

    for line in sys.stdin:
        cmd = line.strip()
        if cmd.startswith("skip "):
            model.load_weights = load_weights_skipping(model, cmd.split(" ", 1)[1])  # type: ignore[method-assign]
        elif cmd == "unskip":
            del model.load_weights
        else:
            print(f"unknown command {cmd!r}", file=sys.stderr, flush=True)
            continue
        print(f"ok {cmd}", flush=True)

    loop.stopped.set()
    loop.join(timeout=10)
    worker.stop()
    sys.stdout.flush()
    # torch.distributed teardown with peers that may already be gone can hang; nothing is left to save.
    os._exit(0)


if __name__ == "__main__":
    main()
