"""The kernel and streaming-budget choices the integrations read
(:mod:`megatron_branch.integrations.options`): checked where they are read, bad values
refused naming the option. verl's config is read with plain attribute access, so its
parser is tested here without verl (the engine itself: tests/test_verl.py)."""

import logging
import types

import pytest

from megatron_branch.integrations import options
from megatron_branch.integrations.options import (
    BranchOptions,
    check_kernel,
    check_max_chunk_tokens,
    kernel_from_env,
    kernel_names,
    log_once,
    verl_branch_options,
)


def test_kernel_names_are_the_ones_the_core_attention_takes():
    assert set(kernel_names()) == {"flash_varlen", "efficient_varlen", "flash_cpu", "flash_cuda", "math"}
    for name in kernel_names():
        assert check_kernel(name, "opt") == name
    assert check_kernel(None, "opt") is None and check_kernel("", "opt") is None


@pytest.mark.parametrize("value", ["flash", "FLASH_CPU", "sdpa", 3])
def test_an_unknown_kernel_is_refused_naming_the_option(value):
    with pytest.raises(ValueError, match=r"^--my-option: .* is not a tree-attention kernel"):
        check_kernel(value, "--my-option")


def test_budget_is_a_positive_whole_number():
    assert check_max_chunk_tokens(None, "opt") is None and check_max_chunk_tokens("", "opt") is None
    assert check_max_chunk_tokens(4096, "opt") == 4096 and check_max_chunk_tokens("512", "opt") == 512
    for bad, why in ((0, "positive"), (-8, "positive"), ("-8", "positive"), ("4k", "whole number"),
                     (1.5, "whole number"), (True, "whole number")):
        with pytest.raises(ValueError, match=f"^budget: .*{why}"):
            check_max_chunk_tokens(bad, "budget")


def test_kernel_from_the_environment(monkeypatch):
    monkeypatch.delenv("MEGATRON_BRANCH_KERNEL", raising=False)
    assert kernel_from_env() is None
    assert kernel_from_env({"MEGATRON_BRANCH_KERNEL": " math "}) == "math"
    monkeypatch.setenv("MEGATRON_BRANCH_KERNEL", "flash_varlen")
    assert kernel_from_env() == "flash_varlen"
    monkeypatch.setenv("MEGATRON_BRANCH_KERNEL", "flashattn")
    with pytest.raises(ValueError, match="^MEGATRON_BRANCH_KERNEL=flashattn: "):
        kernel_from_env()


def test_log_once_logs_a_message_once(caplog, monkeypatch):
    monkeypatch.setattr(options, "_logged", set())
    with caplog.at_level(logging.INFO, logger=options.__name__):
        log_once("kernel math")
        log_once("kernel math")
        log_once("kernel flash_cpu")
    assert [r.getMessage() for r in caplog.records] == ["kernel math", "kernel flash_cpu"]


def verl_config(branch=None, **others):
    """verl's ``McoreEngineConfig`` as the parser reads it (attribute access)."""
    overrides = dict(others)
    if branch is not None:
        overrides["branch"] = branch
    return types.SimpleNamespace(override_mcore_model_config=overrides)


def test_verl_options_default_to_none():
    assert verl_branch_options(types.SimpleNamespace()) == BranchOptions()
    assert verl_branch_options(verl_config()) == BranchOptions()
    assert verl_branch_options(verl_config(moe_config={"freeze_moe_router": True})) == BranchOptions()
    assert verl_branch_options(verl_config({})) == BranchOptions()


def test_verl_options_read_the_branch_dict():
    got = verl_branch_options(verl_config({"kernel": "efficient_varlen", "max_chunk_tokens": 8192}))
    assert got == BranchOptions(kernel="efficient_varlen", max_chunk_tokens=8192)
    assert verl_branch_options(verl_config({"kernel": None, "max_chunk_tokens": None})) == BranchOptions()


@pytest.mark.parametrize("branch, option", [
    ({"kernel": "flash"}, "megatron.override_mcore_model_config.branch.kernel"),
    ({"max_chunk_tokens": 0}, "megatron.override_mcore_model_config.branch.max_chunk_tokens"),
    ({"max_chunk_tokens": "lots"}, "megatron.override_mcore_model_config.branch.max_chunk_tokens"),
    ({"kernal": "math"}, "megatron.override_mcore_model_config.branch.kernal: unknown key"),
    ("math", "megatron.override_mcore_model_config.branch: expected a dict"),
])
def test_verl_bad_options_are_refused_naming_the_key(branch, option):
    with pytest.raises(ValueError, match="^" + option.replace(".", r"\.")):
        verl_branch_options(verl_config(branch))
