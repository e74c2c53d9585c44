"""Who may talk to a worker: the private Unix socket, the refusal to listen on a non-loopback
address without a token, bearer tokens (MISSING_TOKEN / INVALID_TOKEN) and TLS with a CA made here.

Traffic only ever goes to 127.0.0.1 or a Unix socket. The non-loopback addresses below are only
passed to ``serve``/``weightwire serve`` to check that they refuse before binding anything.
"""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess
import sys
from collections.abc import Callable

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from weightwire.adapters.torch.demo import full_checkpoint
from weightwire.client import WeightPusher
from weightwire.core.errors import PushError
from weightwire.server import serve
from weightwire.v1 import weight_transfer_pb2 as pb
from weightwire.v1 import weight_transfer_pb2_grpc as pb_grpc

from .common import (
    CHANNEL_OPTIONS,
    assert_weightwire_error,
    demo_adapter,
    error_info,
    inline_update,
    push_raw,
    rpc_error_of,
    serve_command,
    start_worker,
)
from .tls import make_self_signed

TOKEN = "tok-7f3a9c1e"  # a test value, never a real secret
NON_LOOPBACK = ["0.0.0.0:0", "[::]:0", ":0", "worker.example.invalid:0"]


def _code_and_reason(err: grpc.RpcError) -> tuple[grpc.StatusCode, str | None]:
    info, n = error_info(err)
    assert n == 1
    return err.code(), (info.reason if info else None)


def test_default_listener_is_a_unix_socket_in_a_private_directory(
    inproc_worker: Callable[..., object],
) -> None:
    worker = inproc_worker()
    address: str = worker.address  # type: ignore[attr-defined]
    assert address.startswith("unix:")
    sock = address.removeprefix("unix:")
    directory = os.path.dirname(sock)
    st = os.stat(directory)
    assert stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)
    assert st.st_uid == os.geteuid()
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    # and it serves there
    stub = pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(address))
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=30).weights_version == 0
    worker.server.stop(grace=0)  # type: ignore[attr-defined]
    assert not os.path.exists(directory), "the private directory is removed when the worker stops"


def test_cli_default_listener_is_private_too() -> None:
    w = start_worker()
    try:
        assert w.address.startswith("unix:")
        directory = os.path.dirname(w.address.removeprefix("unix:"))
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert w.stub().GetManifest(pb.GetManifestRequest(), timeout=30).manifest.worker_id == "tp0-pp0"
    finally:
        w.stop()


@pytest.mark.parametrize("listen", NON_LOOPBACK)
def test_non_loopback_without_token_refuses_to_start(listen: str) -> None:
    with pytest.raises(ValueError, match="token"):
        serve(demo_adapter(), listen=listen)


def test_cli_non_loopback_without_token_exits_before_listening() -> None:
    proc = subprocess.run(
        serve_command(listen="0.0.0.0:0"),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    assert "listening" not in proc.stdout
    assert "token" in proc.stderr and "0.0.0.0:0" in proc.stderr, proc.stderr[-2000:]


def test_tokens(inproc_worker: Callable[..., object]) -> None:
    worker = inproc_worker(listen="127.0.0.1:0", token=TOKEN)
    address: str = worker.address  # type: ignore[attr-defined]
    assert address.startswith("127.0.0.1:")
    stub = pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
    good = (("authorization", f"Bearer {TOKEN}"),)

    for method, request in (("GetManifest", pb.GetManifestRequest()), ("GetStatus", pb.GetStatusRequest())):
        call = getattr(stub, method)
        assert _code_and_reason(rpc_error_of(call, request, timeout=30)) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "MISSING_TOKEN",
        )
        for bad in (f"Bearer {TOKEN}x", TOKEN, f"bearer {TOKEN}", "Bearer ", f"Basic {TOKEN}"):
            err = rpc_error_of(call, request, timeout=30, metadata=(("authorization", bad),))
            assert _code_and_reason(err) == (grpc.StatusCode.UNAUTHENTICATED, "INVALID_TOKEN"), bad
        call(request, timeout=30, metadata=good)

    # a push with a wrong token loads nothing and leaves the version alone
    config = worker.config  # type: ignore[attr-defined]
    owned = worker.adapter.manifest().tensors  # type: ignore[attr-defined]
    full = full_checkpoint(config, seed=3)
    update = inline_update({n: full[n] for n in owned}, 1)
    before = worker.state()  # type: ignore[attr-defined]
    for whole in (False, True):  # on a PushWeights stream, and as one PushUpdate call
        outcome = push_raw(stub, update, metadata=(("authorization", "Bearer nope"),), whole=whole)
        assert_weightwire_error(outcome, "INVALID_TOKEN")
        assert not outcome.responses
        assert_weightwire_error(push_raw(stub, update, whole=whole), "MISSING_TOKEN")
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=30, metadata=good).weights_version == 0
    after = worker.state()  # type: ignore[attr-defined]
    assert all(torch.equal(before[n], after[n]) for n in owned)

    # health checks stay open (probes carry no secrets) and say SERVING
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    assert (
        health.Check(health_pb2.HealthCheckRequest(), timeout=30).status
        == health_pb2.HealthCheckResponse.SERVING
    )

    # the client: a wrong token fails naming the worker and the reason; the right one pushes
    with WeightPusher([address], token="wrong") as pusher, pytest.raises(PushError) as exc:
        pusher.push(full, version=1, allow_unowned=True)
    assert exc.value.failures[address].reason == "INVALID_TOKEN"
    with WeightPusher([address], token=TOKEN) as pusher:
        results = pusher.push({n: full[n] for n in owned}, version=1)
    assert results[address].version == 1
    state = worker.state()  # type: ignore[attr-defined]
    assert all(torch.equal(state[n], full[n]) for n in owned)


