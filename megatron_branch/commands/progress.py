"""Progress for long commands, dependency-free: a bar on a terminal, plain lines elsewhere.

On a terminal (stderr is a TTY) the bar redraws itself on stderr. In a log, a pipe or a CI
job a bar's carriage returns are noise, so there it is off and ``update`` prints one short
line on stdout instead, at most one every ``every`` seconds (and the last), which keeps
long work visible without a line per fast step. ``verbose=True`` (a command's
``--verbose``) shows the bar wherever stderr goes.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    """``with Progress(total, "bench") as bar: bar.update("shape G=16")``.

    Args:
        total: the number of steps.
        label: what is running (starts every line).
        stream: draw the bar on this stream, whatever it is (default: the bar on stderr if
            it is a terminal or ``verbose``, else plain lines on stdout).
        width: the bar's width in characters.
        verbose: the bar even when stderr is not a terminal.
        every: plain lines only: the least seconds between two lines.
    """

    def __init__(self, total: int, label: str, stream: Optional[TextIO] = None, width: int = 28,
                 verbose: bool = False, every: float = 5.0):
        self.total, self.label, self.width, self.every = max(total, 1), label, width, every
        self.bar = stream is not None or verbose or _isatty(sys.stderr)
        self.stream = stream or (sys.stderr if self.bar else sys.stdout)
        self.done = 0
        self.start = time.perf_counter()
        self.last_line = float("-inf")

    def update(self, note: str = "", step: int = 1) -> None:
        """Count ``step`` more steps done; ``note`` says what was done."""
        self.done = min(self.done + step, self.total)
        now = time.perf_counter()
        elapsed = now - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        if self.bar:
            filled = int(self.width * self.done / self.total)
            self.stream.write(
                f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{elapsed:5.0f}s eta {eta:4.0f}s {note[:40]:<40s}"
            )
        elif now - self.last_line >= self.every or self.done == self.total:
            self.last_line = now
            self.stream.write(f"{self.label} {self.done}/{self.total} {elapsed:.0f}s eta {eta:.0f}s: {note}\n")
        self.stream.flush()

    def end_line(self) -> None:
        """End the bar's line (so that other output starts on a line of its own); plain lines need none."""
        if self.bar:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.end_line()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False
