"""Wake an SGLang scheduler that sleeps on idle when an update step is queued for it.

With ``--sleep-on-idle`` the idle event loop of a replica's lead scheduler (pipeline stage 0,
attention-TP rank 0: the ranks that own an ``IdleSleeper``) blocks in ``zmq.Poller.poll(1000)`` on
its tokenizer and RPC sockets; every other rank of the replica waits in a broadcast (or pipeline
receive) from it. An update step queued from a worker's gRPC thread would therefore wait up to a
second per step, on every rank. This module gives each sleeping scheduler one more thing to poll:
a Unix datagram socket in the abstract namespace (no file, gone with the process). Any worker of
the replica that queues a step sends one empty datagram to every sleeper of its replica; the poll
returns, the loop passes through ``process_input_requests`` (where the plugin drains its tasks)
and broadcasts, so every rank runs its queued step within one loop pass.

The names derive from the engine's weightwire address (socket directory or base port, unique per
engine on a host) and the worker index, so every rank of an engine computes the same names without
talking to the others. Linux only (abstract sockets); on another OS, or for ranks on another host
(multi-node TP), a step simply waits for the next poll timeout.

Used by ``weightwire.adapters.sglang.plugin``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import socket
import sys
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("weightwire.sglang")


def wake_name(engine_key: str, index: int) -> bytes:
    """Abstract socket name of the sleeper with worker index ``index`` of one engine."""
    digest = hashlib.sha256(engine_key.encode()).hexdigest()[:24]
    return f"\0weightwire-wake-{digest}-{index}".encode()


class WakeReceiver:
    """The socket a sleeping scheduler polls; ``drain`` empties it on the scheduler thread."""

    def __init__(self, engine_key: str, index: int) -> None:
        self.name = wake_name(engine_key, index)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(self.name)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> int:
        drained = 0
        while True:
            try:
                self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return drained
            except OSError:
                return drained
            drained += 1

    def close(self) -> None:
        self.sock.close()


class WakeSender:
    """Sends a wake-up to every sleeper of one replica; never blocks, never raises."""

    def __init__(self, engine_key: str, indices: Sequence[int]) -> None:
        self.names = [wake_name(engine_key, i) for i in indices]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)

    def wake(self) -> None:
        for name in self.names:
            # No socket bound under that name (a rank that does not sleep), a full receive buffer
            # (already woken), or a receiver that exited: nothing to do in each case.
            with contextlib.suppress(OSError):
                self.sock.sendto(b"", name)

    def close(self) -> None:
        self.sock.close()


def attach_to_idle_sleeper(scheduler: Any, engine_key: str, index: int) -> WakeReceiver | None:
    """If ``scheduler`` sleeps on idle, bind its wake socket and add it to the sleeper's poller.

    Returns None when it does not sleep (then it never needs waking). A sleeper without a zmq
    poller (an SGLang build whose idle wait is not a poll) is logged: steps then wait for its timeout.
    """
    sleeper = getattr(scheduler, "idle_sleeper", None)
    if sleeper is None:
        return None
    poller = getattr(sleeper, "poller", None)
    if poller is None or not sys.platform.startswith("linux"):
        log.warning(
            "weightwire: this scheduler sleeps on idle (%s) in a way weightwire cannot interrupt; each update "
            "step may wait for its idle timeout (about 1 s). Start SGLang without --sleep-on-idle to avoid it",
            type(sleeper).__name__,
        )
        return None
    import zmq

    receiver = WakeReceiver(engine_key, index)
    poller.register(receiver.fileno(), zmq.POLLIN)
    return receiver
