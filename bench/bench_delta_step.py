"""Delta updates on a realistic RL step (issue 38, "Measure"): a Qwen-style causal LM trained with
AdamW, its bf16 weights pushed as deltas into real workers, against the FULL push of the same model.

The trainer (this process) builds a transformers ``Qwen3ForCausalLM`` (or ``Qwen2ForCausalLM``,
``--arch``) from a config with random init and HF module names: fp32 master weights, a
``torch.optim.AdamW`` step at ``--lr`` (1e-6; torch's default weight decay 0.01) on the causal-LM
cross-entropy of a random token batch (``--batch`` x ``--seq`` tokens, uniform over the vocabulary:
a real loss and a real gradient, not a real data set). After every step the model goes out as
``push(model.named_parameters(), cast_to=torch.bfloat16, delta=True)``: the library casts the fp32
masters to bf16, diffs them against its ``BaseKeeper`` and sends the encodings.

Each transport a delta is wired for today (docs/deltas.md, "Transports": inline bytes, host shared
memory, and a transfer group from one source, here gloo over loopback TCP as between machines) gets
two workers, each a ``weightwire.server.serve`` over a ``TorchAdapter`` of the same architecture in
bf16, in a separate (spawned) process, each with its own ``WeightPusher``: one takes the delta
pushes, the other a plain FULL ``push()`` of the same weights every ``--full-every`` steps, right
after the deltas (a FULL push into the delta worker would move its version past the pusher's
base). Every ratio is against the FULL push of the same step, because the load of a shared machine
drifts during a run. Not measured: every trainer rank a source (``SLICES``; whole slices in this
version) and NCCL (GPUs).

``--device cuda`` puts the trainer's model and optimizer and every worker's model on the GPU (one
GPU, every process on it): the keeper then holds its base on the GPU
(``delta_keeper.device_budget_bytes``), so the diff, the base and the result checksums run there
(the weighted sum where every worker lists it), and gloo moves the packed bytes through host memory
as between machines. A CUDA worker takes no host shared memory, so the default transports there
are the transfer group and inline bytes.

Per step, recorded:

- the fraction of bf16 elements changed since the previous step's bf16 weights, counted here
  bit by bit, and checked equal to the sum of the ``changed_count`` of the deltas the library made;
- the deltas' encoded size (the ``Delta.size_bytes`` of what ``BaseKeeper.update_all`` returned: the
  encoding ``choose_encoding`` picks by density) and the bytes of the buckets the push sent
  (``PushResult.encoded_bytes``), against the model's bf16 bytes;
- the trainer's time in the library's own delta path, timed from outside by wrapping the pusher's
  keeper and module functions (nothing in the library changes): ``BaseKeeper.update_all`` (cast,
  diff, the base brought forward and the result checksums, in one pass per host tensor), within it
  the separate steps of tensors that do not take that pass (``diff``, ``record``,
  ``result_checksums``), the whole cast of a FULL fallback, and ``pack_buckets``;
- the whole ``push`` call of each transport, the worker's own time (``server_duration_s``) and,
  over the transfer group, the bytes that reached the worker over it (``bytes_received``).

After the last step each delta worker's tensors are compared with the trainer's bf16 weights by
digest (CRC-32 from ``weightwire.core.delta.crc32`` and blake2b, per tensor, computed in each
process). Step 0's push (FULL, ``NO_BASE``) is recorded too. Results: ``--out``/delta_step.json
and the printed tables (also ``--out``/delta_step.md).

Rerun (a few minutes on 2 cores; ``--layers``, ``--steps`` to change the size and length)::

    .venv/bin/python bench/bench_delta_step.py --out bench/results/delta-step-cpu-2core
    python3 bench/bench_delta_step.py --device cuda --transports transfer_group --steps 10 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from weightwire.core.delta import choose_encoding
from weightwire.v1 import weight_transfer_pb2 as pb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

# The paths a delta is wired for (docs/deltas.md, "Transports"); transfer_group: gloo over loopback
# TCP from this one trainer process (one source), as across machines.
TRANSPORTS = ("host_shm", "inline", "transfer_group")
# A CUDA worker refuses host shared memory (its payloads must be on its device or go by value).
CUDA_TRANSPORTS = ("inline", "transfer_group")
HOST = "127.0.0.1"


def model_config(args: argparse.Namespace) -> Any:
    import transformers

    common_fields = dict(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if args.arch == "qwen3":
        return transformers.Qwen3Config(head_dim=args.head_dim, **common_fields)
    return transformers.Qwen2Config(**common_fields)


def build_model(config: Any) -> torch.nn.Module:
    import transformers

    if config.model_type == "qwen3":
        return transformers.Qwen3ForCausalLM(config)
    return transformers.Qwen2ForCausalLM(config)


def digests(named: Iterator[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, str]]:
    """Per tensor: weightwire's CRC-32 of the elements and a blake2b of the raw bytes."""
    from weightwire.core.delta import crc32

    out = {}
    for name, t in named:
        t = t.detach().cpu().contiguous()
        out[name] = (crc32(t), hashlib.blake2b(t.view(torch.uint8).numpy().data).hexdigest())
    return out


