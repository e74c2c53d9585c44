"""Tables and plots from the benchmarks' JSON results (for BENCHMARKS.md).

    python bench/report.py                       # Markdown tables of the committed results
    python bench/report.py --plots               # also bench/gpu.png, bench/cpu_shm.png, bench/cpu_scaling.png

Reads ``gpu_results.json`` (``bench_gpu.py``) and ``cpu_results.json`` (``bench_cpu.py``) folders;
plots need matplotlib (``pip install -e '.[bench]'``). Every number is a median over the warm
updates of a case (the first, cold update opens the handles and is shown separately).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
GiB = 1024**3
MiB = 1024**2

CASE_NAMES = {
    "ww_inplace": "weightwire in place",
    "ww_packed": "weightwire packed",
    "ww_peer": "weightwire peer GPU (GPU 1 → GPU 0)",
    "per_tensor": "one IPC handle per tensor",
    "ckpt_engine": "checkpoint-engine receiver",
}


def med(xs: Iterable[float]) -> float:
    vals = [x for x in xs if x is not None]
    return float(statistics.median(vals)) if vals else float("nan")


def warm(rec: dict[str, Any]) -> list[dict[str, Any]]:
    ups = rec.get("updates", [])
    return ups[1:] if len(ups) > 1 else ups


def wmed(rec: dict[str, Any], key: str) -> float:
    return med(u.get(key) for u in warm(rec))


def load(folder: Path, name: str) -> dict[str, Any]:
    return json.loads((folder / name).read_text())


def label(rec: dict[str, Any]) -> str:
    base = CASE_NAMES.get(rec["case"], rec["case"])
    v = rec.get("variant", "")
    if rec["case"] == "per_tensor":
        return base + (
            ", one message per tensor (OpenRLHF)" if v == "per_tensor" else ", all in one message (SGLang)"
        )
    if rec["case"] == "ckpt_engine":
        return base + (", whole model in place" if v == "in-place" else f", {v} buckets")
    if rec["case"] in ("ww_packed",):
        size, _, depth = v.partition(", depth ")
        return f"{base}, {size} buckets" + (f", {depth} staging buffers" if depth else "")
    if rec["case"] == "ww_inplace":
        return base + (
            ", one bucket"
            if v == "whole"
            else ", one bucket, no GetStatus re-check"
            if "no re-check" in v
            else f", {v} views"
        )
    return base


def limits(doc: dict[str, Any], model: str) -> dict[str, float]:
    for rec in doc["cases"]:
        if (
            rec.get("model") == model
            and rec["case"] == "limit"
            and "error" not in rec
            and "skipped" not in rec
        ):
            return {k: med(v) for k, v in rec.items() if k.endswith("_ms")} | {"bytes": rec["bytes"]}
    return {}


def mib(n: float | None) -> str:
    return "–" if n is None else f"{n / MiB:,.0f}"


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


ORDER = ["ww_inplace", "ww_packed", "ww_peer", "per_tensor", "ckpt_engine"]


def _size_key(variant: str) -> float:
    v = variant.lower()
    for suffix, mult in (("gib", 1024.0), ("mib", 1.0)):
        if v.endswith(suffix) and v[: -len(suffix)].isdigit():
            return float(v[: -len(suffix)]) * mult
    return -1.0 if v in ("whole", "per_tensor", "in-place") else 0.0


def sorted_cases(doc: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """A model's cases other than the limits, grouped by approach, smaller buckets first."""
    rows = [r for r in doc["cases"] if r.get("model") == model and r["case"] in ORDER]
    return sorted(
        rows, key=lambda r: (ORDER.index(r["case"]), _size_key(r.get("variant", "")), r.get("variant", ""))
    )


