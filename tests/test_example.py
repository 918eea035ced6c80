"""``examples/train_branch_replay.py`` under torchrun: dumps identical across layouts."""

import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from megatron_branch.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_branch_replay.py")


def launch(tmp_path, tag, nproc, *flags):
    grads, lps = tmp_path / f"{tag}-g.safetensors", tmp_path / f"{tag}-lp.safetensors"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", SCRIPT, "--steps", "2", "--dump-grads", str(grads),
           "--dump-logprobs", str(lps), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(grads), load_file(lps)["logprobs"], proc.stdout


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("single"), "single", 1)


def test_tp2_sp_cp2_p2p_streaming_dumps_match_one_process(single, tmp_path):
    grads, lp, out = launch(tmp_path, "tp2cp2", 4, "--tp", "2", "--cp", "2", "--sequence-parallel",
                            "--cp-comm", "p2p", "--chunk-tokens", "40")
    ref_grads, ref_lp, _ = single
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert grads[name].shape == g.shape
        assert ((grads[name] - g).abs().max() / g.abs().max().clamp(min=1e-30)) < 1e-5, name
    assert (lp - ref_lp).abs().max() < 1e-5
    assert "max/mean attention work" in out and "step 1: loss" in out
