"""HF (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, DeepSeek-V3, Qwen3-Next, Qwen3.5) <-> Megatron GPTModel.

Our own code: Megatron-Bridge, the usual converter, needs Transformer Engine and CUDA.
Weights are plain tensors keyed by name on both sides; Megatron names are the stock
local-spec names with global layer numbers (as :func:`megatron_branch.full_state.full_state`
returns). Layouts that differ:

* ``linear_qkv`` interleaves per KV group: for group ``g``, the ``heads / kv_heads`` query
  heads, then its key head, then its value head (rows of ``head_dim``); Qwen2's biases alike;
* ``linear_fc1`` is ``[gate_proj; up_proj]`` stacked on the output dimension;
* Mixture of Experts (Qwen3-MoE, Mixtral, Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3; dense
  layers between MoE layers; routers, shared experts): :mod:`.moe`;
* DeepSeek-V3's multi-latent attention: :mod:`.deepseek`;
* Qwen3-Next's Gated DeltaNet / gated attention hybrid, whose zero-centered RMSNorm weights
  ``w`` are stored as ``1 + w``: :mod:`.qwen3_next`; Qwen3.5's (split GDN projections): :mod:`.qwen3_5`.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_branch.hf import deepseek, glm4_moe, moe, qwen3_5, qwen3_next

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
             "Qwen3MoeForCausalLM", "MixtralForCausalLM", deepseek.ARCH, qwen3_next.ARCH, glm4_moe.ARCH) + qwen3_5.ARCHS
MOE_ARCHS = tuple(a for a in moe.FAMILIES if a in SUPPORTED)  # may have MoE layers: .moe
MLA_ARCHS = (deepseek.ARCH,)  # multi-latent attention: MLATransformerConfig, attention mapped by .deepseek
# Gated DeltaNet hybrids: layers and norms mapped by .qwen3_next (GDN projections of Qwen3.5 by .qwen3_5)
HYBRID_ARCHS = (qwen3_next.ARCH,) + qwen3_5.ARCHS
# Checkpoint tensors transformers drops on load (its _keys_to_ignore_on_load_unexpected), so the
# forward converted never uses them: the multi-token-prediction heads (Qwen3-Next / Qwen3.5
# ``mtp.*``; DeepSeek-V3 / GLM-4.5 as the layers after the last, ``model.layers.{num_hidden_layers}.``)
# and Qwen3.5's vision tower. An export has none of them.
_IGNORED_PREFIXES = {qwen3_next.ARCH: (qwen3_next.IGNORED_PREFIX,), qwen3_5.DENSE: ("mtp.", "model.visual."),
                     qwen3_5.MOE: ("mtp.", "model.visual.")}
_EXTRA_LAYERS_IGNORED = (deepseek.ARCH, glm4_moe.ARCH)
# Megatron's built-in Llama-3 RoPE scaling uses these fixed parameters.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _arch(cfg: dict) -> str:
    cfg = qwen3_5.text_config(cfg)  # a released multimodal Qwen3.5: its text model
    archs = cfg.get("architectures") or []
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
               "deepseek_v3": deepseek.ARCH, qwen3_next.MODEL_TYPE: qwen3_next.ARCH, **qwen3_5.MODEL_TYPES,
               glm4_moe.MODEL_TYPE: glm4_moe.ARCH}
    arch = archs[0] if archs else by_type.get(cfg.get("model_type"), "")
    if arch not in SUPPORTED:
        raise ValueError(f"config.json: architecture {arch or cfg.get('model_type')!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED)})")
    return arch


def architecture(cfg: dict) -> str:
    """The architecture the conversion maps ``cfg`` as (a released multimodal Qwen3.5: its text model).

    Raises:
        ValueError: an unsupported one (the supported ones listed).
    """
    return _arch(cfg)


def _with_defaults(cfg: dict, arch: str) -> dict:
    """``cfg`` with the architecture's HF defaults for fields a config.json may leave out
    (Qwen3-Next's differ from the generic fallbacks, e.g. ``head_dim`` 256); a released
    multimodal Qwen3.5 config as its text model's."""
    cfg = qwen3_5.text_config(cfg)
    if arch in qwen3_5.ARCHS:
        return qwen3_5.with_defaults(cfg, arch)
    return qwen3_next.with_defaults(cfg) if arch in HYBRID_ARCHS else cfg


def check_params_dtype(cfg: dict, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` if the weights of ``cfg`` cannot be held exactly in Megatron
    parameters of ``dtype`` (Qwen3-Next's shifted norm weights need float32)."""
    if _arch(cfg) in HYBRID_ARCHS:
        qwen3_next.check_params_dtype(dtype)


def _rope_params(cfg: dict) -> Tuple[float, dict]:
    """``(rope_theta, HF RoPE parameters)``: ``rope_parameters`` updated by ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    if scaling:
        params.update(scaling)
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))), params


def _rope(cfg: dict) -> Tuple[float, dict]:
    theta, params = _rope_params(cfg)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, {}
    if kind == "llama3":
        for key, value in LLAMA3_ROPE.items():
            if float(params.get(key, value)) != value:
                raise ValueError(f"config.json: llama3 rope_scaling {key}={params.get(key)} is not supported "
                                 f"(megatron-core fixes it to {value})")
        return theta, {"rope_scaling": True, "rope_scaling_factor": float(params.get("factor", 8.0))}
    raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported (only llama3)")


# config.json fields the conversion reads (positive integers), per architecture
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
REQUIRED_MOE = {"Qwen3MoeForCausalLM": ("num_experts_per_tok", "moe_intermediate_size"),
                "MixtralForCausalLM": ("num_experts_per_tok",)}


def _check_fields(cfg: dict, arch: str) -> None:
    keys = REQUIRED + REQUIRED_MOE.get(arch, ())
    missing = [k for k in keys if cfg.get(k) is None]
    if arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        keys += ("num_experts", "num_local_experts")  # either names the experts
        if not (cfg.get("num_experts") or cfg.get("num_local_experts")):
            missing.append("num_experts (or num_local_experts)")
    if missing:
        raise ValueError(f"config.json: lacks {', '.join(missing)} (needed for {arch}); pass the model's complete "
                         "config.json")
    for key in keys + ("num_key_value_heads", "head_dim"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"config.json: {key} is {value!r}, expected a positive integer")
    heads, groups = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % groups:
        raise ValueError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    if arch in MLA_ARCHS:
        deepseek.check_config(cfg)
    if arch in HYBRID_ARCHS:
        qwen3_next.check_config(cfg)
    if arch in MOE_ARCHS:
        moe.check_config(cfg, arch)


def megatron_args_from_hf(cfg: dict) -> Tuple[dict, dict]:
    """``(TransformerConfig kwargs, GPTModel kwargs)`` for a Hugging Face config dict.

    Raises:
        ValueError: an unsupported architecture, activation or RoPE scaling, or a
            missing/invalid size field (named).
    """
    arch = _arch(cfg)
    cfg = _with_defaults(cfg, arch)
    _check_fields(cfg, arch)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    window = cfg.get("sliding_window")
    if window is not None and cfg.get("use_sliding_window", arch in ("MistralForCausalLM", "MixtralForCausalLM")):
        raise ValueError(f"config.json: sliding_window={window} is not supported by tree attention")
    heads = cfg["num_attention_heads"]
    theta, params = _rope_params(cfg)
    # GPTModel's own RoPE; multi-latent attention builds its RoPE (and YaRN) from config fields,
    # Qwen3-Next's (partial, unscaled) is checked by .qwen3_next
    rope = _rope(cfg)[1] if arch not in MLA_ARCHS + HYBRID_ARCHS + (glm4_moe.ARCH,) else {}
    config = dict(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads, ffn_hidden_size=cfg["intermediate_size"],
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6), normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        qk_layernorm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    )
    if arch == glm4_moe.ARCH:  # qk norms by use_qk_norm; partial RoPE (rotary_percent)
        glm, glm_model = glm4_moe.megatron_args(cfg, params)
        config.update(glm)
        rope = glm_model
    config.update(moe.megatron_args(cfg, arch) if arch in MOE_ARCHS else {})
    if arch in MLA_ARCHS:  # MLATransformerConfig: head sizes and RoPE are its own fields
        for key in ("num_query_groups", "kv_channels", "add_qkv_bias"):
            config.pop(key)
        config.update(deepseek.mla_args(cfg, theta, params))
    if arch in HYBRID_ARCHS:  # layer pattern, GDN sizes, gated attention; rotary_percent
        hybrid, hybrid_model = qwen3_next.megatron_args(cfg, params)
        config.update(hybrid)
        rope.update(hybrid_model)
    model = dict(
        vocab_size=cfg["vocab_size"], max_sequence_length=cfg.get("max_position_embeddings", 4096),
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        position_embedding_type="rope", rotary_base=theta, **rope,
    )
    return config, model


def num_experts(cfg: dict) -> int:
    """Routed experts of a MoE config (0 for a dense one)."""
    arch = _arch(cfg)
    return moe.num_experts(_with_defaults(cfg, arch), arch) if arch in MOE_ARCHS else 0


def moe_layer_set(cfg: dict, arch: str) -> set:
    """Indices of the MoE layers of ``cfg`` (with defaults)."""
    return set(moe.moe_layers(cfg, arch)) if arch in MOE_ARCHS else set()


def _dims(cfg: dict) -> Tuple[int, int, int]:
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    return heads, groups, cfg.get("head_dim") or cfg["hidden_size"] // heads


def _qkv_to_megatron(q: Tensor, k: Tensor, v: Tensor, cfg: dict) -> Tensor:
    heads, groups, hd = _dims(cfg)
    rest = q.shape[1:]
    # [heads * hd, ...] -> [groups, heads/groups * hd, ...]; k, v -> [groups, hd, ...]
    q = q.reshape(groups, heads // groups * hd, *rest)
    k = k.reshape(groups, hd, *rest)
    v = v.reshape(groups, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_from_megatron(qkv: Tensor, cfg: dict) -> Tuple[Tensor, Tensor, Tensor]:
    heads, groups, hd = _dims(cfg)
    rest = qkv.shape[1:]
    per = heads // groups * hd
    qkv = qkv.reshape(groups, per + 2 * hd, *rest)
    q, k, v = qkv.split([per, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


class TensorError(ValueError):
    """A missing tensor or one of the wrong shape; ``tensor`` is its name."""

    def __init__(self, message: str, tensor: str):
        super().__init__(message)
        self.tensor = tensor


def _taker(todo: Dict[str, Tensor], what: str):
    """``take(name, *shape)``: pop ``name`` from ``todo`` (checking its shape when given)
    or raise naming it."""

    def take(name: str, *shape: int) -> Tensor:
        if name not in todo:
            raise TensorError(f"{what}: missing tensor {name!r}", name)
        tensor = todo.pop(name)
        if shape and tuple(tensor.shape) != shape:
            raise TensorError(f"{what}: tensor {name!r} has shape {list(tensor.shape)}, config.json implies "
                              f"{list(shape)}; the weights do not belong to this config", name)
        return tensor

    return take


def _norm_taker(take, arch: str, lost: List[str]):
    """``take_norm(name, size)``: ``take`` for a norm weight; for zero-centered norms
    (Qwen3-Next, Qwen3.5) the weight ``1 + w``, the names of tensors whose entries it does not
    keep (they would come back within 2^-23 on export, not bit for bit) appended to ``lost``."""
    if arch not in HYBRID_ARCHS:
        return take

    def take_norm(name: str, size: int) -> Tensor:
        shifted, dropped = qwen3_next.norm_to_megatron(take(name, size))
        if dropped.any():
            lost.append(name)
        return shifted

    return take_norm


def _attention_to_megatron(take, todo: Dict[str, Tensor], cfg: dict, hf: str, mg: str) -> Dict[str, Tensor]:
    """One layer's (grouped-query) attention: HF ``{hf}`` (``...self_attn.``) -> Megatron ``{mg}``."""
    heads, groups, hd = _dims(cfg)
    hidden = cfg["hidden_size"]
    out = {mg + "linear_qkv.weight": _qkv_to_megatron(
        take(hf + "q_proj.weight", heads * hd, hidden), take(hf + "k_proj.weight", groups * hd, hidden),
        take(hf + "v_proj.weight", groups * hd, hidden), cfg)}
    if hf + "q_proj.bias" in todo:
        out[mg + "linear_qkv.bias"] = _qkv_to_megatron(
            take(hf + "q_proj.bias", heads * hd), take(hf + "k_proj.bias", groups * hd),
            take(hf + "v_proj.bias", groups * hd), cfg)
    if hf + "q_norm.weight" in todo:
        out[mg + "q_layernorm.weight"] = take(hf + "q_norm.weight", hd)
        out[mg + "k_layernorm.weight"] = take(hf + "k_norm.weight", hd)
    out[mg + "linear_proj.weight"] = take(hf + "o_proj.weight", hidden, heads * hd)
    return out


def _attention_from_megatron(take, todo: Dict[str, Tensor], cfg: dict, mg: str, hf: str) -> Dict[str, Tensor]:
    """Inverse of :func:`_attention_to_megatron`."""
    q, k, v = _qkv_from_megatron(take(mg + "linear_qkv.weight"), cfg)
    out = {hf + "q_proj.weight": q, hf + "k_proj.weight": k, hf + "v_proj.weight": v}
    if mg + "linear_qkv.bias" in todo:
        q, k, v = _qkv_from_megatron(take(mg + "linear_qkv.bias"), cfg)
        out.update({hf + "q_proj.bias": q, hf + "k_proj.bias": k, hf + "v_proj.bias": v})
    if mg + "q_layernorm.weight" in todo:
        out[hf + "q_norm.weight"] = take(mg + "q_layernorm.weight")
        out[hf + "k_norm.weight"] = take(mg + "k_layernorm.weight")
    out[hf + "o_proj.weight"] = take(mg + "linear_proj.weight")
    return out


def _ignored(name: str, arch: str, cfg: dict) -> bool:
    """Whether transformers drops the checkpoint tensor ``name`` on load (:data:`_IGNORED_PREFIXES`)."""
    if name.startswith(_IGNORED_PREFIXES.get(arch, ())):
        return True
    if arch in _EXTRA_LAYERS_IGNORED and name.startswith("model.layers."):
        index = name.split(".")[2]
        return index.isdigit() and int(index) >= cfg["num_hidden_layers"]
    return False


def hf_to_megatron(state: Dict[str, Tensor], cfg: dict) -> Dict[str, Tensor]:
    """HF ``model.*`` / ``lm_head`` tensors -> stock Megatron names (copies, same dtype;
    Qwen3-Next's zero-centered norm weights as ``1 + w`` in float32).

    Raises:
        TensorError: a missing tensor or one whose shape does not match ``cfg``, named.
        ValueError: unexpected tensors, or a config that is not supported.
    """
    arch = _arch(cfg)
    if qwen3_5.is_released(cfg):
        state = qwen3_5.to_text_names(state)
    cfg = _with_defaults(cfg, arch)
    _check_fields(cfg, arch)
    todo = dict(state)
    take = _taker(todo, "checkpoint")
    heads, groups, hd = _dims(cfg)
    hidden, vocab, ffn = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]

    lost: List[str] = []
    take_norm = _norm_taker(take, arch, lost)
    gdn = qwen3_next.layer_pattern(cfg) if arch in HYBRID_ARCHS else [0] * cfg["num_hidden_layers"]
    gdn_to_megatron = qwen3_5.gdn_to_megatron if arch in qwen3_5.ARCHS else qwen3_next.gdn_to_megatron
    moe_set = moe_layer_set(cfg, arch)

    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight", vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out[mg + "input_layernorm.weight"] = take_norm(hf + "input_layernorm.weight", hidden)
        if gdn[i]:
            out.update(gdn_to_megatron(take, cfg, hf + "linear_attn.", mg + "self_attention."))
        elif arch in HYBRID_ARCHS:
            out.update(qwen3_next.attention_to_megatron(take, take_norm, cfg, attn, mg + "self_attention."))
        elif arch in MLA_ARCHS:
            out.update(deepseek.attention_to_megatron(take, cfg, attn, mg + "self_attention."))
        else:
            out.update(_attention_to_megatron(take, todo, cfg, attn, mg + "self_attention."))
        out[mg + "pre_mlp_layernorm.weight"] = take_norm(hf + "post_attention_layernorm.weight", hidden)
        if i in moe_set:
            out.update(moe.to_megatron(take, cfg, arch, hf, mg))
            continue
        out[mg + "mlp.linear_fc1.weight"] = torch.cat(
            [take(hf + "mlp.gate_proj.weight", ffn, hidden), take(hf + "mlp.up_proj.weight", ffn, hidden)])
        out[mg + "mlp.linear_fc2.weight"] = take(hf + "mlp.down_proj.weight", hidden, ffn)
    out["decoder.final_layernorm.weight"] = take_norm("model.norm.weight", hidden)
    if not cfg.get("tie_word_embeddings", False):
        out["output_layer.weight"] = take("lm_head.weight", vocab, hidden)
    else:
        todo.pop("lm_head.weight", None)
    todo = {k: v for k, v in todo.items() if not k.endswith("rotary_emb.inv_freq") and not _ignored(k, arch, cfg)}
    if todo:
        raise ValueError(f"checkpoint: unexpected tensors {sorted(todo)[:5]}")
    if lost:
        warnings.warn(qwen3_next.lost_bits_warning(lost), stacklevel=2)
    return out


def megatron_to_hf(state: Dict[str, Tensor], cfg: dict) -> Dict[str, Tensor]:
    """Stock Megatron names -> HF names (inverse of :func:`hf_to_megatron`; a released multimodal
    Qwen3.5's language model under its released names)."""
    arch = _arch(cfg)
    released = qwen3_5.is_released(cfg)
    cfg = _with_defaults(cfg, arch)
    todo = dict(state)
    take = _taker(todo, "megatron state")
    # zero-centered norms (Qwen3-Next): Megatron holds 1 + w
    norm = qwen3_next.norm_from_megatron if arch in HYBRID_ARCHS else (lambda w: w)
    gdn = qwen3_next.layer_pattern(cfg) if arch in HYBRID_ARCHS else [0] * cfg["num_hidden_layers"]
    gdn_from_megatron = qwen3_5.gdn_from_megatron if arch in qwen3_5.ARCHS else qwen3_next.gdn_from_megatron
    moe_set = moe_layer_set(cfg, arch)

    out = {"model.embed_tokens.weight": take("embedding.word_embeddings.weight")}
    for i in range(cfg["num_hidden_layers"]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out[hf + "input_layernorm.weight"] = norm(take(mg + "input_layernorm.weight"))
        if gdn[i]:
            out.update(gdn_from_megatron(take, cfg, mg + "self_attention.", hf + "linear_attn."))
        elif arch in HYBRID_ARCHS:
            out.update(qwen3_next.attention_from_megatron(take, cfg, mg + "self_attention.", attn))
        elif arch in MLA_ARCHS:
            out.update(deepseek.attention_from_megatron(take, cfg, mg + "self_attention.", attn))
        else:
            out.update(_attention_from_megatron(take, todo, cfg, mg + "self_attention.", attn))
        out[hf + "post_attention_layernorm.weight"] = norm(take(mg + "pre_mlp_layernorm.weight"))
        if i in moe_set:
            out.update(moe.from_megatron(take, cfg, arch, mg, hf))
            continue
        gate, up = take(mg + "mlp.linear_fc1.weight").chunk(2)
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
        out[hf + "mlp.down_proj.weight"] = take(mg + "mlp.linear_fc2.weight")
    out["model.norm.weight"] = norm(take("decoder.final_layernorm.weight"))
    if "output_layer.weight" in todo:
        out["lm_head.weight"] = take("output_layer.weight")
    if todo:
        raise ValueError(f"megatron state: unexpected tensors {sorted(todo)[:5]}")
    if released:  # the released checkpoint's names
        out = qwen3_5.to_released_names(out)
    return {k: v.contiguous() for k, v in out.items()}
