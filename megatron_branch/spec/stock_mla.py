"""Megatron's stock local MLA layer spec, made buildable: the naive reference for MLA.

``get_gpt_layer_local_spec(multi_latent_attention=True)`` puts Megatron's local
``DotProductAttention`` in MLA's core-attention slot, but ``MLASelfAttention`` builds that
slot with ``k_channels``/``v_channels`` (its query/key and value head sizes differ), which
only Transformer Engine's attention accepts (megatron-core 0.16 to 0.20): the stock local
MLA spec fails to build. :class:`MLADotProductAttention` is the smallest change that lets
it build: Megatron's own ``DotProductAttention`` code, which derives every shape from its
inputs except the width of its output, told that width. It is the stock computation the
branch spec's multi-latent attention is judged against; it never runs in the branch spec.
"""

from __future__ import annotations

import copy
from typing import Optional

from megatron_branch._megatron import DotProductAttention, ModuleSpec, get_gpt_layer_local_spec


class MLADotProductAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention`` with value heads of ``v_channels``.

    Args:
        k_channels: query/key head size (MLA passes ``qk_head_dim + qk_pos_emb_head_dim``;
            the scores take it from the inputs, the scale from ``softmax_scale``).
        v_channels: value head size: the output is ``[sq, b, heads * v_channels]``.
        Others: as for ``DotProductAttention``.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:
            # the only shape DotProductAttention does not take from its inputs
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def get_stock_mla_layer_spec(**local_spec_kwargs) -> ModuleSpec:
    """``get_gpt_layer_local_spec(multi_latent_attention=True, ...)`` with
    :class:`MLADotProductAttention` in the core-attention slot (nothing else changed)."""
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, **local_spec_kwargs)
    attn = copy.copy(spec.submodules.self_attention)
    attn.submodules = copy.copy(attn.submodules)
    attn.submodules.core_attention = MLADotProductAttention
    layer_sub = copy.copy(spec.submodules)
    layer_sub.self_attention = attn
    out = copy.copy(spec)
    out.submodules = layer_sub
    return out
