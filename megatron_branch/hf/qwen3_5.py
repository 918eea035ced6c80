"""Qwen3.5 (dense and MoE text models) <-> Megatron: Qwen3-Next's hybrid with split GDN projections.

The per-architecture part of :mod:`megatron_branch.hf.mapping` for ``Qwen3_5ForCausalLM`` and
``Qwen3_5MoeForCausalLM`` (transformers 5.25's ``modeling_qwen3_5*``). The layers are
Qwen3-Next's (:mod:`.qwen3_next`: Gated DeltaNet and gated attention, zero-centred norms
held as ``1 + w``, partial RoPE), with two differences:

* the Gated DeltaNet input projections are separate and already in whole sections:
  ``in_proj_qkv`` (``[q; k; v]``, heads in order), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``;
  Megatron's ``in_proj`` is their concatenation ``[q; k; v; z; beta; alpha]`` (both sides
  repeat the q/k heads with ``repeat_interleave``), split back on export: exact both ways;
* Qwen3.5-MoE has a MoE block in every layer (routed experts with renormalised top-k, a
  sigmoid-gated shared expert: :mod:`.moe`); Qwen3.5 dense an MLP in every layer.

As released, Qwen3.5 checkpoints are the multimodal ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration``: the decoder's config is ``text_config`` and its tensors
are ``model.language_model.*`` (with ``lm_head.weight``), beside the vision tower
``model.visual.*``. Those convert as their text model (:func:`text_config`; the vision tower is
skipped, as ``Qwen3_5*ForCausalLM`` skips it) and export under the released names
(:data:`RELEASED_PREFIX`), so an RL stack's weight sync reaches the engine's language model.

RoPE: the text model's multimodal RoPE (``mrope_section``) gives a token the same position
on its three axes, so text rotates exactly as plain RoPE at ``partial_rotary_factor``.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
from torch import Tensor

from megatron_branch.hf import qwen3_next

DENSE, MOE = "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"
ARCHS = (DENSE, MOE)
MODEL_TYPES = {"qwen3_5_text": DENSE, "qwen3_5_moe_text": MOE}
# the released multimodal checkpoints and their text model
RELEASED = {"Qwen3_5ForConditionalGeneration": DENSE, "Qwen3_5MoeForConditionalGeneration": MOE}
RELEASED_MODEL_TYPES = {"qwen3_5": DENSE, "qwen3_5_moe": MOE}
RELEASED_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
# transformers 5.25's Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults for the fields the
# conversion reads, used where a config.json leaves one out (as from_pretrained would)
_COMMON = {"head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 4,
           "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
           "linear_num_value_heads": 32, "full_attention_interval": 4, "partial_rotary_factor": 0.25}
HF_DEFAULTS = {
    DENSE: dict(_COMMON, num_key_value_heads=4, intermediate_size=12288),
    MOE: dict(_COMMON, num_key_value_heads=2, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
              shared_expert_intermediate_size=512),
}


def is_released(cfg: dict) -> bool:
    """Whether ``cfg`` is a released multimodal Qwen3.5 config (its decoder in ``text_config``)."""
    archs = cfg.get("architectures") or []
    kind = archs[0] if archs else cfg.get("model_type")
    return (kind in RELEASED or kind in RELEASED_MODEL_TYPES) and isinstance(cfg.get("text_config"), dict)


def text_config(cfg: dict) -> dict:
    """The text model's config of a released multimodal Qwen3.5 config (``cfg`` itself otherwise):
    ``text_config`` as a ``Qwen3_5*ForCausalLM`` config, with the top level's ``tie_word_embeddings``."""
    if not is_released(cfg):
        return cfg
    archs = cfg.get("architectures") or []
    arch = RELEASED.get(archs[0]) if archs else RELEASED_MODEL_TYPES[cfg["model_type"]]
    out = dict(cfg["text_config"], architectures=[arch])
    if "tie_word_embeddings" in cfg:
        out["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return out


def to_text_names(state: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """A released checkpoint's tensors under the text model's names (``model.language_model.`` ->
    ``model.``); the vision tower's ``model.visual.*`` and the rest unchanged."""
    return {TEXT_PREFIX + k[len(RELEASED_PREFIX):] if k.startswith(RELEASED_PREFIX) else k: v
            for k, v in state.items()}


def to_released_names(state: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """Inverse of :func:`to_text_names` for the text model's tensors."""
    return {RELEASED_PREFIX + k[len(TEXT_PREFIX):] if k.startswith(TEXT_PREFIX) else k: v for k, v in state.items()}


def with_defaults(cfg: dict, arch: str) -> dict:
    """``cfg`` with HF's defaults for the fields it leaves out; the layer checks of
    :mod:`.qwen3_next` then see a model without its MoE rule (Qwen3.5 MoE is every layer or none)."""
    out = dict(cfg)
    for key, value in HF_DEFAULTS[arch].items():
        if out.get(key) is None:
            out[key] = value
    if arch == MOE:
        # Qwen3_5MoeTextConfig has no intermediate_size: the dense fields common code reads
        out.setdefault("intermediate_size", out["moe_intermediate_size"])
    # .qwen3_next's fields for its checks: no Qwen3-Next MoE rule applies here
    out.update(decoder_sparse_step=1, mlp_only_layers=[])
    out.setdefault("num_experts", 0)
    return out


def gdn_to_megatron(take: Callable[..., Tensor], cfg: dict, hf: str, mg: str) -> Dict[str, Tensor]:
    """One Gated DeltaNet layer: HF ``{hf}`` (``...linear_attn.``) -> Megatron ``{mg}``.

    ``take(name, *shape)`` pops a tensor and checks its shape (:func:`megatron_branch.hf.mapping._taker`).
    """
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, hidden = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["hidden_size"]
    conv = 2 * nk * dk + nv * dv
    in_proj = [take(hf + "in_proj_qkv.weight", conv, hidden), take(hf + "in_proj_z.weight", nv * dv, hidden),
               take(hf + "in_proj_b.weight", nv, hidden), take(hf + "in_proj_a.weight", nv, hidden)]
    return qwen3_next.gdn_layer_to_megatron(take, cfg, hf, mg, torch.cat(in_proj))


def gdn_from_megatron(take: Callable[..., Tensor], cfg: dict, mg: str, hf: str) -> Dict[str, Tensor]:
    """Inverse of :func:`gdn_to_megatron`."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    qkv, z, b, a = take(mg + "in_proj.weight").split([2 * nk * dk + nv * dv, nv * dv, nv, nv])
    return {
        hf + "in_proj_qkv.weight": qkv, hf + "in_proj_z.weight": z, hf + "in_proj_b.weight": b,
        hf + "in_proj_a.weight": a,
        hf + "conv1d.weight": take(mg + "conv1d.weight"),
        hf + "A_log": take(mg + "A_log"),
        hf + "dt_bias": take(mg + "dt_bias"),
        hf + "norm.weight": take(mg + "out_norm.weight"),
        hf + "out_proj.weight": take(mg + "out_proj.weight"),
    }