def _serve_worker(config: Any, conn: Any, device: str) -> None:
    """A worker in its own process: the architecture in bf16 on ``device`` (its random values are
    replaced by the first, FULL, push), served on a Unix socket; answers ``digest`` and ``stop`` on
    ``conn``."""
    from weightwire.adapters.torch import TorchAdapter
    from weightwire.core.manifest import ParallelRank
    from weightwire.server import serve

    torch.set_default_dtype(torch.bfloat16)
    model = build_model(config).to(device)
    torch.set_default_dtype(torch.float32)
    adapter = TorchAdapter(model, rank=ParallelRank(), device=torch.device(device), own_device=None)
    server = serve(adapter, group_host=HOST)
    conn.send(server.address)
    while True:
        cmd = conn.recv()
        if cmd == "digest":
            conn.send(digests(iter(adapter.state().items())))
        else:
            break
    server.stop(grace=0)


class Timers:
    """Seconds spent in wrapped callables since the last ``take``."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        out, self.spent = self.spent, {}
        return out


class DeltaWatch:
    """What the instrumented keeper's ``update_all`` returned during one push: changed elements,
    encoded bytes, encodings."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.changed = 0
        self.elements = 0
        self.encoded = 0
        self.encodings: dict[str, int] = {}
        self.whole = 0
        self.not_smallest: list[str] = []
        self.algorithm = 0

    def see(self, new: torch.Tensor, delta: Any) -> None:
        self.elements += new.numel()
        if delta is None:
            self.whole += 1
            return
        self.changed += delta.changed_count
        self.encoded += delta.size_bytes
        self.encodings[delta.encoding.name] = self.encodings.get(delta.encoding.name, 0) + 1
        smallest = choose_encoding(new.numel(), delta.changed_count, new.element_size())
        if smallest is not delta.encoding:
            self.not_smallest.append(f"{delta.encoding.name} where {smallest.name} is smaller")


def instrument(pusher: Any, timers: Timers, watch: DeltaWatch) -> None:
    """Time the library's delta path of ``pusher`` from outside: its keeper's methods (on the
    instance) and the module functions ``push_delta`` calls by name."""
    from weightwire.client.update import delta as delta_mod

    keeper = pusher.delta_keeper
    update_all = timers.wrap("update_s", keeper.update_all)

    def watched_update_all(items: Any, algorithm: Any) -> Any:
        out = update_all(items, algorithm)
        for u in out:
            watch.see(u.tensor, u.delta)
        watch.algorithm = algorithm
        return out

    keeper.update_all = watched_update_all
    keeper.diff = timers.wrap("diff_s", keeper.diff)
    keeper.record = timers.wrap("record_s", keeper.record)
    keeper.result_checksums = timers.wrap("checksums_s", keeper.result_checksums)
    delta_mod.pack_buckets = timers.wrap("pack_s", delta_mod.pack_buckets)
    delta_mod._cast = timers.wrap("cast_s", delta_mod._cast)