def gpu_tables(doc: dict[str, Any]) -> str:
    out: list[str] = []
    models = list(dict.fromkeys(r["model"] for r in doc["cases"]))
    for model in models:
        lim = limits(doc, model)
        if not lim:
            continue
        gib = lim["bytes"] / GiB
        out.append(f"#### {model} ({gib:.2f} GiB bf16)\n")
        out.append(
            f"Limits in one process: one device-to-device copy **{lim['d2d_flat_ms']:.2f} ms** "
            f"({lim['bytes'] / lim['d2d_flat_ms'] / 1e6:.0f} GB/s of copied bytes); the same bytes as per-tensor copies out "
            f"of a flat buffer {lim['d2d_per_tensor_ms']:.2f} ms; pack + unpack (two copies) "
            + ", ".join(
                f"{k.removeprefix('two_copies_').removesuffix('_ms')} {v:.2f} ms"
                for k, v in lim.items()
                if k.startswith("two_copies")
            )
            + (
                f"; GPU 1 → GPU 0 over NVLink {lim['peer_flat_ms']:.2f} ms (per tensor {lim['peer_per_tensor_ms']:.2f} ms)"
                if "peer_flat_ms" in lim
                else ""
            )
            + ".\n"
        )
        out.append(
            "| approach | warm ms | cold ms | GiB/s | × limit | open | copy | staging | control | commit | handles opened cold / warm | trainer peak extra MiB | worker peak extra MiB | exact |"
        )
        out.append("|" + " --- |" * 14)
        for rec in sorted_cases(doc, model):
            if "updates" not in rec:
                out.append(f"| {label(rec)} | {rec.get('error') or rec.get('skipped')} |" + " |" * 12)
                continue
            ups = rec["updates"]
            total = wmed(rec, "total_ms")
            ref = lim["peer_flat_ms"] if rec["case"] == "ww_peer" else lim["d2d_flat_ms"]
            mem = rec.get("memory", {})
            trainer = mem.get("trainer_gpu1" if rec["case"] == "ww_peer" else "trainer_gpu0", {}).get(
                "peak_extra"
            )
            worker = mem.get("worker", {}).get("peak_extra")
            warm_handles = sorted({u.get("handles_opened") for u in warm(rec)})
            commit = f"{wmed(rec, 'commit_ms'):.2f}" if "commit_ms" in ups[0] else "–"
            out.append(
                f"| {label(rec)} | **{total:.1f}** | {ups[0]['total_ms']:.1f} | {lim['bytes'] / GiB / (total / 1e3):.0f} | "
                f"{total / ref:.2f} | {wmed(rec, 'open_ms'):.1f} | {wmed(rec, 'copy_ms'):.1f} | {wmed(rec, 'stage_ms') if 'stage_ms' in ups[0] else 0:.1f} | "
                f"{wmed(rec, 'control_ms'):.1f} | {commit} | "
                f"{ups[0].get('handles_opened')} / {','.join(map(str, warm_handles))} | {mib(trainer)} | {mib(worker)} | "
                f"{'yes' if rec.get('verified') else 'NO'} |"
            )
        out.append("")
    return "\n".join(out)


def ww_breakdown(doc: dict[str, Any], model: str) -> str:
    """Where a weightwire update's time goes, from both processes' clocks."""
    keys = [
        ("recheck_ms", "GetStatus re-check"),
        ("plan_ms", "client checks + plan"),
        ("pre_ms", "push() → header at worker"),
        ("begin_ms", "header (begin_update)"),
        ("bucket_ms", "worker: whole bucket"),
        ("open_ms", "  of which open"),
        ("copy_ms", "  of which load (copies + sync)"),
        ("stage_ms", "trainer staging (pack + wait)"),
        ("commit_ms", "commit"),
        ("post_ms", "commit done → push() returns"),
        ("total_ms", "total"),
    ]
    rows = [rec for rec in sorted_cases(doc, model) if rec["case"].startswith("ww_") and "updates" in rec]
    out = [
        "| ms (median of warm updates) | "
        + " | ".join(label(r).removeprefix("weightwire ") for r in rows)
        + " |"
    ]
    out.append("|" + " --- |" * (len(rows) + 1))
    for key, name in keys:
        out.append(f"| {name} | " + " | ".join(f"{wmed(r, key):.2f}" for r in rows) + " |")
    return "\n".join(out)


