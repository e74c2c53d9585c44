"""Delta encode and apply on the host, against memcpy of the same bytes in the same run.

One bf16 tensor of ``--size-mib`` (default 256 MiB) with 1%, 3%, 10% and 100% of its elements
changed at random positions (each changed element's bits differ). Per fraction, the median of
``--repeats`` runs of:

- ``memcpy``: ``copy_`` of the tensor's bytes between two buffers already touched (the floor a
  FULL update's copy pays once on each side);
- ``encode``: ``weightwire.core.delta.encode(old, new)`` (what the trainer pays per tensor, fresh
  allocations included), and the encoding's size against the tensor's;
- ``apply``: ``apply_delta(target, delta)`` into a tensor holding the base (the checks of every
  bound included), what the worker pays, and what the trainer's ``BaseKeeper.record`` pays to
  bring its copy forward;
- the result checksums over the whole tensor: CRC-32 (the host's choice), the weighted sum the
  CUDA path uses, run here on the host for comparison, and blake2b as a reference hash; plus the
  weighted sum updated from the changed elements alone (the trainer's incremental path).

Results go to ``--out`` (JSON) and a Markdown table on stdout. Rerun:
``.venv/bin/python bench/bench_delta.py --out bench/results/delta-cpu-2core/delta.json``.

``--push``: the whole ``WeightPusher.push(delta=True)`` against ``push()`` of the same bf16 model
(the demo architecture scaled to ``--size-mib``) into two TP=2 workers, each a ``serve()`` in its
own process on the host, over host shared memory and inline bytes: ``--steps`` steps, each
changing ``--push-fraction`` of every tensor's elements; every worker's tensors are compared with
the trainer's after the last step of each transport.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from weightwire.core.delta import checksums, encoding

SYNC = [lambda: None]


def timed(fn, repeats: int, before=None) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    times, out = [], None
    for _ in range(repeats):
        if before is not None:
            before()
        SYNC[0]()
        t0 = time.perf_counter()
        out = fn()
        SYNC[0]()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def changed(old: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    new = old.clone()
    n = old.numel()
    k = round(n * fraction)
    if k == n:
        positions = torch.arange(n, device=old.device)
    else:
        positions = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].to(old.device)
    bits = new.view(torch.int16)
    bits[positions] ^= 1  # a different bit pattern at every chosen position
    return new


def _serve_worker(rank: int, config: object, addresses: object, stop: object) -> None:
    from weightwire.adapters.torch import TorchAdapter
    from weightwire.adapters.torch.demo import DEMO_TP_RULES, build_demo_model
    from weightwire.core.manifest import ParallelRank
    from weightwire.server import serve

    torch.set_num_threads(1)
    tp = ParallelRank(tp_rank=rank, tp_size=2)
    model = build_demo_model(config, tp, "cpu", 0)  # type: ignore[arg-type]
    adapter = TorchAdapter(
        model,
        rank=tp,
        device=torch.device("cpu"),
        own_device=None,
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,  # type: ignore[attr-defined]
    )
    server = serve(adapter)
    addresses.put((rank, server.address))  # type: ignore[attr-defined]
    stop.wait()  # type: ignore[attr-defined]
    # Digests of what this worker holds, for the trainer to compare with its own tensors.
    state = {k: v.view(torch.int16).clone() for k, v in adapter.state().items()}
    addresses.put((rank, {k: hashlib.blake2b(v.numpy().tobytes()).hexdigest() for k, v in state.items()}))  # type: ignore[attr-defined]
    server.stop(grace=0)


def push_case(args: argparse.Namespace) -> None:
    import multiprocessing as mp

    from weightwire.adapters.torch.demo import DemoConfig, expected_shard, full_checkpoint
    from weightwire.client import WeightPusher
    from weightwire.core.manifest import ParallelRank

    # The demo architecture with a hidden size that brings the model to about --size-mib.
    config = DemoConfig(
        num_layers=8,
        hidden_size=1024,
        intermediate_size=4096,
        vocab_size=8192,
        num_heads=16,
        num_kv_heads=4,
        dtype=torch.bfloat16,
    )
    model = full_checkpoint(config, seed=1)
    scale = args.size_mib * 2**20 / sum(t.nbytes for t in model.values())
    if scale > 1.3:
        config = dataclasses.replace(config, num_layers=max(1, round(config.num_layers * scale)))
        model = full_checkpoint(config, seed=1)
    total = sum(t.nbytes for t in model.values())
    ctx = mp.get_context("spawn")
    rows = []
    for transport in ("host_shm", "inline"):
        addresses, stop = ctx.Queue(), ctx.Event()
        procs = [
            ctx.Process(target=_serve_worker, args=(r, config, addresses, stop), daemon=True)
            for r in range(2)
        ]
        for p in procs:
            p.start()
        endpoints = dict(addresses.get(timeout=300) for _ in procs)
        weights = dict(model)
        with WeightPusher([endpoints[0], endpoints[1]], transport=transport, timeout_s=600) as pusher:
            version = 0
            for mode in ("full", "delta"):
                times, sent = [], []
                for step in range(args.steps + 1):
                    if step:
                        weights = {
                            n: changed(t.reshape(-1), args.push_fraction, seed=version * 1000 + i).view(
                                t.shape
                            )
                            for i, (n, t) in enumerate(weights.items())
                        }
                    version += 1
                    t0 = time.perf_counter()
                    results = pusher.push(weights.items(), version=version, delta=mode == "delta")
                    elapsed = time.perf_counter() - t0
                    if step:  # the first push of each mode is FULL either way
                        times.append(elapsed)
                        sent.append(sum(r.encoded_bytes or r.bytes_loaded for r in results.values()))
                        if mode == "delta":
                            assert {r.encoding for r in results.values()} == {"DELTA"}, results
                row = {
                    "transport": transport,
                    "mode": mode,
                    "model_bytes": total,
                    "fraction": args.push_fraction,
                    "push_s": statistics.median(times),
                    "sent_bytes": statistics.median(sent),
                    "keeper_host_bytes": pusher.delta_keeper.memory().host_bytes,
                }
                rows.append(row)
                print(row, flush=True)
        stop.set()
        digests = dict(addresses.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        for r in range(2):
            want = expected_shard(weights, ParallelRank(tp_rank=r, tp_size=2), config)
            for n, t in want.items():
                digest = hashlib.blake2b(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()
                assert digests[r][n] == digest, (transport, r, n)
    print(
        f"\nbf16 model of {total / 2**20:.0f} MiB, 2 TP workers (separate processes), {args.push_fraction:.0%} of every tensor changed per step, median of {args.steps}\n"
    )
    print("| transport | push | median s | bytes sent to the workers | x FULL bytes | speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        full = next(f for f in rows if f["transport"] == r["transport"] and f["mode"] == "full")
        print(
            f"| {r['transport']} | {r['mode']} | {r['push_s']:.3f} | {r['sent_bytes'] / 2**20:.1f} MiB "
            f"| {r['sent_bytes'] / full['sent_bytes']:.3f} | {full['push_s'] / r['push_s']:.1f} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"torch": torch.__version__, "cpus": os.cpu_count(), "rows": rows}, indent=1) + "\n"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--fractions", default="0.01,0.03,0.10,1.0")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--device",
        default="cpu",
        help="cuda: the same cases on a GPU (torch kernels), each delta also checked equal to the host's",
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="threads of the host's encode (HOST_ENCODE_THREADS)"
    )
    ap.add_argument("--push", action="store_true", help="time push(delta=True) against push() (see above)")
    ap.add_argument("--push-fraction", type=float, default=0.02)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.push:
        push_case(args)
        return
    encoding.HOST_ENCODE_THREADS = args.threads
    device = torch.device(args.device)
    if device.type == "cuda":
        SYNC[0] = torch.cuda.synchronize

    n = args.size_mib * 2**20 // 2
    nbytes = n * 2
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(n, generator=gen).to(torch.bfloat16).to(device)
    src, dst = old.clone(), torch.empty_like(old)
    dst.copy_(src)
    target = old.clone()
    rows = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        new = changed(old, fraction, seed=1)
        t_memcpy, _ = timed(lambda: dst.copy_(src), args.repeats)
        t_encode, delta = timed(lambda new=new: encoding.encode(old, new), args.repeats)
        assert isinstance(delta, encoding.Delta)

        def reset() -> None:
            target.copy_(old)

        t_apply, _ = timed(
            lambda delta=delta: encoding.apply_delta(target, delta), args.repeats, before=reset
        )
        if not torch.equal(target.view(torch.int16), new.view(torch.int16)):
            raise SystemExit(f"fraction {fraction}: the applied result differs from new")
        t_check, _ = timed(lambda delta=delta: encoding.check_delta(target, delta), args.repeats)
        t_crc, _ = timed(lambda new=new: checksums.crc32(new), args.repeats)
        t_wsum, base_sum = timed(lambda: checksums.weighted_sum64(old), 1)
        raw = new.view(torch.uint8).cpu().numpy()
        t_blake, _ = timed(lambda raw=raw: hashlib.blake2b(raw).digest(), 1)
        # the trainer's incremental sum, for the sparse encodings (a DENSE delta is summed whole)
        positions = encoding.changed_positions(delta)
        if positions is None:
            positions = torch.arange(0, device=device)
        ob, nb = old.view(torch.int16)[positions], new.view(torch.int16)[positions]
        t_wsum_inc, inc = timed(
            lambda p=positions, ob=ob, nb=nb, s=int(base_sum): checksums.weighted_sum64_update(s, p, ob, nb),  # type: ignore[arg-type]
            args.repeats,
        )
        if delta.encoding is encoding.Encoding.DENSE:
            t_wsum_inc, inc = float("nan"), checksums.weighted_sum64(new)
        if inc != checksums.weighted_sum64(new):
            raise SystemExit("the incremental weighted sum differs from a full pass")
        if device.type != "cpu":
            host = encoding.encode(old.cpu(), new.cpu())
            for part in ("values", "indices", "bitmap"):
                a, b = getattr(delta, part), getattr(host, part)
                if (a is None) != (b is None) or (a is not None and not torch.equal(a.cpu(), b)):
                    raise SystemExit(
                        f"fraction {fraction}: the {device} delta's {part} differ from the host's"
                    )
            if checksums.weighted_sum64(new) != checksums.weighted_sum64(new.cpu()):
                raise SystemExit(f"the weighted sum on {device} differs from the host's")
        rows.append(
            {
                "fraction": fraction,
                "encoding": delta.encoding.name,
                "changed": delta.changed_count,
                "encoded_bytes": delta.size_bytes,
                "tensor_bytes": nbytes,
                "memcpy_s": t_memcpy,
                "encode_s": t_encode,
                "apply_s": t_apply,
                "check_s": t_check,
                "crc32_s": t_crc,
                "weighted_sum_s": t_wsum,
                "weighted_sum_update_s": t_wsum_inc,
                "blake2b_s": t_blake,
            }
        )
        del new, delta, positions, ob, nb

    env = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "encode_threads": args.threads,
        "size_mib": args.size_mib,
        "repeats": args.repeats,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")

    def gbs(seconds: float) -> str:
        return f"{nbytes / seconds / 1e9:.2f}"

    print(
        f"bf16, {args.size_mib} MiB on {env['device']}, {env['cpus']} CPUs ({env['torch_threads']} torch threads), "
        f"torch {env['torch']}, median of {args.repeats}"
    )
    print()
    print(
        "| changed | encoding | encoded / tensor | memcpy ms | encode ms (x memcpy) | apply ms (x memcpy) "
        "| checks ms | CRC-32 ms (GB/s) | weighted sum ms: full / from changes | blake2b ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        m = r["memcpy_s"]
        print(
            f"| {r['fraction'] * 100:g}% | {r['encoding']} | {r['encoded_bytes'] / r['tensor_bytes'] * 100:.1f}% "
            f"| {m * 1e3:.1f} | {r['encode_s'] * 1e3:.1f} ({r['encode_s'] / m:.1f}) "
            f"| {r['apply_s'] * 1e3:.1f} ({r['apply_s'] / m:.1f}) | {r['check_s'] * 1e3:.1f} "
            f"| {r['crc32_s'] * 1e3:.1f} ({gbs(r['crc32_s'])}) "
            f"| {r['weighted_sum_s'] * 1e3:.0f} / {r['weighted_sum_update_s'] * 1e3:.1f} | {r['blake2b_s'] * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
