"""Run ``examples/train_branch_replay.py`` under torchrun (gloo CPU processes) for tests."""

import os
import subprocess
import sys

from megatron_branch.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train_branch_replay.py")


def run_example(nproc, *flags, script=TRAIN, timeout=600):
    """Launch ``script`` with ``nproc`` processes under torchrun (one process: run directly,
    as a user would; the script starts its own one-process group); returns stdout,
    asserting success."""
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                                      f"--master_port={free_port()}"]
    cmd = [sys.executable, *launcher, script, *[str(f) for f in flags]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-2000:] + proc.stderr[-4000:])
    return proc.stdout
