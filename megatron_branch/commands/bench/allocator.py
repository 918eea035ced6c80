"""The host allocator setting the bench times under: freed memory stays in the process.

Why: glibc's ``malloc`` serves every block above its mmap threshold (dynamic, at most
32 MiB on 64-bit) with a fresh ``mmap`` and unmaps it on ``free``, so a step whose
tensors exceed it page-faults every page of them again, and the kernel zeroes each one,
on every step. The penalty falls on whichever method has the biggest tensors, not on the
method's work: measured at hidden 256, one thread, 16 x (4096 + 96), naive micro-batches
of 4 rollouts took about 1.1M minor faults and 4-5 s of system time per 38 s step
(micro-batches of 1: none; ours: none), and gave the naive sweep's best size an advantage
it does not have on a GPU, whose caching allocator reuses freed blocks. With
:func:`keep_freed_memory` the same step takes no faults.

:func:`keep_freed_memory` tells glibc to serve large blocks from the heap and never to
trim it (``mallopt(M_MMAP_MAX, 0)``, ``mallopt(M_TRIM_THRESHOLD, 2 GiB - 1)``), so a freed
block is reused as a caching allocator would. It applies to the whole process (every
method the bench times alike) for the rest of its life; glibc has no scoped form. Not
glibc (macOS, musl): nothing is changed, and the report says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int

KEEP = "keep"
DEFAULT = "default"
CHOICES = (KEEP, DEFAULT)


def keep_freed_memory() -> str:
    """Make glibc keep freed memory for reuse (see the module docstring).

    Returns:
        What the process's allocator now does, for the bench report.
    """
    if platform.libc_ver()[0] != "glibc":
        return f"{DEFAULT}: not glibc ({platform.system()}), allocator unchanged"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return f"{DEFAULT}: glibc refused mallopt, allocator unchanged"
    return f"{KEEP}: glibc keeps freed memory for reuse (M_MMAP_MAX=0, M_TRIM_THRESHOLD={TRIM_THRESHOLD})"


def apply(setting: str) -> str:
    """Apply the bench's ``--allocator`` setting; returns the description for the report.

    Raises:
        ValueError: ``setting`` is not one of :data:`CHOICES`.
    """
    if setting == KEEP:
        return keep_freed_memory()
    if setting == DEFAULT:
        return f"{DEFAULT}: the process's allocator as it was (large blocks mapped and unmapped per use)"
    raise ValueError(f"--allocator: {setting!r} is not one of {CHOICES}")
