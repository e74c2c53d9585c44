"""A producer process for the CUDA IPC primitive tests (tests/gpu/test_ipc_primitives.py).

Allocates one uint8 buffer on its GPU, exports it with ``weightwire.core.transports.cuda_ipc`` and then obeys
line commands on stdin, answering one line on stdout each. Handles travel as the hex of a
serialised ``weightwire.v1.Payload`` (never pickle):

  share           -> "payload <hex>" (a fresh share of the same buffer)
  fill <byte>     -> "ok" after the buffer holds that byte everywhere and the stream is synchronised
  pattern <seed>  -> "ok" after the buffer holds (i * 31 + seed) % 251 for byte i
  slowfill <byte> -> "event <hex>" at once: a kernel that spins for about 0.2 s, then the fill, are
                     queued, then the buffer's ProducerEvent is recorded; its IPC handle is sent
                     without waiting for any of it (a consumer must wait for the event)
  free            -> "freed <allocated bytes after dropping the buffer and ipc_collect>"
  mem             -> "mem <allocated bytes>"
  quit            -> exits
"""

from __future__ import annotations

import sys

import torch
from weightwire.core.transports.cuda_ipc import (
    ProducerEvent,
    SharedCudaBuffer,
    ipc_collect,
    share_cuda_tensor,
    synchronize_producer,
)


def pattern(n: int, seed: int, device: torch.device) -> torch.Tensor:
    return ((torch.arange(n, device=device, dtype=torch.int64) * 31 + seed) % 251).to(torch.uint8)


def main() -> int:
    size = int(sys.argv[1])
    # A view that does not start at its storage's first byte, as an all-gather output slice might.
    lead = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    device = torch.device("cuda", 0)
    base = torch.empty(lead + size, dtype=torch.uint8, device=device)
    buf: torch.Tensor | None = base[lead:]
    del base
    shares: list[SharedCudaBuffer] = []
    event = ProducerEvent(0)

    def reply(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "share":
            assert buf is not None
            shared = share_cuda_tensor(buf)
            shares.append(shared)
            reply(f"payload {shared.payload().SerializeToString().hex()} {shared.base_offset_bytes}")
            del shared  # only `shares` may keep the buffer alive ("free" drops them)
        elif cmd == "fill":
            assert buf is not None
            buf.fill_(int(args[0]))
            synchronize_producer(0)
            reply("ok")
        elif cmd == "pattern":
            assert buf is not None
            buf.copy_(pattern(buf.numel(), int(args[0]), device))
            synchronize_producer(0)
            reply("ok")
        elif cmd == "slowfill":
            assert buf is not None
            torch.cuda._sleep(400_000_000)  # GPU clock cycles: ~0.2 s on a current GPU
            buf.fill_(int(args[0]))
            reply(f"event {event.record().hex()}")
        elif cmd == "free":
            buf = None
            shares.clear()
            ipc_collect()
            reply(f"freed {torch.cuda.memory_allocated(0)}")
        elif cmd == "mem":
            ipc_collect()
            reply(f"mem {torch.cuda.memory_allocated(0)}")
        elif cmd == "quit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