def gpu_targets(doc: dict[str, Any], model: str) -> str:
    lim = limits(doc, model)
    by = {
        (r["case"], r.get("variant")): r for r in doc["cases"] if r.get("model") == model and "updates" in r
    }

    def t(case: str, variant: str) -> float:
        r = by.get((case, variant))
        return wmed(r, "total_ms") if r else float("nan")

    inplace = t("ww_inplace", "whole")
    packed = {v: t("ww_packed", v) for (c, v) in by if c == "ww_packed"}
    best_b, best_packed = min(packed.items(), key=lambda kv: kv[1])
    two = lim.get(f"two_copies_{best_b}_ms", float("nan"))
    pt, batch = t("per_tensor", "per_tensor"), t("per_tensor", "batch")
    peer = t("ww_peer", "whole")
    rows = [
        (
            "in place ≤ 1.15 × copy + 3 ms",
            f"{1.15 * lim['d2d_flat_ms'] + 3:.1f} ms",
            f"{inplace:.1f} ms",
            inplace <= 1.15 * lim["d2d_flat_ms"] + 3,
        ),
        (
            f"packed ≤ 1.15 × two copies (best: {best_b} buckets)",
            f"{1.15 * two:.1f} ms",
            f"{best_packed:.1f} ms",
            best_packed <= 1.15 * two,
        ),
        (
            "≥ 10 × faster than one handle per tensor (per-tensor messages)",
            "≥ 10 ×",
            f"{pt / inplace:.1f} ×",
            pt / inplace >= 10,
        ),
        (
            "≥ 10 × faster than one handle per tensor (one message)",
            "≥ 10 ×",
            f"{batch / inplace:.1f} ×",
            batch / inplace >= 10,
        ),
    ]
    if "peer_flat_ms" in lim:
        rows.append(
            (
                "peer GPU ≤ 1.15 × NVLink copy",
                f"{1.15 * lim['peer_flat_ms']:.1f} ms",
                f"{peer:.1f} ms",
                peer <= 1.15 * lim["peer_flat_ms"],
            )
        )
    out = ["| target | bound | measured | met |", "| --- | --- | --- | --- |"]
    out += [f"| {a} | {b} | {c} | {'yes' if ok else '**no**'} |" for a, b, c, ok in rows]
    return "\n".join(out)


def memory_table(doc: dict[str, Any], model: str) -> str:
    out = [
        "| case | trainer peak extra | after the updates (pusher open) | after pusher.close() | after the worker dropped its mappings | worker peak extra | worker after |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rec in sorted_cases(doc, model):
        if not rec["case"].startswith("ww_") or "memory" not in rec:
            continue
        m = rec["memory"]
        tr = m.get("trainer_gpu1" if rec["case"] == "ww_peer" else "trainer_gpu0", {})
        wk = m.get("worker", {})
        out.append(
            f"| {label(rec).removeprefix('weightwire ')} | {mib(tr.get('peak_extra'))} MiB | {mib(tr.get('after_updates'))} MiB | "
            f"{mib(tr.get('after_close'))} MiB | {mib(tr.get('after_worker_release'))} MiB | {mib(wk.get('peak_extra'))} MiB | "
            f"{mib(wk.get('after_updates'))} MiB |"
        )
    return "\n".join(out)


def ckpt_table(doc: dict[str, Any]) -> str:
    out = [
        "| model | buckets | until last bucket loaded | until last ack (after its release step) | receiver returned (total) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rec in doc["cases"]:
        if rec["case"] != "ckpt_engine" or "updates" not in rec:
            continue
        out.append(
            f"| {rec['model']} | {rec['variant']} | {wmed(rec, 'until_loaded_ms'):.1f} ms | {wmed(rec, 'until_last_ack_ms'):.1f} ms | "
            f"{wmed(rec, 'total_ms'):.1f} ms |"
        )
    return "\n".join(out)


def gpu_plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [
        m
        for m in dict.fromkeys(r["model"] for r in doc["cases"])
        if limits(doc, m) and limits(doc, m)["bytes"] > 64 * MiB
    ]
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 5.2 * len(models)), squeeze=False)
    parts = [
        ("open_ms", "open handles", "#d62728"),
        ("copy_ms", "copy into the model (worker)", "#1f77b4"),
        ("stage_ms", "staging: pack + wait (trainer)", "#ff7f0e"),
        ("control_ms", "control: gRPC / pickle / ZMQ, checks, release", "#9e9e9e"),
    ]
    for ax, model in zip(axes[:, 0], models, strict=True):
        lim = limits(doc, model)
        rows = [r for r in sorted_cases(doc, model) if "updates" in r]
        names = [
            label(r)
            .replace("checkpoint-engine receiver", "checkpoint-engine")
            .replace("one IPC handle per tensor", "handle per tensor")
            for r in rows
        ]
        y = list(range(len(rows)))
        left = [0.0] * len(rows)
        for key, name, color in parts:
            vals = [max(0.0, wmed(r, key)) if key in r["updates"][0] else 0.0 for r in rows]
            ax.barh(y, vals, left=left, color=color, label=name)
            left = [a + b for a, b in zip(left, vals, strict=True)]
        for i, r in enumerate(rows):
            ax.text(left[i], i, f" {wmed(r, 'total_ms'):.1f}", va="center", fontsize=8)
        ax.axvline(
            lim["d2d_flat_ms"],
            color="k",
            ls="--",
            lw=1,
            label=f"limit: one device copy, {lim['d2d_flat_ms']:.1f} ms",
        )
        ax.axvline(
            1.15 * lim["d2d_flat_ms"] + 3,
            color="k",
            ls=":",
            lw=1,
            label="target for in place: 1.15 × limit + 3 ms",
        )
        if "peer_flat_ms" in lim:
            ax.axvline(
                lim["peer_flat_ms"],
                color="g",
                ls="--",
                lw=1,
                label=f"limit for peer: NVLink copy, {lim['peer_flat_ms']:.1f} ms",
            )
        ax.set_xlim(0, max(left) * 1.12)
        ax.set_yticks(y)
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per update (median of warm updates)")
        ax.set_title(
            f"{model} ({lim['bytes'] / GiB:.2f} GiB bf16): trainer and receiver in separate processes on one H200",
            fontsize=10,
        )
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------


