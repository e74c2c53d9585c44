"""A command run in a real pseudo-terminal (``os.openpty``), for the tests of what the CLI draws."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][A-Z0-9]")


class Terminal:
    """A command whose stdout and stderr are a pseudo-terminal of 200 x 50."""

    def __init__(self, cmd: list[str]) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        env = {**os.environ, "COLUMNS": "200", "LINES": "50", "TERM": "xterm-256color"}
        env.pop("NO_COLOR", None)
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.master = master
        self.raw = b""

    def text(self) -> str:
        return _ANSI.sub("", self.raw.decode(errors="replace"))

    def read_until(self, predicate: Callable[[str], bool], timeout: float = 60.0) -> str:
        """Read output until ``predicate(text since start)`` holds; fails with what was seen."""
        deadline = time.monotonic() + timeout
        while not predicate(self.text()):
            left = deadline - time.monotonic()
            assert left > 0, f"terminal never showed what was expected; it showed:\n{self.text()[-4000:]}"
            if select.select([self.master], [], [], min(left, 0.5))[0]:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk and self.proc.poll() is not None:
                    continue
                self.raw += chunk
        return self.text()

    def close(self, *, interrupt: bool = True) -> int:
        """Wait for the command to end (after a Ctrl-C when ``interrupt``); returns its exit code."""
        if interrupt and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        try:
            while select.select([self.master], [], [], 0.2)[0]:
                chunk = os.read(self.master, 65536)
                if not chunk:
                    break
                self.raw += chunk
        except OSError:
            pass
        os.close(self.master)
        return code
