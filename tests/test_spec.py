"""The branch spec: stock parameter names and shapes, no TE, clear errors."""

import dataclasses
import functools
import sys

import pytest
import torch

import megatron_branch as mb
from megatron_branch._megatron import SelfAttention, get_gpt_layer_local_spec
from megatron_branch.spec import apply_branch_attention
from megatron_branch.spec.builders import build_gpt, llama_config
from megatron_branch.spec.core_attention import BranchCoreAttention
from megatron_branch.spec.self_attention import BranchSelfAttention


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


def same_spec(a, b) -> bool:
    """Structural equality; megatron-core 0.17+ builds slots with functools.partial, which
    compares by identity."""
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return a.func == b.func and same_spec(a.args, b.args) and same_spec(a.keywords, b.keywords)
    if dataclasses.is_dataclass(a) and not isinstance(a, type) and type(a) is type(b):
        return all(same_spec(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(same_spec(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_spec(a[k], b[k]) for k in a)
    return a == b


def test_spec_slots():
    spec = mb.get_branch_layer_spec(normalization="RMSNorm", backend="dense", chunk_size=64)
    attn = spec.submodules.self_attention
    assert attn.module is BranchSelfAttention
    assert attn.submodules.core_attention.module is BranchCoreAttention
    assert attn.submodules.core_attention.params == {"backend": "dense", "chunk_size": 64, "kernel": None}
    stock = get_gpt_layer_local_spec(normalization="RMSNorm")
    assert same_spec(spec.submodules.mlp, stock.submodules.mlp)
    assert not same_spec(spec.submodules.self_attention, stock.submodules.self_attention)
    # applied to a spec object: every other slot is that very object, and the original is untouched
    ours = apply_branch_attention(stock)
    assert ours.submodules.mlp is stock.submodules.mlp
    assert ours.submodules.input_layernorm is stock.submodules.input_layernorm
    assert stock.submodules.self_attention.module is SelfAttention
    assert stock.submodules.self_attention.submodules.core_attention is not BranchCoreAttention


def test_block_specs_get_tree_attention_in_every_layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = llama_config(num_layers=4, num_moe_experts=4, moe_layer_freq=[1, 0, 1, 0], moe_router_topk=2,
                          moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    ours = apply_branch_attention(block)
    assert len(ours.layer_specs) == 4
    for mine, theirs in zip(ours.layer_specs, block.layer_specs):
        assert mine.submodules.self_attention.module is BranchSelfAttention
        assert mine.submodules.mlp is theirs.submodules.mlp  # MoE or dense, untouched
    assert block.layer_specs[0].submodules.self_attention.module is SelfAttention
    with pytest.raises(ValueError, match="spec: expected a layer or block spec"):
        apply_branch_attention("not a spec")


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
    ],
)
def test_bad_spec_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mb.get_branch_layer_spec(**kwargs)


def test_mla_where_megatron_core_cannot_build_it_is_refused_by_name():
    # megatron-core 0.16 without Transformer Engine: its MLASelfAttention raises TypeError
    from megatron_branch._megatron import mla_unbuildable_reason
    from megatron_branch.spec.builders import build_gpt, mla_config

    if not mla_unbuildable_reason():
        pytest.skip("this megatron-core builds MLASelfAttention (tests/test_mla.py runs)")
    with pytest.raises(ValueError, match="multi_latent_attention: megatron-core 0.16 cannot build MLASelfAttention"):
        build_gpt(mla_config(), 128)


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
