"""GLM-4.5 MoE (``Glm4MoeForCausalLM``) <-> Megatron: grouped-query attention with partial RoPE.

The per-architecture part of :mod:`megatron_branch.hf.mapping`. Attention is Qwen2/Qwen3's
(``q/k/v_proj`` with biases under ``attention_bias``, ``o_proj`` without; ``q_norm`` /
``k_norm`` under ``use_qk_norm``) with RoPE on the first ``partial_rotary_factor`` of each
head, rotate-half, as Megatron's ``rotary_percent`` rotates; the MoE layers are DeepSeek-V3's
(:mod:`.moe`: sigmoid router with a correction bias, group-limited top-k, routed scaling,
shared experts, the first ``first_k_dense_replace`` layers dense).
"""

from __future__ import annotations

from typing import Tuple

ARCH = "Glm4MoeForCausalLM"
MODEL_TYPE = "glm4_moe"
# transformers 5.25's Glm4MoeConfig default (rope_parameters or top level)
PARTIAL_ROTARY_FACTOR = 0.5


def megatron_args(cfg: dict, params: dict) -> Tuple[dict, dict]:
    """``(TransformerConfig fields, GPTModel fields)`` beyond the common ones.

    Raises:
        ValueError: RoPE scaling, or a rotary part Megatron's RoPE cannot express, named.
    """
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in (None, "default"):
        raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported for {ARCH} (default only)")
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    factor = float(PARTIAL_ROTARY_FACTOR if factor is None else factor)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dim = int(head_dim * factor)
    if not 0.0 < factor <= 1.0 or dim < 2 or dim % 2:
        raise ValueError(f"config.json: partial_rotary_factor={factor} with head_dim={head_dim} gives a rotary part "
                         f"of {dim} channels; an even, positive number up to head_dim is needed")
    return dict(qk_layernorm=bool(cfg.get("use_qk_norm", False))), dict(rotary_percent=factor)
