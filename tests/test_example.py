"""``examples/train_branch_replay.py`` under torchrun: dumps identical across layouts."""

import pytest
from safetensors.torch import load_file
from torchrun import run_example


def launch(tmp_path, tag, nproc, *flags):
    grads, lps = tmp_path / f"{tag}-g.safetensors", tmp_path / f"{tag}-lp.safetensors"
    out = run_example(nproc, "--steps", "2", "--dump-grads", grads, "--dump-logprobs", lps, *flags)
    return load_file(grads), load_file(lps)["logprobs"], out


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
    assert "max/mean attention work" in out and "step 1: rank-0 loss" in out
