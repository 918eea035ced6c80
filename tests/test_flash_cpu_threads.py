"""``tools/flash_cpu_threads.py`` runs and reports (the timing itself is the tool's job)."""

import os
import subprocess
import sys

import torch
from conftest import TOOLS, load_tool

from megatron_branch.attention.kernels import FLASH_CPU_SERIAL_KEYS

TOOL = os.path.join(TOOLS, "flash_cpu_threads.py")


def _tool():
    return load_tool("flash_cpu_threads")


def test_kernel_table_has_a_row_per_shape_and_names_the_gate():
    tool = _tool()
    threads = torch.get_num_threads()
    rows = tool.kernel_table(2, 1)
    assert torch.get_num_threads() == threads  # restored
    assert len(rows) == 2 + len(tool.SHAPES)
    for (b, nq, nk), row in zip(tool.SHAPES, rows[2:]):
        assert row.startswith(f"| {b} x {nq} x {nk} |")
        assert row.endswith("| 1 thread |" if nk < FLASH_CPU_SERIAL_KEYS else "| 2 threads |")


def test_bad_flags_fail_in_one_line_before_timing():
    for args, flag in ((["--threads", "0"], "--threads"), (["--step", "no such shape"], "--step"),
                       (["--step", "G=16"], "--step")):
        proc = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert flag in proc.stderr.splitlines()[-1] and "Traceback" not in proc.stderr