def cpu_shm_table(doc: dict[str, Any]) -> str:
    """Best (median) of each measure: the CPU machines are shared, so the best run is the one least
    disturbed; ratios compare best with best, and the copy limit is the faster of the flat and the
    per-tensor copy (torch's threaded flat copy is not always the faster one)."""
    out = [
        "| model | MiB | memcpy (one flat copy) | per-tensor copies | pack + unpack | weightwire in place | in place ÷ best copy | weightwire packed | packed ÷ pack+unpack | exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def cell(vals: list[float]) -> str:
        return f"{min(vals):.1f} ({med(vals):.1f}) ms" if vals else "–"

    for rec in doc["cases"]:
        if rec.get("case") != "limit":
            continue
        model = rec["model"]
        ww = {
            r["case"]: r
            for r in doc["cases"]
            if r.get("model") == model and r.get("bench") == "shm" and "updates" in r
        }
        ip = [u["total_ms"] for u in warm(ww["ww_inplace"])] if "ww_inplace" in ww else []
        pk = [u["total_ms"] for u in warm(ww["ww_packed"])] if "ww_packed" in ww else []
        ok = all(r.get("verified") for r in ww.values())
        flat, two = rec["memcpy_flat_ms"], rec["two_copies_ms"]
        out.append(
            f"| {model} | {rec['bytes'] / MiB:.0f} | {cell(flat)} | {cell(rec['memcpy_per_tensor_ms'])} | {cell(two)} | {cell(ip)} | "
            f"{min(ip) / min(flat + rec['memcpy_per_tensor_ms']):.1f} | {cell(pk)} | {min(pk) / min(two) if pk else float('nan'):.1f} | {'yes' if ok else 'NO'} |"
        )
    return "\n".join(out)


def scaling_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in doc["cases"] if r.get("bench") == "scaling" and "updates" in r]


