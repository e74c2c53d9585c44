"""``weightwire demo`` (what ``make demo`` runs): the whole system on this machine.

Starts a TP x PP engine of ``weightwire serve --model demo`` worker processes, pushes several
versions of the demo checkpoint from this process (the trainer), checks every worker's parameters
bit for bit against ``expected_shard`` (from the dump files the workers write after each commit),
shows a bucket labelled with a device that is not the workers' being refused while the version
stays, prints a per-worker table and exits non-zero if anything is off. Workers and shared-memory
segments are always cleaned up, also on Ctrl-C, and the workers die with this process.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from weightwire.core import cli_common, cli_types
from weightwire.core.transports.shm import SHM_DIR

LISTENING_PREFIX = "weightwire-serve listening "


def add_parser(subparsers: Any) -> None:
    p = cli_common.add_command(
        subparsers,
        "demo",
        run,
        "run a TP x PP engine of demo workers on this machine, push versions and verify every shard",
    )
    cli_common.add_count(p, "--tp", "tensor-parallel size (default 2)", default=2)
    cli_common.add_count(
        p, "--pp", "pipeline-parallel size (default 2; the demo model has 4 layers)", default=2
    )
    cli_common.add_count(p, "--versions", "how many versions to push (default 3)", default=3)
    cli_common.add_device(p, "where workers and trainer tensors live")
    p.add_argument(
        "--bucket-kb",
        dest="bucket_bytes",
        type=cli_types.size(1024, "KiB", max_bytes=2**30),
        default=64 * 1024,
        metavar="KB",
        help="staging bucket size in KiB (default 64: small, to show several buckets)",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (dump files, worker logs)"
    )


# --------------------------------------------------------------------------------------------
# Worker processes
# --------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the demo process dies (even by SIGKILL)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalWorkers:
    """``weightwire serve`` subprocesses in their own sessions (Ctrl-C reaches only the demo, which
    then stops them in order); each one's stderr goes to a log file in ``workdir``."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[str]] = []
        self.addresses: list[str] = []
        self.logs: list[str] = []

    def start(self, argv_list: Sequence[Sequence[str]], timeout_s: float = 120.0) -> list[str]:
        lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
        for i, argv in enumerate(argv_list):
            log_path = os.path.join(self.workdir, f"worker{i}.log")
            self.logs.append(log_path)
            with open(log_path, "w", encoding="utf-8") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "weightwire.client.cli.main", "serve", *argv],
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    start_new_session=True,
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            self.procs.append(proc)
            threading.Thread(target=_first_line, args=(i, proc, lines), daemon=True).start()
        self.addresses = [""] * len(argv_list)
        deadline = time.monotonic() + timeout_s
        missing = set(range(len(argv_list)))
        while missing:
            try:
                i, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    f"workers {sorted(missing)} did not start within {timeout_s:g} s"
                ) from None
            if line is None or not line.startswith(LISTENING_PREFIX):
                raise RuntimeError(f"worker {i} exited before listening; its log:\n{self.log_tail(i)}")
            self.addresses[i] = line[len(LISTENING_PREFIX) :].strip()
            missing.discard(i)
        return list(self.addresses)

    def log_tail(self, i: int, lines: int = 20) -> str:
        with contextlib.suppress(OSError), open(self.logs[i], encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
        return ""

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _first_line(i: int, proc: subprocess.Popen[str], out: queue.Queue[tuple[int, str | None]]) -> None:
    line = proc.stdout.readline() if proc.stdout is not None else ""
    out.put((i, line or None))
    # Keep draining so a chatty worker never blocks on a full pipe.
    if proc.stdout is not None:
        for _ in proc.stdout:
            pass


# --------------------------------------------------------------------------------------------
# The demo
# --------------------------------------------------------------------------------------------


class _Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def ok(self, cond: bool, what: str) -> bool:
        if not cond:
            self.failures.append(what)
            print(f"  FAIL  {what}")
        return cond


def _say(msg: str) -> None:
    print(msg, flush=True)


def layout_problem(tp: int, pp: int) -> str | None:
    """Why the demo model cannot be served as TP=tp x PP=pp (more stages than layers, a TP size
    that does not divide its sizes), found before any worker starts; None when it can."""
    import torch
    from weightwire.adapters.torch.demo import DemoConfig, DemoModel
    from weightwire.core.manifest import ParallelRank

    config = DemoConfig()
    for p in range(pp):
        for t in range(tp):
            try:
                DemoModel(
                    config, ParallelRank(tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp), torch.device("meta")
                )
            except ValueError as e:
                return f"the demo model ({config.num_layers} layers) cannot run as TP={tp} x PP={pp}: {e}"
    return None


def run(args: argparse.Namespace) -> int:
    """Start worker processes for a TP x PP layout of the demo model, push several versions, verify
    every worker's parameters, show a mislabelled payload being refused."""
    problem = layout_problem(args.tp, args.pp)
    if problem is not None:
        print(f"weightwire demo: {problem}", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="weightwire-demo-")
    workers = LocalWorkers(workdir)
    pusher_box: list[Any] = []  # filled as soon as the pusher exists, so cleanup always sees it
    code = 1
    try:
        code = _demo(args, workdir, workers, pusher_box)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping workers and removing shared memory", file=sys.stderr)
        code = 130
    except Exception as e:  # the demo reports, cleans up and fails; it never leaves workers behind
        print(f"weightwire demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    finally:
        for pusher in pusher_box:
            with contextlib.suppress(Exception):
                pusher.close()
        workers.stop()
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return code


def _demo(args: argparse.Namespace, workdir: str, workers: LocalWorkers, pusher_box: list[Any]) -> int:
    from weightwire.adapters.torch.demo import DemoConfig, expected_shard, full_checkpoint
    from weightwire.client.cli.tables import LATENCY_NOTE, format_table, human_bytes, rate, short_device
    from weightwire.client.inputs.plan import PlanError, TensorSpec, layout_flat, pack_into
    from weightwire.client.push.pusher import GatheredBucket, WeightPusher
    from weightwire.core.devices import DeviceRef
    from weightwire.core.errors import PushError
    from weightwire.v1 import weight_transfer_pb2 as pb

    config = DemoConfig()
    checks = _Checks()
    stage_device = _stage_device(args.device)
    dump_dir = os.path.join(workdir, "dumps")
    _say(
        f"weightwire demo: TP={args.tp} x PP={args.pp} engine of the demo model ({config.num_layers} layers) on "
        f"{args.device}, {args.versions} versions pushed from this process"
    )

    argv = []
    for pp in range(args.pp):
        for tp in range(args.tp):
            argv.append(
                [
                    "--model",
                    "demo",
                    "--tp-rank",
                    str(tp),
                    "--tp-size",
                    str(args.tp),
                    "--pp-rank",
                    str(pp),
                    "--pp-size",
                    str(args.pp),
                    "--seed",
                    "0",
                    "--device",
                    args.device,
                    "--dump-dir",
                    dump_dir,
                    "--log-level",
                    "WARNING",
                ]
            )
    t0 = time.monotonic()
    addresses = workers.start(argv)
    _say(
        f"started {len(addresses)} worker processes in {time.monotonic() - t0:.1f} s (dumps and logs in {workdir})"
    )

    pusher = WeightPusher(addresses, bucket_size_bytes=args.bucket_bytes, timeout_s=30.0)
    pusher_box.append(pusher)
    manifests = pusher.manifests()
    _say("")
    _say(
        format_table(
            ("worker", "device", "ranks", "layers", "tensors owned", "bytes owned"),
            [
                (
                    m.worker_id,
                    short_device(m.device.kind, m.device.uuid),
                    m.rank.short(),
                    f"[{m.layer_start},{m.layer_end})",
                    len(m.tensors),
                    human_bytes(m.total_bytes),
                )
                for m in manifests.values()
            ],
            right=(4, 5),
        )
    )
    _say("")

    last: dict[str, Any] = {}
    for version in range(1, args.versions + 1):
        full = full_checkpoint(config, seed=version)
        named = {k: v.to(stage_device) for k, v in full.items()}
        t0 = time.monotonic()
        results = pusher.push(named, version=version)
        ms = (time.monotonic() - t0) * 1e3
        last = results
        exact = _verify(checks, dump_dir, manifests, full, version, config, expected_shard)
        buckets = sum(r.buckets for r in results.values())
        _say(
            f"v{version}: {len(full)} tensors -> {len(results)} workers in {ms:.1f} ms "
            f"({buckets} bucket sends, transport {next(iter(results.values())).transport}); "
            f"{exact}/{len(manifests)} shards bit-exact vs expected_shard"
        )

    # A mislabelled bucket: real bytes of the next version, labelled with a device that is not any
    # worker's (another machine's boot id, a GPU that is not on this host). It must be refused.
    bad_version = args.versions + 1
    full = full_checkpoint(config, seed=bad_version)
    specs, size = layout_flat(list(full.items()))
    foreign_host = DeviceRef.host(str(uuid.uuid4()))
    foreign_gpu = DeviceRef.cuda(str(uuid.uuid4()))
    buf = pusher.host_buffer(size)
    pack_into(buf, specs, list(full.values()))
    fake_shm = pusher.export_payload(buf)  # real shared memory with the right bytes...
    fake_shm.device.CopyFrom(foreign_host.to_proto())  # ...under another machine's label
    fake_gpu = pb.Payload(
        device=foreign_gpu.to_proto(),
        size_bytes=size,
        cuda_ipc=pb.CudaIpcHandle(
            memory_handle=b"\0" * 64, storage_size_bytes=size, ref_counter_handle=b"/torch_1_elsewhere"
        ),
    )
    bucket = GatheredBucket(
        [TensorSpec(s.name, s.dtype, s.shape, s.offset_bytes) for s in specs], [fake_shm, fake_gpu], size
    )
    _say("")
    _say(f"injected mismatch: v{bad_version} in a bucket labelled only {foreign_host} and {foreign_gpu}")
    try:
        pusher.push_gathered([bucket], version=bad_version)
        checks.ok(False, "the client accepted a bucket with no payload for the workers' device")
    except PlanError as e:
        checks.ok(e.reason == "NO_PAYLOAD_FOR_DEVICE", f"client refuses before sending: {e.reason}")
        _say(f"  client refuses it before sending anything: {e.reason}")
    try:
        pusher.push_gathered([bucket], version=bad_version, precheck_labels=False)
        checks.ok(False, "the workers accepted a bucket with no payload for their device")
    except PushError as e:
        reasons = {a: err.reason for a, err in e.failures.items()}
        checks.ok(
            "NO_PAYLOAD_FOR_DEVICE" in reasons.values(),
            f"workers refuse it with NO_PAYLOAD_FOR_DEVICE (got {reasons})",
        )
        checks.ok(not e.results, "no worker committed the mislabelled update")
        for addr, err in e.failures.items():
            _say(f"  {manifests[addr].worker_id}: {err.code}/{err.reason}: {err.message.splitlines()[0]}")
    statuses = pusher.status()
    for addr, st in statuses.items():
        checks.ok(
            st.weights_version == args.versions and st.state == pb.WORKER_STATE_CONSISTENT,
            f"{manifests[addr].worker_id} stays at v{args.versions}, CONSISTENT "
            f"(is v{st.weights_version}, {pb.WorkerState.Name(st.state)})",
        )
        checks.ok(
            not os.path.exists(
                os.path.join(dump_dir, f"{manifests[addr].worker_id}-v{bad_version}.safetensors")
            ),
            f"{manifests[addr].worker_id} wrote no v{bad_version} state",
        )
    _say(
        f"  every worker is still at v{args.versions} and CONSISTENT"
        if all(
            st.weights_version == args.versions and st.state == pb.WORKER_STATE_CONSISTENT
            for st in statuses.values()
        )
        else "  some worker moved: see FAIL lines"
    )

    _say("")
    rows = []
    for addr, m in manifests.items():
        r = last[addr]
        st = statuses[addr]
        rows.append(
            (
                m.worker_id,
                short_device(m.device.kind, m.device.uuid),
                m.rank.tp_rank,
                m.rank.pp_rank,
                len(m.tensors),
                r.tensors_loaded,
                human_bytes(r.bytes_loaded),
                f"{r.duration_s * 1e3:.1f}",
                rate(r.bytes_loaded, r.gbps),
                f"v{st.weights_version}",
                pb.WorkerState.Name(st.state).removeprefix("WORKER_STATE_"),
            )
        )
    _say(
        format_table(
            ("worker", "device", "tp", "pp", "owned", "loaded", "bytes", "ms", "GB/s", "version", "state"),
            rows,
            right=(2, 3, 4, 5, 6, 7, 8),
        )
    )
    if any(row[8] == "-" for row in rows):
        _say(LATENCY_NOTE)

    pusher.close()
    leftovers = (
        [n for n in os.listdir(SHM_DIR) if n.startswith(f"ww-{os.getpid()}-")]
        if os.path.isdir(SHM_DIR)
        else []
    )
    checks.ok(not leftovers, f"no shared-memory segments left behind ({leftovers})")
    _say("")
    if checks.failures:
        _say(f"demo FAILED: {len(checks.failures)} check(s) off")
        return 1
    _say("demo OK: every shard verified, the mislabelled update was refused and nothing moved")
    return 0


def _verify(
    checks: _Checks,
    dump_dir: str,
    manifests: dict[str, Any],
    full: dict[str, Any],
    version: int,
    config: Any,
    expected_shard: Callable[..., dict[str, Any]],
) -> int:
    import torch
    from safetensors.torch import load_file

    exact = 0
    for m in manifests.values():
        path = os.path.join(dump_dir, f"{m.worker_id}-v{version}.safetensors")
        if not checks.ok(os.path.exists(path), f"{m.worker_id} wrote its v{version} state"):
            continue
        got = load_file(path)
        want = expected_shard(full, m.rank, config)
        same_names = checks.ok(
            set(got) == set(want), f"{m.worker_id} v{version} holds exactly its shard's tensors"
        )
        wrong = [n for n in want if n in got and not torch.equal(got[n], want[n])]
        checks.ok(not wrong, f"{m.worker_id} v{version} parameters equal expected_shard (wrong: {wrong[:5]})")
        exact += int(same_names and not wrong)
    return exact


def _stage_device(device: str) -> Any:
    """Where the trainer's tensors live. With ``--device cuda`` the pusher picks CUDA IPC
    (``weightwire.client.transports.cuda_ipc``) for the CUDA workers on this GPU."""
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but no CUDA GPU is visible to this process")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
