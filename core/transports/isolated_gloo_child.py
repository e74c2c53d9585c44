"""The gloo receiving process of a worker (``python -m weightwire.core.transports.isolated_gloo_child FD``).

It holds the worker's gloo process groups of one transfer group and carries out, over the control
channel on descriptor FD, what the worker posts: receives (and the few sends of forming) into
shared-memory segments the worker mapped too, each operation reported when it ends. gloo ends the
whole process on some malformed input from a peer (a message longer than the receive posted for
it); here that ends this process only, and the worker refuses the update (``isolated_gloo``).

It starts at the idle scheduling priority where it may leave it again, and goes back to the normal
one when it is taken for a group, a few seconds after its start, and when it forms one
(``idle_priority``).

It ends when the worker hangs up or dies (the channel's end: its command loop runs on a thread
gloo never holds; ``PR_SET_PDEATHSIG`` would fire when the worker's *thread* that started it ends),
and touches no GPU.
"""

from __future__ import annotations

import datetime
import mmap
import os
import queue
import socket
import sys
import threading
import time
from typing import Any


class _Receiver:
    def __init__(self, channel: Any) -> None:
        import torch

        self.torch = torch
        self.channel = channel
        self.segments: dict[int, tuple[mmap.mmap, Any]] = {}
        self.groups: dict[int, Any] = {}
        self.store: Any = None
        self.pending: queue.Queue[tuple[int, Any, float] | None] = queue.Queue()
        threading.Thread(target=self._report, name="ww-isolated-wait", daemon=True).start()

    # --- commands ------------------------------------------------------------------------------

    def run(self) -> None:
        from weightwire.core.transports.isolated_gloo_channel import ChannelClosed

        self.channel.send({"ready": os.getpid()})
        while True:
            try:
                message, fds = self.channel.recv()
            except ChannelClosed:
                os._exit(0)
            kind = message.get("do")
            if kind == "segment":
                self._segment(message, fds)
            elif kind == "form":
                self._form(message)
            elif kind == "posts":
                for post in message["posts"]:
                    self._post(post)
            elif kind == "close":
                pg = self.groups.pop(int(message["group"]), None)
                del pg  # its sockets close: peers' operations on it fail at once

    def _segment(self, message: dict[str, Any], fds: list[int]) -> None:
        size = int(message["size"])
        mm = mmap.mmap(fds[0], size)
        os.close(fds[0])
        self.segments[int(message["segment"])] = (mm, self.torch.frombuffer(mm, dtype=self.torch.uint8))

    def _form(self, message: dict[str, Any]) -> None:
        from weightwire.core.transports.idle_priority import foreground

        foreground(os.getpid())  # gloo's threads, started here, take this thread's priority
        torch = self.torch
        from weightwire.core.transports.transfer_group import BACKENDS, backend_message
        from weightwire.core.transports.transfer_group_store import connect_store
        from weightwire.v1 import weight_transfer_pb2 as pb

        try:
            timeout_s = float(message["timeout_s"])
            if self.store is None:
                self.store = connect_store(message["store_address"], timeout_s)
            store = self.store
            for prefix in message["prefixes"]:
                store = torch.distributed.PrefixStore(prefix, store)
            _, factory = BACKENDS[pb.TRANSFER_BACKEND_GLOO]
            pg = factory(
                store,
                int(message["rank"]),
                int(message["size"]),
                datetime.timedelta(seconds=max(timeout_s, 0.001)),
                message["listen_host"],
                torch.device("cpu"),
            )
            self.groups[int(message["group"])] = pg
            self.channel.send({"formed": message["group"]})
        except Exception as e:
            self.channel.send({"formed": message["group"], "error": backend_message(e)[:600]})

    def _view(self, buf: list[Any]) -> Any:
        segment, offset, nbytes, dtype = buf
        flat = self.segments[int(segment)][1][int(offset) : int(offset) + int(nbytes)]
        return flat.view(getattr(self.torch, dtype))

    def _post(self, post: dict[str, Any]) -> None:
        torch = self.torch
        op_id = int(post["id"])
        deadline = time.monotonic() + float(post["timeout_s"])
        try:
            pg = self.groups[int(post["group"])]
            kind = post["op"]
            bufs = [self._view(b) for b in post["bufs"]]
            if kind == "recv":
                work = pg.recv(bufs, int(post["peer"]), int(post["tag"]))
            elif kind == "send":
                work = pg.send(bufs, int(post["peer"]), int(post["tag"]))
            elif kind == "broadcast":
                opts = torch.distributed.BroadcastOptions()
                opts.rootRank = int(post["root"])
                opts.rootTensor = 0
                opts.timeout = datetime.timedelta(seconds=float(post["timeout_s"]))
                work = pg.broadcast(bufs, opts)
            elif kind == "allgather":
                work = pg.allgather([bufs[1:]], [bufs[0]])
            elif kind == "barrier":
                opts = torch.distributed.BarrierOptions()
                opts.timeout = datetime.timedelta(seconds=float(post["timeout_s"]))
                work = pg.barrier(opts)
            else:
                raise ValueError(f"unknown operation {kind!r}")
        except Exception as e:
            self._done(op_id, e)
            return
        self.pending.put((op_id, work, deadline))

    # --- completions, in the order posted ------------------------------------------------------

    def _report(self) -> None:
        while True:
            item = self.pending.get()
            if item is None:
                return
            op_id, work, deadline = item
            try:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except Exception as e:
                self._done(op_id, e)
            else:
                self._done(op_id, None)
            del work

    def _done(self, op_id: int, error: BaseException | None) -> None:
        from weightwire.core.transports.isolated_gloo_channel import ChannelClosed
        from weightwire.core.transports.transfer_group import backend_message

        message: dict[str, Any] = {"done": op_id}
        if error is not None:
            message["error"] = backend_message(error)[:600]
        try:
            self.channel.send(message)
        except ChannelClosed:
            os._exit(0)


def main() -> None:
    from weightwire.core.transports.idle_priority import enter_idle

    enter_idle()  # before torch's import (idle_priority)
    from weightwire.core.transports.isolated_gloo_channel import Channel

    channel = Channel(socket.socket(fileno=int(sys.argv[1])))
    _Receiver(channel).run()


if __name__ == "__main__":
    main()