def test_tls_with_a_self_signed_ca(inproc_worker: Callable[..., object], tmp_path: pathlib.Path) -> None:
    tls = make_self_signed(tmp_path / "tls")
    worker = inproc_worker(
        listen="127.0.0.1:0", token=TOKEN, tls_cert=str(tls.server_cert), tls_key=str(tls.server_key)
    )
    address: str = worker.address  # type: ignore[attr-defined]
    good = (("authorization", f"Bearer {TOKEN}"),)

    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca_cert.read_bytes())
    stub = pb_grpc.WeightTransferServiceStub(grpc.secure_channel(address, creds))
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=30, metadata=good).weights_version == 0

    # plaintext to a TLS listener, and TLS with a CA that did not sign the server: no connection
    plain = pb_grpc.WeightTransferServiceStub(grpc.insecure_channel(address))
    assert (
        rpc_error_of(plain.GetStatus, pb.GetStatusRequest(), timeout=10, metadata=good).code()
        == grpc.StatusCode.UNAVAILABLE
    )
    other = make_self_signed(tmp_path / "other", ca_name="some other CA")
    stranger = pb_grpc.WeightTransferServiceStub(
        grpc.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=other.ca_cert.read_bytes())
        )
    )
    assert (
        rpc_error_of(stranger.GetStatus, pb.GetStatusRequest(), timeout=10, metadata=good).code()
        == grpc.StatusCode.UNAVAILABLE
    )

    # the client over TLS, token included: a full update lands bit for bit
    config = worker.config  # type: ignore[attr-defined]
    owned = worker.adapter.manifest().tensors  # type: ignore[attr-defined]
    full = full_checkpoint(config, seed=5)
    with WeightPusher([address], token=TOKEN, tls_ca=str(tls.ca_cert), transport="inline") as pusher:
        results = pusher.push({n: full[n] for n in owned}, version=2)
    assert results[address].version == 2
    state = worker.state()  # type: ignore[attr-defined]
    assert all(torch.equal(state[n], full[n]) for n in owned)


def test_cli_tls_worker_inspected_with_grpcurl(tmp_path: pathlib.Path) -> None:
    """`weightwire serve --tls-cert/--tls-key --token` in a real process, seen by grpcurl with the CA."""
    tls = make_self_signed(tmp_path / "tls")
    w = start_worker(
        listen="127.0.0.1:0",
        extra=["--token", TOKEN, "--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key)],
    )
    try:
        grpcurl = str(pathlib.Path(sys.executable).parent / "grpcurl")
        base = [grpcurl, "-cacert", str(tls.ca_cert), "-max-time", "60"]
        ok = subprocess.run(
            [
                *base,
                "-H",
                f"authorization: Bearer {TOKEN}",
                "-emit-defaults",
                "-d",
                "{}",
                w.address,
                "weightwire.v1.WeightTransferService/GetStatus",
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert ok.returncode == 0, ok.stderr
        assert '"state": "WORKER_STATE_CONSISTENT"' in ok.stdout
        denied = subprocess.run(
            [*base, "-d", "{}", w.address, "weightwire.v1.WeightTransferService/GetStatus"],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert denied.returncode == 64 + grpc.StatusCode.UNAUTHENTICATED.value[0], denied.stderr
        assert "MISSING_TOKEN" in denied.stderr
        plain = subprocess.run(
            [grpcurl, "-plaintext", "-max-time", "10", w.address, "list"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert plain.returncode != 0
    finally:
        w.stop()


def test_tls_option_misuse_is_refused(tmp_path: pathlib.Path) -> None:
    tls = make_self_signed(tmp_path / "tls")
    with pytest.raises(ValueError, match="both"):
        serve(demo_adapter(), listen="127.0.0.1:0", tls_cert=str(tls.server_cert))
    with pytest.raises(ValueError, match="TCP"):
        serve(demo_adapter(), tls_cert=str(tls.server_cert), tls_key=str(tls.server_key))
