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
    ModuleSpec,
    RowParallelLinear,
    TransformerBlockSubmodules,
    get_gpt_layer_local_spec,
    get_linear_attention_pattern,
    gdn_unavailable_reason,
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
