"""Megatron's hybrid Gated DeltaNet block spec on local modules: the naive reference.

megatron-core 0.19 mixes Gated DeltaNet (GDN) and attention layers in one GPT block with
``get_transformer_block_with_experimental_attention_variant_spec`` (Qwen3-Next /
Qwen3.5 style: ``experimental_attention_variant="gated_delta_net"``, layer pattern from
``linear_attention_freq``), but builds it only from Transformer Engine modules (it
asserts ``transformer_impl == "transformer_engine"``). :func:`get_local_hybrid_block_spec`
is the same block from Megatron's local modules: each GDN layer is Megatron's
``GatedDeltaNet`` with a column-parallel ``in_proj``, the local norm as its gated
``out_norm`` and a row-parallel ``out_proj`` behind the layer's own ``input_layernorm``
(TE fuses that norm into ``in_proj``); each attention layer is Megatron's local GPT layer;
the pattern is Megatron's ``get_linear_attention_pattern``. It is the stock computation
the branch spec's GDN layers are judged against, and the base the branch spec installs
its pieces on.
"""

from __future__ import annotations

import copy

from megatron_branch._megatron import (
    ColumnParallelLinear,
    GatedDeltaNet,
    GatedDeltaNetSubmodules,
    HybridStack,
    HybridStackSubmodules,
    IdentityFuncOp,
    IdentityOp,
    MegatronModule,
    MLPLayer,
    ModuleSpec,
    RowParallelLinear,
    TransformerBlockSubmodules,
    gdn_unavailable_reason,
    get_gpt_layer_local_spec,
    get_linear_attention_pattern,
)


def get_local_gdn_layer_spec(**local_spec_kwargs) -> ModuleSpec:
    """A ``TransformerLayer`` spec whose sequence mixer is Megatron's ``GatedDeltaNet``
    (local linears and norms; the MLP and norms of ``get_gpt_layer_local_spec``)."""
    reason = gdn_unavailable_reason()
    if reason:
        raise ValueError(f"experimental_attention_variant: {reason}")

    layer = get_gpt_layer_local_spec(**local_spec_kwargs)
    norm = layer.submodules.input_layernorm
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear))
    sub = copy.copy(layer.submodules)
    sub.self_attention = gdn
    out = copy.copy(layer)
    out.submodules = sub
    return out


def get_local_hybrid_block_spec(config, **local_spec_kwargs) -> TransformerBlockSubmodules:
    """The block of ``config.num_layers`` layers: GDN where Megatron's
    ``get_linear_attention_pattern(config)`` says 1, local attention where it says 0."""
    if config.experimental_attention_variant != "gated_delta_net":
        raise ValueError("experimental_attention_variant: a hybrid block needs 'gated_delta_net', got "
                         f"{config.experimental_attention_variant!r}")
    attention = get_gpt_layer_local_spec(**local_spec_kwargs)
    gdn = get_local_gdn_layer_spec(**local_spec_kwargs)
    pattern = get_linear_attention_pattern(config)
    return TransformerBlockSubmodules(layer_specs=[gdn if p == 1 else attention for p in pattern],
                                      layer_norm=attention.submodules.input_layernorm)


class _NoMamba(MegatronModule):
    """The Mamba slot of the local hybrid stack: Megatron's ``MambaMixer`` has only a
    CUDA/Triton training kernel, so a pattern with ``M`` is refused by name."""

    def __init__(self, config, *args, **kwargs):
        raise ValueError("hybrid_layer_pattern: Mamba layers ('M') are not supported by the branch spec "
                         "(Megatron's MambaMixer needs mamba-ssm's CUDA/Triton kernels; docs/model_families.md)")


def _mixer_only(layer: ModuleSpec) -> ModuleSpec:
    # HybridStack layers carry one block each: the mixer, or an MLP in a layer of its own
    sub = copy.copy(layer.submodules)
    sub.pre_mlp_layernorm, sub.mlp, sub.mlp_bda = IdentityOp, IdentityOp, IdentityFuncOp
    out = copy.copy(layer)
    out.submodules = sub
    return out


def get_local_hybrid_stack_spec(**local_spec_kwargs) -> ModuleSpec:
    """HybridModel's ``hybrid_stack_spec`` from Megatron's local modules.

    Megatron's ``hybrid_stack_spec`` (``models/hybrid/hybrid_layer_specs.py``) is built from
    Transformer Engine modules. This is the same stack for the layer symbols ``G`` (Gated
    DeltaNet: :func:`get_local_gdn_layer_spec` without its MLP), ``*`` (attention: the local
    GPT layer without its MLP) and ``-`` (an MLP layer: ``MLPLayer`` with the local MLP);
    ``M`` (Mamba) is refused when built. Use with ``HybridModel(hybrid_layer_pattern=...)``.
    """
    reason = gdn_unavailable_reason()
    if reason or HybridStack is None:
        raise ValueError(f"hybrid_stack_spec: {reason or 'this megatron-core has no HybridModel'}")
    attention = get_gpt_layer_local_spec(**local_spec_kwargs)
    mlp = copy.copy(attention)
    mlp.module = MLPLayer
    mlp.submodules = copy.copy(attention.submodules)
    mlp.submodules.input_layernorm, mlp.submodules.self_attention = IdentityOp, IdentityOp
    mlp.submodules.self_attn_bda = IdentityFuncOp
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        mamba_layer=_NoMamba,
        gdn_layer=_mixer_only(get_local_gdn_layer_spec(**local_spec_kwargs)),
        attention_layer=_mixer_only(attention),
        mlp_layer=mlp,
    ))
