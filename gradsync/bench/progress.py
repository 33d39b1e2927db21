"""A one-line progress bar on stderr: redrawn in place on a terminal, one line per tenth elsewhere."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """`bar.update(done, note)` as work advances; `bar.close()` ends the line.

    Example:
        >>> bar = ProgressBar(100, "ddp")
        >>> bar.update(50, "0.41 s/step")
    """

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 28) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.started = time.perf_counter()
        self.interactive = self.stream.isatty()
        self._printed_tenths = -1

    def update(self, done: int, note: str = "") -> None:
        done = min(done, self.total)
        if self.interactive:
            self.stream.write("\r" + self.line(done, note) + "\033[K")
            self.stream.flush()
            return
        tenths = 10 * done // self.total
        if tenths > self._printed_tenths:  # a log file gets a few lines, not thousands
            self._printed_tenths = tenths
            self.stream.write(self.line(done, note) + "\n")
            self.stream.flush()

    def line(self, done: int, note: str = "") -> str:
        filled = self.width * done // self.total
        elapsed = time.perf_counter() - self.started
        bar = "#" * filled + "." * (self.width - filled)
        return f"{self.label:<28} [{bar}] {done}/{self.total} {elapsed:5.0f}s {note}".rstrip()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()