def kind_of(name: str) -> str:
    if "embed_tokens" in name:
        return "embed_tokens"
    if name.startswith("lm_head"):
        return "lm_head"
    if "norm" in name:
        return "norms"
    if "self_attn" in name:
        return "attention"
    return "mlp"


def changed_counts(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: int((t.view(torch.int16) != old[n].view(torch.int16)).sum()) for n, t in new.items()}


def as_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


@contextlib.contextmanager
def workers(config: Any, transports: list[str], device: str) -> Iterator[dict[str, tuple[str, Any]]]:
    """One worker process per transport: its address and its control pipe."""
    ctx = mp.get_context("spawn")
    started: dict[str, tuple[Any, Any]] = {}
    try:
        for t in transports:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve_worker, args=(config, child, device), daemon=True)
            p.start()
            started[t] = (p, parent)
        out = {}
        for t, (_, conn) in started.items():
            if not conn.poll(600):
                raise SystemExit(f"the {t} worker did not start")
            out[t] = (conn.recv(), conn)
        yield out
    finally:
        for p, conn in started.values():
            with contextlib.suppress(Exception):
                conn.send("stop")
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def make_pusher(address: str, transport: str, timeout_s: float) -> Any:
    from weightwire.client import WeightPusher
    from weightwire.client.transports.transfer_group import TransferGroupOptions

    if transport == "transfer_group":
        return WeightPusher([address], transfer_group=TransferGroupOptions(host=HOST), timeout_s=timeout_s)
    return WeightPusher([address], transport=transport, timeout_s=timeout_s)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    config = model_config(args)
    device = torch.device(args.device)
    model = build_model(config).to(device)
    model.train()
    params = dict(model.named_parameters())
    numel = {n: p.numel() for n, p in params.items()}
    total_elements = sum(numel.values())
    model_bytes = total_elements * 2
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    gen = torch.Generator().manual_seed(args.seed + 1)
    transports = [t for t in args.transports.split(",") if t]
    print(
        f"{config.model_type} model: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}: {len(params)} tensors, {total_elements / 1e6:.1f} M parameters, "
        f"{model_bytes / 2**30:.3f} GiB bf16; AdamW lr {args.lr}, {args.batch} x {args.seq} random tokens",
        flush=True,
    )
    load_before = os.getloadavg()
    timers, watch = Timers(), DeltaWatch()
    steps: list[dict[str, Any]] = []
    names = [f"{t}/{kind}" for t in transports for kind in ("delta", "full")]
    with workers(config, names, args.device) as fleet:
        pushers = {t: make_pusher(fleet[f"{t}/delta"][0], t, args.timeout_s) for t in transports}
        if device.type == "cuda":
            for pusher in pushers.values():  # the base on the GPU with the masters: the diff runs there
                pusher.delta_keeper.device_budget_bytes = 2 * model_bytes
        full_pushers = {t: make_pusher(fleet[f"{t}/full"][0], t, args.timeout_s) for t in transports}
        instrument(pushers[transports[0]], timers, watch)
        version = 1
        prev = as_bf16(model)
        first: dict[str, Any] = {}
        for t, pusher in pushers.items():
            t0 = time.perf_counter()
            results = pusher.push(
                model.named_parameters(), version=version, cast_to=torch.bfloat16, delta=True
            )
            (r,) = results.values()
            first[t] = {
                "push_s": time.perf_counter() - t0,
                "encoding": r.encoding,
                "fallback": r.delta_fallback,
            }
            # The FULL workers' first update, untimed: their later ones find everything set up.
            full_pushers[t].push(model.named_parameters(), version=version, cast_to=torch.bfloat16)
        timers.take()
        watch.reset()
        print(f"step 0: FULL push {first}", flush=True)
        for step in range(1, args.steps + 1):
            tokens = torch.randint(config.vocab_size, (args.batch, args.seq), generator=gen).to(device)
            t0 = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_s = time.perf_counter() - t0
            now = as_bf16(model)
            counts = changed_counts(now, prev)
            prev = now
            rec: dict[str, Any] = {
                "step": step,
                "version": version + 1,
                "loss": float(loss.detach()),
                "train_s": train_s,
                "changed_elements": sum(counts.values()),
                "changed_fraction": sum(counts.values()) / total_elements,
                "changed_fraction_by_kind": {},
                "push": {},
                "full": {},
            }
            for kind in dict.fromkeys(kind_of(n) for n in counts):
                kind_names = [n for n in counts if kind_of(n) == kind]
                rec["changed_fraction_by_kind"][kind] = sum(counts[n] for n in kind_names) / sum(
                    numel[n] for n in kind_names
                )
            version += 1
            for t, pusher in pushers.items():
                # The module functions are wrapped for every pusher: count the instrumented one's.
                watch.reset()
                timers.take()
                t0 = time.perf_counter()
                results = pusher.push(
                    model.named_parameters(), version=version, cast_to=torch.bfloat16, delta=True
                )
                push_s = time.perf_counter() - t0
                (r,) = results.values()
                if r.transport != t:
                    raise SystemExit(f"step {step}: the push to the {t} worker went over {r.transport}")
                if r.encoding != "DELTA":
                    raise SystemExit(f"step {step} over {t}: the push went {r.encoding} ({r.delta_fallback})")
                rec["push"][t] = {
                    "push_s": push_s,
                    "worker_s": r.server_duration_s,
                    "sent_bytes": r.encoded_bytes,
                    "wire_bytes": r.bytes_received,
                    "buckets": r.buckets,
                }
                if t == transports[0]:
                    if watch.changed != rec["changed_elements"] or watch.whole:
                        raise SystemExit(
                            f"step {step}: the library's deltas changed {watch.changed} elements "
                            f"({watch.whole} tensors whole), a bitwise count says {rec['changed_elements']}"
                        )
                    rec["encoded_bytes"] = watch.encoded
                    rec["encodings"] = dict(watch.encodings)
                    rec["not_smallest_encoding"] = watch.not_smallest
                    rec["checksum_algorithm"] = pb.ChecksumAlgorithm.Name(watch.algorithm)
                    rec["trainer"] = timers.take()
            if step % args.full_every == 0:
                # The FULL push of the same weights, in the same step: the reference of the ratios.
                for t, pusher in full_pushers.items():
                    t0 = time.perf_counter()
                    results = pusher.push(model.named_parameters(), version=version, cast_to=torch.bfloat16)
                    (r,) = results.values()
                    rec["full"][t] = {
                        "push_s": time.perf_counter() - t0,
                        "worker_s": r.server_duration_s,
                        "sent_bytes": r.bytes_loaded,
                        "wire_bytes": r.bytes_received,
                    }
            steps.append(rec)
            print(
                f"step {step}: loss {rec['loss']:.3f}, {rec['changed_fraction']:.3%} changed, "
                f"encoded {rec['encoded_bytes'] / model_bytes:.2%} of the model; "
                + ", ".join(f"{t} DELTA {p['push_s']:.2f} s" for t, p in rec["push"].items())
                + "".join(f", {t} FULL {p['push_s']:.2f} s" for t, p in rec["full"].items()),
                flush=True,
            )
        want = digests(iter(prev.items()))
        identical = {}
        for t in transports:
            conn = fleet[f"{t}/delta"][1]
            conn.send("digest")
            got = conn.recv()
            identical[t] = got == want
            if not identical[t]:
                bad = [n for n in want if got.get(n) != want[n]]
                print(f"{t}: {len(bad)} tensors differ from the trainer's bf16 weights, e.g. {bad[:3]}")
        keeper_memory = pushers[transports[0]].delta_keeper.memory()
        for pusher in [*pushers.values(), *full_pushers.values()]:
            pusher.close()
    return {
        "env": common.environment(
            {
                "bench": "delta_step",
                "argv": common.public_argv(sys.argv[1:]),
                "torch_threads": torch.get_num_threads(),
                "device": args.device,
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
            }
        ),
        "model": {
            "arch": config.model_type,
            "layers": config.num_hidden_layers,
            "hidden": config.hidden_size,
            "intermediate": config.intermediate_size,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "vocab": config.vocab_size,
            "tensors": len(params),
            "parameters": total_elements,
            "bf16_bytes": model_bytes,
        },
        "train": {
            "lr": args.lr,
            "optimizer": "AdamW (fused, weight_decay 0.01)",
            "batch": args.batch,
            "seq": args.seq,
        },
        "transports": transports,
        "not_measured": "every trainer rank a source (SLICES) carries whole slices in this version; NCCL needs GPUs",
        "first_push": first,
        "steps": steps,
        "bit_identical_after_deltas": identical,
        "keeper_host_bytes": keeper_memory.host_bytes,
        "keeper_device_bytes": keeper_memory.device_bytes,
    }