def cpu_scaling_table(doc: dict[str, Any]) -> str:
    rows = scaling_rows(doc)
    out = [
        "| model | workers are | mode | workers | ms per update, best (median) | GB into workers per update | aggregate GB/s (best) | slowest worker's load ms | control ms | exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: (r["model"], r.get("layout", ""), r["case"], r["workers"])):
        total = min(u["total_ms"] for u in warm(r))
        tp = r.get("layout") == "tp"
        # bytes_loaded counts the full tensors a worker received; a TP worker copies only its slice.
        nbytes = r["bytes_model"] if tp else med(u["bytes"] for u in warm(r))
        control = wmed(r, "control_ms")
        out.append(
            f"| {r['model']} | {'TP shards' if tp else 'replicas'} | {r['case'].removeprefix('ww_').replace('inplace', 'in place')} | "
            f"{r['workers']} | {total:.1f} ({wmed(r, 'total_ms'):.1f}) | {nbytes / 1e9:.2f} | {nbytes / 1e9 / (total / 1e3):.1f} | {wmed(r, 'copy_ms'):.1f} | "
            f"{f'{control:.1f}' if control >= 0 else 'overlapped'} | {'yes' if r.get('verified') else 'NO'} |"
        )
    return "\n".join(out)


def cpu_plots(docs: dict[str, dict[str, Any]], shm_path: Path, scaling_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(docs), figsize=(6.5 * len(docs), 4.6), squeeze=False)
    for ax, (name, doc) in zip(axes[0], docs.items(), strict=True):
        lims = [r for r in doc["cases"] if r.get("case") == "limit"]
        xs = [r["bytes"] / MiB for r in lims]
        series = {
            "memcpy (one flat copy)": [min(r["memcpy_flat_ms"]) for r in lims],
            "per-tensor copies": [min(r["memcpy_per_tensor_ms"]) for r in lims],
            "pack + unpack": [min(r["two_copies_ms"]) for r in lims],
        }
        for kind in ("ww_inplace", "ww_packed"):
            vals = []
            for r in lims:
                m = [
                    c
                    for c in doc["cases"]
                    if c.get("model") == r["model"]
                    and c.get("bench") == "shm"
                    and c["case"] == kind
                    and "updates" in c
                ]
                vals.append(min(u["total_ms"] for u in warm(m[0])) if m else float("nan"))
            series[f"weightwire {kind.removeprefix('ww_').replace('inplace', 'in place')} (host shm)"] = vals
        for (label_, ys), style in zip(series.items(), ["k--", "k:", "k-.", "bo-", "rs-"], strict=True):
            ax.plot(xs, ys, style, label=label_)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("model size (MiB, bf16)")
        ax.set_ylabel("ms per update (best run: the machine is shared)")
        ax.set_title(f"host shared memory vs memcpy, one worker — {name}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(shm_path, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(docs), figsize=(6.5 * len(docs), 4.6), squeeze=False)
    for ax, (name, doc) in zip(axes[0], docs.items(), strict=True):
        rows = scaling_rows(doc)
        groups = sorted({(r["model"], r.get("layout"), r["case"]) for r in rows})
        for model, layout, case in groups:
            rs = sorted(
                (r for r in rows if (r["model"], r.get("layout"), r["case"]) == (model, layout, case)),
                key=lambda r: r["workers"],
            )
            ax.plot(
                [r["workers"] for r in rs],
                [min(u["total_ms"] for u in warm(r)) for r in rs],
                "o-",
                label=f"{model} {'replicas' if layout == 'dp' else 'TP shards'}, {case.removeprefix('ww_').replace('inplace', 'in place')}",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([1, 2, 4, 8, 16])
        ax.set_xticklabels(["1", "2", "4", "8", "16"])
        ax.set_xlabel("workers (processes)")
        ax.set_ylabel("ms per update (best warm update)")
        ax.set_title(f"one trainer to N workers — {name}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(scaling_path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", default=str(RESULTS / "gpu-h200x2"))
    p.add_argument("--cpu", default=f"{RESULTS / 'cpu-2core'},{RESULTS / 'cpu-32core'}")
    p.add_argument("--plots", action="store_true")
    args = p.parse_args(argv)
    gpu_dir = Path(args.gpu)
    if (gpu_dir / "gpu_results.json").exists():
        doc = load(gpu_dir, "gpu_results.json")
        print(f"## GPU ({gpu_dir.name})\n")
        print(gpu_tables(doc))
        for model in ("qwen3-8b", "qwen2.5-0.5b"):
            if limits(doc, model):
                print(f"\n### Targets, {model}\n\n" + gpu_targets(doc, model))
                print(f"\n### Breakdown, {model}\n\n" + ww_breakdown(doc, model))
                print(f"\n### Memory, {model}\n\n" + memory_table(doc, model))
        print("\n### checkpoint-engine phases\n\n" + ckpt_table(doc))
        if args.plots:
            gpu_plot(doc, HERE / "gpu.png")
    cpu_docs: dict[str, dict[str, Any]] = {}
    for folder in [Path(x) for x in args.cpu.split(",") if x]:
        if (folder / "cpu_results.json").exists():
            doc = load(folder, "cpu_results.json")
            env = doc["env"]
            name = f"{env.get('cpu_count')} cores"
            cpu_docs[name] = doc
            print(
                f"\n## CPU ({folder.name}: {env.get('cpu_count')} × {env.get('cpu_model')}, {env.get('mem_total_gib')} GiB)\n"
            )
            print(cpu_shm_table(doc))
            print()
            print(cpu_scaling_table(doc))
    if args.plots and cpu_docs:
        cpu_plots(cpu_docs, HERE / "cpu_shm.png", HERE / "cpu_scaling.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
