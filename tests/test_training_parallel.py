"""Training on Megatron's machinery across processes: after 3 Adam steps, branch replay's
parameters on every layout equal those of naive training on one process.

Each run is ``examples/train_branch_replay.py`` under torchrun (gloo, CPU). The truth is
``--naive``: Megatron's stock local spec, every rollout its own sequence, the same DDP,
optimizer and loss normalisation. Per tensor, ``|p - p_naive| <= 1e-4 |p_naive - p_init|``
in fp32; bf16 must be within 2x of naive bf16's error against fp32 naive. Adam uses
``eps=1e-6``: with the default 1e-8 its first step turns a gradient element that is pure
rounding (seen: 5e-9 next to a maximum of 3e-2) into a full ``lr``-sized move, in naive
and replay alike, so the comparison would measure Adam's amplification of rounding.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from torchrun import ROOT, TRAIN, run_example

# the layouts and data of the agreement table (tools/agreement.py training writes it)
_spec = importlib.util.spec_from_file_location("agreement", os.path.join(ROOT, "tools", "agreement.py"))
agreement = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agreement)
DATA, LAYOUTS, GUARD, BF16, rel_errors = (agreement.DATA, agreement.LAYOUTS, agreement.GUARD, agreement.BF16,
                                          agreement.rel_errors)


def params(tmp_path, tag, nproc, *flags, steps=3):
    path = tmp_path / f"{tag}.safetensors"
    out = run_example(nproc, *DATA, "--steps", steps, "--dump-params", path, *flags)
    return load_file(path), out


@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("truth")
    init, _ = params(tmp, "init", 1, steps=0)
    naive, _ = params(tmp, "naive", 1, "--naive")
    return init, naive


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parameters_after_three_steps_equal_naive(layout, truth, tmp_path):
    nproc, flags = LAYOUTS[layout]
    init, naive = truth
    if "torch" in flags:  # the torch optimizer's truth is naive with the same optimizer
        naive, _ = params(tmp_path, "naive-torch", 1, "--naive", "--optimizer", "torch")
    got, out = params(tmp_path, layout, nproc, *flags)
    errors = rel_errors(got, naive, init)
    assert max(errors.values()) <= 1e-4, (layout, max(errors, key=errors.get), max(errors.values()))
    assert "max/mean work over DP ranks" in out


def test_layout_dependent_normalisation_is_caught(truth, tmp_path):
    """The guard: single rollouts dealt over DP ranks, each micro-batch normalised by its own
    token count (Megatron's default mean), moves the parameters measurably."""
    init, naive = truth
    got, _ = params(tmp_path, "cut", GUARD[0], *GUARD[1])
    assert max(rel_errors(got, naive, init).values()) > 1e-2


def test_bf16_within_twice_naive_bf16_error(truth, tmp_path):
    _, naive = truth
    naive_bf16, _ = params(tmp_path, "naive-bf16", 1, "--naive", "--bf16")
    got, _ = params(tmp_path, "bf16", BF16[0], *BF16[1])
    for k in naive:
        err = float((got[k] - naive[k]).norm())
        base = float((naive_bf16[k] - naive[k]).norm())
        assert err <= 2 * base + 1e-6, (k, err, base)


def test_tied_embeddings_under_pipeline_and_tensor_parallelism(tmp_path):
    init, _ = params(tmp_path, "init-tied", 1, "--tie-embeddings", steps=0)
    naive, _ = params(tmp_path, "naive-tied", 1, "--naive", "--tie-embeddings")
    got, _ = params(tmp_path, "tied", 4, "--tie-embeddings", "--pp", "2", "--tp", "2", "--micro-batch-tokens", "200")
    assert "output_layer.weight" not in got
    errors = rel_errors(got, naive, init)
    assert max(errors.values()) <= 1e-4, max(errors, key=errors.get)


def test_bad_layouts_fail_with_a_clear_message():
    proc = subprocess.run([sys.executable, TRAIN, "--naive", "--pp", "2"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--naive: runs with --pp 1 --cp 1" in proc.stderr
    proc = subprocess.run([sys.executable, TRAIN, "--optimizer", "torch", "--bf16"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--optimizer torch" in proc.stderr
    with pytest.raises(AssertionError, match="1 groups cannot feed 2 data-parallel ranks"):
        run_example(2, "--prompts", "40", "--steps", "1")
