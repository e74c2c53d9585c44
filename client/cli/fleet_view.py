"""The fleet view: every worker's version, state, last update and last error, polled with GetStatus.

``weightwire status ADDR...`` prints it once; with ``--watch`` it is a live table (``rich.live``)
redrawn in place every ``--interval`` seconds until Ctrl-C (or ``--count`` refreshes); with
``--json`` each refresh is one JSON object on its own line (JSON Lines) for scripts. When stdout is
not a terminal ``--watch`` prints one plain-text table per refresh instead of redrawing, with every
column and the whole error (rich would fit it to 80 columns and drop some).

``poll_statuses`` asks every worker at once; a worker that does not answer is shown as UNREACHABLE
with the reason, and the others are still shown. Called by ``weightwire.client.cli.commands``.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any, TextIO, TypeAlias

import grpc
from google.protobuf import json_format
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text
from weightwire.client.rpc.calls import Worker, error_from_rpc
from weightwire.core.errors import Reason, WeightwireError
from weightwire.v1 import weight_transfer_pb2 as pb

Status: TypeAlias = "pb.GetStatusResponse | WeightwireError"
_STATE_STYLE = {
    "CONSISTENT": "green",
    "UPDATING": "yellow",
    "INCONSISTENT": "bold red",
    "UNREACHABLE": "bold red",
}
# A wide table still has to fit a terminal: the error message is cut, the full one is in --json.
_MAX_ERROR_CHARS = 80


def poll_statuses(
    workers: Sequence[Worker], *, timeout_s: float, metadata: tuple[tuple[str, str], ...]
) -> dict[str, Status]:
    """GetStatus of every worker, concurrently: the response, or the error that came instead."""
    pending = {
        w.address: w.stub.GetStatus.future(pb.GetStatusRequest(), timeout=timeout_s, metadata=metadata)
        for w in workers
    }
    out: dict[str, Status] = {}
    for address, fut in pending.items():
        try:
            out[address] = fut.result()
        except grpc.RpcError as e:
            out[address] = error_from_rpc(e, worker=address, context="GetStatus")
        except futures.CancelledError:
            out[address] = WeightwireError(Reason.CANCELLED, "cancelled", worker=address)
    return out


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def state_of(status: Status) -> str:
    if isinstance(status, WeightwireError):
        return "UNREACHABLE"
    return pb.WorkerState.Name(status.state).removeprefix("WORKER_STATE_")


def healthy(statuses: Mapping[str, Status]) -> bool:
    """Every worker answered and is CONSISTENT."""
    return all(state_of(s) == "CONSISTENT" for s in statuses.values())


def _clock(ts: Any) -> str:
    if not ts.seconds and not ts.nanos:
        return "-"
    return datetime.datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9).strftime("%H:%M:%S")


def last_update(status: pb.GetStatusResponse) -> str:
    """A worker's last committed update as a table cell: version, time, tensors, duration ("-": none)."""
    if not status.HasField("last_result"):
        return "-"
    r = status.last_result
    return f"v{r.version} {_clock(r.finish_time)} {r.tensors_loaded}t {r.duration_ns / 1e6:.1f} ms"


def last_error(status: pb.GetStatusResponse, message: Callable[[str], str] = str) -> str:
    """A worker's last error as a table cell: version, time, reason (its code if it has none) and
    the message, which ``message`` may shorten ("-": none)."""
    if not status.HasField("last_error"):
        return "-"
    e = status.last_error
    return f"v{e.version} {_clock(e.time)} {e.reason or e.code}: {message(e.message)}"


def _ranks(rank: Any) -> str:
    parts = [f"tp{rank.tp_rank}/{rank.tp_size or 1}", f"pp{rank.pp_rank}/{rank.pp_size or 1}"]
    if (rank.dp_size or 1) > 1:
        parts.append(f"dp{rank.dp_rank}/{rank.dp_size}")
    if (rank.sp_size or 1) > 1:
        parts.append(f"sp{rank.sp_rank}/{rank.sp_size}")
    return " ".join(parts)


def _device(device: Any) -> str:
    kind = {pb.DEVICE_KIND_CUDA: "cuda", pb.DEVICE_KIND_HOST: "host"}.get(device.kind, "?")
    return f"{kind}:{device.uuid[:8]}"


