"""DeepSeek-V3 (multi-latent attention) <-> Megatron ``MLASelfAttention``; its MoE layers: :mod:`.moe`.

The per-architecture part of :mod:`megatron_branch.hf.mapping` for ``DeepseekV3ForCausalLM``:
which configs convert, the ``MLATransformerConfig`` fields, and the attention tensors.

Names (HF ``self_attn.`` -> Megatron ``self_attention.``; Megatron's local MLA spec with
``qk_layernorm=True``, whose latent norms are separate modules):

* ``q_a_proj`` -> ``linear_q_down_proj``, ``q_a_layernorm`` -> ``q_layernorm``,
  ``q_b_proj`` -> ``linear_q_up_proj`` (``q_proj`` -> ``linear_q_proj`` without ``q_lora_rank``);
* ``kv_a_proj_with_mqa`` -> ``linear_kv_down_proj`` (rows: ``kv_lora_rank`` latent, then the
  ``qk_rope_head_dim`` RoPE key shared by all heads), ``kv_a_layernorm`` -> ``kv_layernorm``,
  ``kv_b_proj`` -> ``linear_kv_up_proj`` (per head ``qk_nope_head_dim`` key rows, then
  ``v_head_dim`` value rows), ``o_proj`` -> ``linear_proj``.

Both sides lay the query heads out as ``[qk_nope_head_dim; qk_rope_head_dim]`` and split the
same way, so the tensors are copied unchanged, except for RoPE's pairing: Megatron's MLA
always de-interleaves the RoPE rows first (``x[0::2], x[1::2]``, then rotate-half), which is
what HF computes with ``rope_interleave=True`` (its default). With ``rope_interleave=False``
HF rotates the halves ``x[:d/2], x[d/2:]`` directly, so the RoPE rows of the query and of the
shared key are permuted on import (row ``2i`` <- ``i``, ``2i+1`` <- ``d/2 + i``) and back on
export: a gather, so the round trip stays bit-exact.

Scales: HF multiplies the softmax scale ``1/sqrt(qk_nope + qk_rope)`` by
``yarn_get_mscale(factor, mscale_all_dim)**2`` under YaRN with ``mscale_all_dim`` and scales
cos/sin by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``; Megatron's MLA does
both from ``rotary_scaling_factor``, ``mscale`` and ``mscale_all_dim`` with the same formulas.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
from torch import Tensor

ARCH = "DeepseekV3ForCausalLM"
# config.json fields the conversion reads (positive integers); q_lora_rank may also be null
REQUIRED = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# HF builds q_a_layernorm / kv_a_layernorm with this epsilon whatever rms_norm_eps says;
# Megatron gives every norm of the layer config.layernorm_epsilon.
LATENT_NORM_EPS = 1e-6
# HF's DeepseekV3Config defaults for fields a config.json may leave out
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def check_config(cfg: dict) -> None:
    """Raise ``ValueError`` naming the field if the weights of ``cfg`` cannot be mapped."""
    for key in REQUIRED:
        value = cfg.get(key)
        if value is None:
            raise ValueError(f"config.json: lacks {key} (needed for {ARCH}); pass the model's complete config.json")
    for key in REQUIRED + ("q_lora_rank",):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"config.json: {key} is {value!r}, expected a positive integer"
                             + (" or null" if key == "q_lora_rank" else ""))
    heads, groups = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if groups != heads:
        # HF's MLA expands every head's key from the latent; a smaller count breaks its repeat_kv
        raise ValueError(f"config.json: num_key_value_heads={groups} differs from num_attention_heads={heads}; "
                         "multi-latent attention has one key/value head per query head")
    if cfg.get("attention_bias", False):
        raise ValueError("config.json: attention_bias=true is not supported (Megatron's MLA projections have no "
                         "biases)")


def check_buildable(cfg: dict) -> None:
    """Raise ``ValueError`` naming the field if megatron-core cannot build the layer ``cfg`` needs."""
    if cfg.get("q_lora_rank") is None:
        # Measured on megatron-core 0.19.2: with q_lora_rank=None, qk_layernorm=True asks its
        # QK-norm resolver for a Transformer Engine fused norm+linear query projection
        # (RuntimeError on the local spec), and qk_layernorm=False drops the kv latent norm
        # that HF applies (kv_a_layernorm): neither is DeepSeek's layer.
        raise ValueError("config.json: q_lora_rank=null (a q_proj without low-rank query) is not supported: "
                         "megatron-core's local MLA layer cannot keep the kv latent norm (kv_a_layernorm) without a "
                         "query latent norm; convert a model with q_lora_rank set")
    eps = float(cfg.get("rms_norm_eps", LATENT_NORM_EPS))
    if eps != LATENT_NORM_EPS:
        raise ValueError(f"config.json: rms_norm_eps={eps} is not supported for {ARCH}: HF's latent norms "
                         f"(q_a_layernorm, kv_a_layernorm) always use {LATENT_NORM_EPS} and Megatron uses one "
                         "epsilon for every norm of the layer")


def _yarn(params: dict, cfg: dict) -> dict:
    """Megatron YaRN fields for HF ``rope_type: yarn`` parameters (transformers'
    ``_compute_yarn_parameters``), or ``ValueError`` naming what Megatron cannot express."""
    if params.get("attention_factor") is not None:
        raise ValueError(f"config.json: yarn attention_factor={params['attention_factor']} is not supported "
                         "(Megatron derives it from factor, mscale and mscale_all_dim)")
    if params.get("truncate", True) is False:
        raise ValueError("config.json: yarn truncate=false is not supported (Megatron's MLA always rounds the "
                         "correction range to integers)")
    # HF: a top-level original_max_position_embeddings wins over the one in rope_parameters
    original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings")
    if not original:
        raise ValueError("config.json: yarn needs original_max_position_embeddings (or max_position_embeddings)")
    factor = params.get("factor")
    if factor is None:  # HF: the context extension ratio
        factor = cfg["max_position_embeddings"] / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        # HF then scales cos/sin by mscale(factor, 1) but the softmax by mscale(factor, mscale_all_dim)^2;
        # Megatron ties the two through mscale / mscale_all_dim.
        raise ValueError(f"config.json: yarn mscale={mscale!r} with mscale_all_dim={mscale_all_dim} is not "
                         "supported (set mscale, e.g. equal to mscale_all_dim)")
    if not mscale_all_dim:  # HF: cos/sin by mscale(factor, 1), softmax unscaled
        mscale, mscale_all_dim = 1.0, 0.0
    return dict(rope_type="yarn", rotary_scaling_factor=float(factor), original_max_position_embeddings=int(original),
                beta_fast=float(params.get("beta_fast") or YARN_BETA_FAST),
                beta_slow=float(params.get("beta_slow") or YARN_BETA_SLOW),
                mscale=float(mscale), mscale_all_dim=float(mscale_all_dim))


def mla_args(cfg: dict, theta: float, params: dict) -> dict:
    """``MLATransformerConfig`` fields (beyond the common ones) for a DeepSeek-V3 config.

    Args:
        cfg: the HF config dict (checked by :func:`check_config`).
        theta: ``rope_theta``.
        params: HF's RoPE parameters (``rope_parameters`` updated by ``rope_scaling``).

    Raises:
        ValueError: a RoPE type or YaRN setting Megatron's MLA cannot express, or a layer it
            cannot build (:func:`check_buildable`), named.
    """
    check_buildable(cfg)
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor={params['partial_rotary_factor']} is not supported "
                         f"for {ARCH} (the RoPE part is qk_rope_head_dim wide)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        rope = dict(rope_type="rope")
    elif kind == "yarn":
        rope = _yarn(params, cfg)
    else:
        raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported for {ARCH} (default or yarn)")
    return dict(multi_latent_attention=True, q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                qk_head_dim=cfg["qk_nope_head_dim"], qk_pos_emb_head_dim=cfg["qk_rope_head_dim"],
                v_head_dim=cfg["v_head_dim"], qk_layernorm=True, rotary_base=theta, **rope)


# ---------------------------------------------------------------------------- weights
def _rope_order(cfg: dict) -> Tuple[Tensor, Tensor]:
    """``(to_megatron, to_hf)`` row orders of one RoPE part (``qk_rope_head_dim`` rows):
    ``mg = hf[to_megatron]``, ``hf = mg[to_hf]``; the identity with ``rope_interleave``."""
    d = cfg["qk_rope_head_dim"]
    if cfg.get("rope_interleave", True):
        order = torch.arange(d)
    else:  # Megatron's de-interleave must give back HF's halves: mg[2i] = hf[i], mg[2i+1] = hf[d/2 + i]
        order = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1).reshape(-1)
    return order, torch.argsort(order)


def _permute_rope_rows(w: Tensor, cfg: dict, block: int, order: Tensor) -> Tensor:
    """Reorder the last ``qk_rope_head_dim`` rows of every ``block`` rows of ``w``."""
    d = cfg["qk_rope_head_dim"]
    rest = w.shape[1:]
    # [n * block, ...] -> [n, block, ...]: the RoPE rows are the last d of each block
    w = w.reshape(-1, block, *rest)
    nope, rope = w.split([block - d, d], dim=1)
    return torch.cat([nope, rope.index_select(1, order)], dim=1).reshape(-1, *rest)


def _q_head(cfg: dict) -> int:
    return cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]


def attention_to_megatron(take: Callable[..., Tensor], cfg: dict, hf: str, mg: str) -> Dict[str, Tensor]:
    """One layer's HF ``{hf}`` (``...self_attn.``) tensors -> Megatron ``{mg}`` (``...self_attention.``).

    ``take(name, *shape)`` pops a tensor and checks its shape (:func:`megatron_branch.hf.mapping._taker`).
    """
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    q_lora, kv_lora, rope_d = cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    to_mg, _ = _rope_order(cfg)
    out = {}
    if q_lora is None:
        q = take(hf + "q_proj.weight", heads * _q_head(cfg), hidden)
        out[mg + "linear_q_proj.weight"] = _permute_rope_rows(q, cfg, _q_head(cfg), to_mg)
    else:
        out[mg + "linear_q_down_proj.weight"] = take(hf + "q_a_proj.weight", q_lora, hidden)
        out[mg + "q_layernorm.weight"] = take(hf + "q_a_layernorm.weight", q_lora)
        q = take(hf + "q_b_proj.weight", heads * _q_head(cfg), q_lora)
        out[mg + "linear_q_up_proj.weight"] = _permute_rope_rows(q, cfg, _q_head(cfg), to_mg)
    kv_a = take(hf + "kv_a_proj_with_mqa.weight", kv_lora + rope_d, hidden)
    out[mg + "linear_kv_down_proj.weight"] = _permute_rope_rows(kv_a, cfg, kv_lora + rope_d, to_mg)
    out[mg + "kv_layernorm.weight"] = take(hf + "kv_a_layernorm.weight", kv_lora)
    out[mg + "linear_kv_up_proj.weight"] = take(
        hf + "kv_b_proj.weight", heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), kv_lora)
    out[mg + "linear_proj.weight"] = take(hf + "o_proj.weight", hidden, heads * cfg["v_head_dim"])
    return out


def attention_from_megatron(take: Callable[..., Tensor], cfg: dict, mg: str, hf: str) -> Dict[str, Tensor]:
    """Inverse of :func:`attention_to_megatron`."""
    kv_lora, rope_d = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    _, to_hf = _rope_order(cfg)
    out = {}
    if cfg.get("q_lora_rank") is None:
        out[hf + "q_proj.weight"] = _permute_rope_rows(take(mg + "linear_q_proj.weight"), cfg, _q_head(cfg), to_hf)
    else:
        out[hf + "q_a_proj.weight"] = take(mg + "linear_q_down_proj.weight")
        out[hf + "q_a_layernorm.weight"] = take(mg + "q_layernorm.weight")
        out[hf + "q_b_proj.weight"] = _permute_rope_rows(take(mg + "linear_q_up_proj.weight"), cfg, _q_head(cfg),
                                                         to_hf)
    out[hf + "kv_a_proj_with_mqa.weight"] = _permute_rope_rows(take(mg + "linear_kv_down_proj.weight"), cfg,
                                                               kv_lora + rope_d, to_hf)
    out[hf + "kv_a_layernorm.weight"] = take(mg + "kv_layernorm.weight")
    out[hf + "kv_b_proj.weight"] = take(mg + "linear_kv_up_proj.weight")
    out[hf + "o_proj.weight"] = take(mg + "linear_proj.weight")
    return out
