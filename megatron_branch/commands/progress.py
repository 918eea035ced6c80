"""A dependency-free progress bar for long commands (writes to stderr)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    """``with Progress(total, "bench") as bar: bar.update("shape G=16")``."""

    def __init__(self, total: int, label: str, stream: Optional[TextIO] = None, width: int = 28):
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.perf_counter()

    def update(self, note: str = "", step: int = 1) -> None:
        self.done = min(self.done + step, self.total)
        filled = int(self.width * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
            f"{elapsed:5.0f}s eta {eta:4.0f}s {note[:40]:<40s}"
        )
        self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.stream.write("\n")
        self.stream.flush()