def _cut(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


COLUMNS = (
    "worker",
    "address",
    "device",
    "ranks",
    "version",
    "state",
    "last update",
    "ok/failed",
    "mappings",
    "last error",
)
_RIGHT = (4, 7, 8)


def fleet_rows(statuses: Mapping[str, Status], *, cut: bool = True) -> list[tuple[str, ...]]:
    """One row of ``COLUMNS`` per worker; ``cut`` shortens the error message (never its reason)."""

    def message(text: str) -> str:
        return _cut(text) if cut else text

    rows: list[tuple[str, ...]] = []
    for address, s in statuses.items():
        state = state_of(s)
        if isinstance(s, WeightwireError):
            rows.append(
                ("?", address, "-", "-", "-", state, "-", "-", "-", f"{s.reason}: {message(s.message)}")
            )
            continue
        rows.append(
            (
                s.worker_id or "?",
                address,
                _device(s.device),
                _ranks(s.rank),
                str(s.weights_version),
                state,
                last_update(s),
                f"{s.updates_succeeded}/{s.updates_failed}",
                str(s.open_mappings),
                last_error(s, message),
            )
        )
    return rows


def fleet_table(statuses: Mapping[str, Status], *, title: str | None = None) -> Table:
    """The live view's table: ``COLUMNS``, the state coloured, the error message cut to fit."""
    table = Table(title=title, title_justify="left", header_style="bold")
    for i, name in enumerate(COLUMNS):
        table.add_column(name, justify="right" if i in _RIGHT else "left", no_wrap=name != "last error")
    for row in fleet_rows(statuses):
        state = row[5]
        table.add_row(*row[:5], Text(state, style=_STATE_STYLE.get(state, "")), *row[6:])
    return table


def fleet_text(statuses: Mapping[str, Status], *, title: str) -> str:
    """The same table as plain text, every column at its full width and nothing cut: for a pipe or
    a log, where there is no terminal width to fit and a reader wants the whole error."""
    from weightwire.client.cli.tables import format_table

    return title + "\n" + format_table(COLUMNS, fleet_rows(statuses, cut=False), right=_RIGHT)


def fleet_json(statuses: Mapping[str, Status]) -> dict[str, Any]:
    """``{address: GetStatus as JSON (proto field names)}``, or ``{address: {"error": {...}}}``."""
    return {
        a: (
            json_format.MessageToDict(s, preserving_proto_field_name=True)
            if not isinstance(s, WeightwireError)
            else {"error": {"code": s.code, "reason": s.reason, "message": s.message}}
        )
        for a, s in statuses.items()
    }


def _summary(statuses: Mapping[str, Status], interval_s: float) -> str:
    versions = sorted({s.weights_version for s in statuses.values() if not isinstance(s, WeightwireError)})
    states: dict[str, int] = {}
    for s in statuses.values():
        states[state_of(s)] = states.get(state_of(s), 0) + 1
    version = (
        "-"
        if not versions
        else (f"v{versions[0]}" if len(versions) == 1 else "mixed " + ",".join(f"v{v}" for v in versions))
    )
    counts = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    return (
        f"weightwire fleet: {len(statuses)} workers, {counts}; weights {version}   "
        f"{datetime.datetime.now().strftime('%H:%M:%S')}, every {interval_s:g} s (Ctrl-C to stop)"
    )


def watch(
    workers: Sequence[Worker],
    *,
    interval_s: float,
    timeout_s: float,
    metadata: tuple[tuple[str, str], ...],
    as_json: bool = False,
    count: int | None = None,
    out: TextIO | None = None,
) -> int:
    """Poll and redraw until Ctrl-C or ``count`` refreshes; 0 when the last poll was healthy, else 1."""
    out = out if out is not None else sys.stdout
    # A refresh must not wait the whole RPC deadline for a hung worker.
    poll_timeout = min(timeout_s, max(interval_s, 1.0))
    refreshes = 0
    statuses: dict[str, Status] = {}
    live: Live | None = None
    # Decided here, not by rich (which would also believe FORCE_COLOR in a CI log).
    tty = _is_terminal(out)
    console = Console(file=out, force_terminal=tty)
    if not as_json and tty:
        live = Live(console=console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False)
        live.start()
    try:
        while True:
            started = time.monotonic()
            statuses = poll_statuses(workers, timeout_s=poll_timeout, metadata=metadata)
            if as_json:
                line = {
                    "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "workers": fleet_json(statuses),
                }
                out.write(json.dumps(line) + "\n")
                out.flush()
            elif live is not None:
                live.update(fleet_table(statuses, title=_summary(statuses, interval_s)), refresh=True)
            else:
                out.write(fleet_text(statuses, title=_summary(statuses, interval_s)) + "\n\n")
                out.flush()
            refreshes += 1
            if count is not None and refreshes >= count:
                break
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    return 0 if healthy(statuses) else 1