def summarize(res: dict[str, Any]) -> str:
    steps, model_bytes = res["steps"], res["model"]["bf16_bytes"]
    med = statistics.median
    lines = []
    fr = [s["changed_fraction"] for s in steps]
    enc = [s["encoded_bytes"] / model_bytes for s in steps]
    lines.append(
        f"changed per step: median {med(fr):.3%} (min {min(fr):.3%}, max {max(fr):.3%}); "
        f"encoded: median {med(enc):.2%} of the bf16 model (min {min(enc):.2%}, max {max(enc):.2%})"
    )
    late = fr[len(fr) // 2 :]
    lines.append(
        f"changed per step over the last {len(late)} steps (the optimizer's moments filled): "
        f"median {med(late):.3%} (a fresh AdamW moves every element with a gradient by lr at step 1)"
    )
    kinds = steps[0]["changed_fraction_by_kind"]
    lines.append(
        "changed by kind (median over steps): "
        + ", ".join(f"{k} {med(s['changed_fraction_by_kind'][k] for s in steps):.3%}" for k in kinds)
    )
    mix: dict[str, int] = {}
    for s in steps:
        for e, c in s["encodings"].items():
            mix[e] = mix.get(e, 0) + c
    odd = [x for s in steps for x in s["not_smallest_encoding"]]
    lines.append(
        f"encodings over all steps (tensors): {mix}; not the smallest by choose_encoding: {len(odd)} {odd[:3]}"
    )
    lines.append("")
    ts = res["transports"]
    lines.append(
        "| step | changed | encoded / model | update_all s | diff s | record s | checksums s | pack s | cast s | "
        + " | ".join(f"{t} DELTA s | {t} FULL s" for t in ts)
        + " |"
    )
    lines.append("| ---" * (9 + 2 * len(ts)) + " |")
    for s in steps:
        tr = s["trainer"]
        lines.append(
            f"| {s['step']} | {s['changed_fraction']:.3%} | {s['encoded_bytes'] / model_bytes:.2%} "
            f"| {tr.get('update_s', 0):.3f} | {tr.get('diff_s', 0):.2f} | {tr.get('record_s', 0):.2f} | {tr.get('checksums_s', 0):.2f} "
            f"| {tr.get('pack_s', 0):.2f} | {tr.get('cast_s', 0):.2f} | "
            + " | ".join(
                f"{s['push'][t]['push_s']:.2f} | "
                + (f"{s['full'][t]['push_s']:.2f}" if t in s["full"] else "-")
                for t in ts
            )
            + " |"
        )
    # Ratios per step against the FULL push of the same step (the machine's load drifts).
    paired = [s for s in steps if s["full"]]
    lines.append("")
    lines.append(
        f"Over the {len(paired)} steps with a FULL push of the same weights (medians; ratios per step, then the median):"
    )
    lines.append("")
    lines.append(
        "| transport | push | s | worker s | bytes sent | x FULL bytes | on the wire | x FULL time | FULL s / this s |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in ts:
        full_b = med(s["full"][t]["sent_bytes"] for s in paired)
        d_b = med(s["push"][t]["sent_bytes"] for s in paired)
        ratio = med(s["push"][t]["push_s"] / s["full"][t]["push_s"] for s in paired)
        full_w_b = med(s["full"][t]["wire_bytes"] for s in paired)
        d_w_b = med(s["push"][t]["wire_bytes"] for s in paired)
        wire = (
            (f"{full_w_b / 2**20:.1f} MiB", f"{d_w_b / 2**20:.1f} MiB ({d_w_b / full_w_b:.3f})")
            if full_w_b
            else ("-", "-")
        )
        lines.append(
            f"| {t} | FULL (push()) | {med(s['full'][t]['push_s'] for s in paired):.3f} "
            f"| {med(s['full'][t]['worker_s'] for s in paired):.3f} | {full_b / 2**20:.1f} MiB | 1.000 | {wire[0]} | 1.00 | 1.00 |"
        )
        lines.append(
            f"| {t} | DELTA (push(delta=True)) | {med(s['push'][t]['push_s'] for s in paired):.3f} "
            f"| {med(s['push'][t]['worker_s'] for s in paired):.3f} | {d_b / 2**20:.1f} MiB "
            f"| {d_b / full_b:.3f} | {wire[1]} | {ratio:.2f} | {1 / ratio:.2f} |"
        )
    lines.append("")
    parts = ("update_s", "pack_s")
    path = med(sum(s["trainer"].get(k, 0.0) for k in parts) / s["full"][ts[0]]["push_s"] for s in paired)
    lines.append(
        f"trainer's delta path ({ts[0]} pusher: update_all (cast, diff, record, checksums) + pack): median "
        f"{med(sum(s['trainer'].get(k, 0.0) for k in parts) for s in steps):.3f} s over all steps, "
        f"{path:.2f} x the {ts[0]} FULL push of its step; update_all alone "
        f"{med(s['trainer'].get('update_s', 0.0) for s in steps):.3f} s, pack "
        f"{med(s['trainer'].get('pack_s', 0.0) for s in steps):.3f} s; result checksums: "
        f"{sorted({s.get('checksum_algorithm', '?') for s in steps})}"
    )
    lines.append(
        f"workers bit-identical to the trainer's bf16 weights after {len(steps)} delta steps: {res['bit_identical_after_deltas']}"
    )
    lines.append(
        f"keeper: {res['keeper_host_bytes'] / 2**20:.0f} MiB on the host, "
        f"{res.get('keeper_device_bytes', 0) / 2**20:.0f} MiB on the device; first push: {res['first_push']}"
    )
    lines.append(f"not measured: {res['not_measured']}")
    lines.append(f"load average before/after: {res['env']['loadavg_before']} / {res['env']['loadavg_after']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--arch", choices=("qwen3", "qwen2"), default="qwen3")
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128, help="qwen3 only (qwen2: hidden / heads)")
    ap.add_argument(
        "--vocab",
        type=int,
        default=28672,
        help="28672 x hidden 1024 in bf16: 56 MiB, inside the inline limit",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the trainer's model and every worker's model live (cpu, cuda: all on one GPU)",
    )
    ap.add_argument(
        "--transports",
        default=None,
        help=f"comma-separated, of {', '.join(TRANSPORTS)} (default: all; with --device cuda "
        f"{', '.join(CUDA_TRANSPORTS)})",
    )
    ap.add_argument(
        "--full-every", type=int, default=2, help="a FULL push() of the same weights every N steps"
    )
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=None, help="folder for delta_step.json")
    args = ap.parse_args()
    on_cuda = torch.device(args.device).type == "cuda"
    if args.transports is None:
        args.transports = ",".join(CUDA_TRANSPORTS if on_cuda else TRANSPORTS)
    for t in args.transports.split(","):
        if on_cuda and t not in CUDA_TRANSPORTS:
            raise SystemExit(f"--transports: a CUDA worker takes {CUDA_TRANSPORTS}, not {t!r}")
        if t not in TRANSPORTS:
            raise SystemExit(
                f"--transports: {t!r} is not one of {TRANSPORTS} (the paths deltas are wired for)"
            )
    res = run(args)
    text = summarize(res)
    print()
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "delta_step.json").write_text(json.dumps(res, indent=1) + "\n")
        (args.out / "delta_step.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
