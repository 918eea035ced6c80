"""The branch spec: stock parameter names and shapes, no TE, clear errors."""

import sys

import pytest
import torch

import megatron_branch as mb
from megatron_branch._megatron import get_gpt_layer_local_spec
from megatron_branch.attention.core_attention import BranchCoreAttention
from megatron_branch.models import build_gpt, llama_config
from megatron_branch.self_attention import BranchSelfAttention


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_same_parameter_names_and_shapes_as_stock(qk_layernorm):
    config = llama_config(qk_layernorm=qk_layernorm)
    branch = build_gpt(config, 64)
    stock = build_gpt(config, 64, branch=False)
    assert {n: p.shape for n, p in branch.state_dict().items() if not n.endswith("_extra_state")} == {
        n: p.shape for n, p in stock.state_dict().items() if not n.endswith("_extra_state")
    }
    # checkpoints load both ways
    stock.load_state_dict(branch.state_dict())
    branch.load_state_dict(stock.state_dict())


def test_spec_slots():
    spec = mb.get_branch_layer_spec(normalization="RMSNorm", backend="dense", chunk_size=64)
    attn = spec.submodules.self_attention
    assert attn.module is BranchSelfAttention
    assert attn.submodules.core_attention.module is BranchCoreAttention
    assert attn.submodules.core_attention.params == {"backend": "dense", "chunk_size": 64, "kernel": None}
    stock = get_gpt_layer_local_spec(normalization="RMSNorm")
    assert spec.submodules.mlp == stock.submodules.mlp
    # the stock spec object was not modified
    assert stock.submodules.self_attention.submodules.core_attention is not BranchCoreAttention


def test_without_te_the_spec_never_imports_it():
    from megatron_branch._deps import HAVE_TE

    if HAVE_TE:
        pytest.skip("Transformer Engine is installed here")
    mb.get_branch_layer_spec(normalization="RMSNorm")
    assert "transformer_engine" not in sys.modules


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backend": "flash"}, "backend: 'flash' is not one of"),
        ({"multi_latent_attention": True}, "multi_latent_attention"),
    ],
)
def test_bad_spec_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mb.get_branch_layer_spec(**kwargs)


@pytest.mark.parametrize(
    "cfg, spec, match",
    [
        ({"attention_dropout": 0.1}, {}, "attention_dropout"),
        ({}, {"chunk_size": 0}, "chunk_size"),
        ({}, {"kernel": "cuda"}, "kernel: 'cuda'"),
    ],
)
def test_bad_model_settings(cfg, spec, match):
    with pytest.raises(ValueError, match=match):
        build_gpt(llama_config(**cfg), 64, spec_kwargs=spec)


def test_enable_cpu_is_idempotent_and_explicit():
    first = mb.enable_cpu()
    assert mb.enable_cpu() == first
    if not torch.cuda.is_available():
        assert "torch.cuda.current_device->cpu" in first


def test_te_spec_without_te_is_a_clear_error_at_construction():
    from megatron_branch._deps import HAVE_TE

    if HAVE_TE:
        pytest.skip("Transformer Engine is installed here; the TE spec runs in tools/gpu_check.py")
    with pytest.raises(ValueError, match=r"use_te: Transformer Engine is not importable.*\[te\] extra"):
        mb.get_branch_layer_spec(use_te=True)
    # auto mode falls back to the local spec without touching TE
    spec = mb.get_branch_layer_spec(use_te=None, normalization="RMSNorm")
    assert spec.submodules.self_attention.submodules.core_attention.module is BranchCoreAttention
    assert "transformer_engine" not in sys.modules


def test_te_spec_builds_with_te():
    from megatron_branch._deps import HAVE_TE

    if not HAVE_TE:
        pytest.skip("needs Transformer Engine, which installs only on a GPU (CUDA) machine")
    spec = mb.get_branch_layer_spec(use_te=True, qk_layernorm=False)
    assert spec.submodules.self_attention.submodules.core_attention.module is BranchCoreAttention
