"""A dependency-free progress bar that also reads well when output is not a terminal.

On a TTY it redraws one line with carriage returns; elsewhere (CI logs, pipes)
it prints a plain line every `every` percent, so logs stay short and readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    def __init__(self, total: int, *, stream: TextIO | None = None, width: int = 30, every: int = 10) -> None:
        if total < 1:
            raise ValueError(f"total must be >= 1, got {total}")
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self.width = width
        self.every = every
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._last_percent = -1
        self._last_width = 0

    def update(self, done: int, status: str | Callable[[], str] = "") -> None:
        """Reports `done` of `total` units, with a short status such as the current loss.

        `status` may be a callable, evaluated only when a line is drawn: reading
        a device loss syncs the host, so non-TTY runs read it once per printed line.
        """
        percent = 100 * done // self.total
        due = done == self.total or percent // self.every > self._last_percent // self.every
        if not (self.tty or due):
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        filled = self.width * done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {done:>{len(str(self.total))}}/{self.total} {percent:3d}% {elapsed:5.1f}s eta {eta:5.1f}s"
        text = status() if callable(status) else status
        line += f"  {text}" if text else ""
        if self.tty:
            # Pad to the previous line's length so a shorter line leaves no residue.
            self.stream.write("\r" + line.ljust(self._last_width))
            self._last_width = len(line)
            if done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
            self._last_percent = percent
        self.stream.flush()
