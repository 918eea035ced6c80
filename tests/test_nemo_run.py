"""NeMo-Run launch: a local torchrun job of 2 CPU processes, and a Slurm dry run."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "examples", "nemo_run", "launch.py")


def _run(tmp_path, *args):
    env = dict(os.environ, NEMORUN_HOME=str(tmp_path / "nemorun"))
    return subprocess.run([sys.executable, LAUNCH, *args], capture_output=True, text=True, timeout=600, env=env)


def test_local_torchrun_launch_of_two_processes(tmp_path):
    grads = tmp_path / "grads.safetensors"
    proc = _run(tmp_path, "local", "--nproc", "2", "--", "--tp", "2", "--steps", "1", "--dump-grads", str(grads))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert grads.is_file() and grads.stat().st_size > 1000
    # the launcher says where the output went: the combined log it names holds the ranks' output
    home = str(tmp_path / "nemorun" / "experiments" / "branch-replay")
    assert f"output and logs: {home}" in proc.stdout
    combined = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("  all ranks: ")]
    assert len(combined) == 1 and combined[0].startswith(home) and os.path.getsize(combined[0]) > 0
    assert proc.stdout.count("  rank ") == 2 and "nemo experiment logs branch-replay_" in proc.stdout


def test_slurm_dry_run_has_torchrun_and_parallel_sizes(tmp_path):
    proc = _run(tmp_path, "slurm", "--dryrun", "--gpus", "8", "--tp", "2", "--cp", "4", "--job-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())
    assert "torchrun" in text and "--nproc-per-node 8" in text
    assert "--tp 2 --cp 4 --pp 1" in text
    assert f"output and logs on the cluster: {tmp_path}/branch-replay-slurm/branch-replay-slurm_" in proc.stdout
    bad = _run(tmp_path, "slurm", "--dryrun", "--gpus", "8", "--tp", "2", "--cp", "2")
    assert bad.returncode == 2 and "must equal --gpus 8" in bad.stderr
