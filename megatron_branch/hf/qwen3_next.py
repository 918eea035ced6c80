"""Qwen3-Next (Gated DeltaNet + gated attention hybrid, dense MLP layers) <-> Megatron.

The per-architecture part of :mod:`megatron_branch.hf.mapping` for ``Qwen3NextForCausalLM``:
which configs convert, the hybrid ``TransformerConfig`` fields, and the tensors. Megatron's
side is megatron-core's ``GatedDeltaNet`` (>= 0.19) on local modules
(:mod:`megatron_branch.spec.stock_hybrid`) and its ``SelfAttention`` with
``attention_output_gate``. Every rule below was checked against transformers 5.24's
``modeling_qwen3_next.py`` numerically (tests/test_hf_qwen3_next.py).

Layers: ``layer_types`` (``"linear_attention"`` -> 1, ``"full_attention"`` -> 0; without it,
HF's ``full_attention_interval``) is Megatron's per-layer ``linear_attention_freq`` list.

Gated DeltaNet (HF ``linear_attn.`` -> Megatron ``self_attention.``):

* HF projects with ``in_proj_qkvz`` and ``in_proj_ba``, both grouped per key head ``g``
  (``fix_query_key_value_ordering``): rows ``[q_g (dk); k_g (dk); v_g (r*dv); z_g (r*dv)]``
  and ``[b_g (r); a_g (r)]`` with ``r = linear_num_value_heads / linear_num_key_heads``.
  Megatron's single ``in_proj`` holds whole sections ``[q; k; v; z; beta; alpha]``, each in
  head order (value head ``g*r + j`` both sides, both repeat q/k heads with
  ``repeat_interleave``), so the rows are regrouped: a permutation, exact both ways;
* ``conv1d`` runs over ``[q; k; v]`` channels on both sides, ``A_log`` and ``dt_bias`` are per
  value head in the same order, ``out_proj`` is the same: copied;
* HF's ``Qwen3NextRMSNormGated`` is ``weight * rmsnorm(x) * silu(z)`` (a plain weight);
  Megatron's ``out_norm`` followed by ``* silu(gate)`` is the same: ``norm`` copied to
  ``out_norm``.

Full attention (HF ``self_attn.``): ``q_proj`` gives per head ``[query (hd); gate (hd)]``;
Megatron's gated ``linear_qkv`` holds per KV group ``[queries; their gates; key; value]``
(``attention_output_gate=True``, ``sigmoid(gate)`` on the attention output both sides).
Partial RoPE: HF's ``partial_rotary_factor`` is Megatron's ``rotary_percent`` (both rotate
the first ``int(head_dim * factor)`` channels, rotate-half, the same inverse frequencies).

Zero-centered norms: HF's ``Qwen3NextRMSNorm`` (the layer norms, ``q_norm``, ``k_norm``,
``model.norm``) computes ``rmsnorm(x) * (1 + w)`` in float32. Megatron's local norms
(``WrappedTorchNorm``: ``torch.nn.RMSNorm``) refuse ``layernorm_zero_centered_gamma``, so
the conversion stores ``1 + w`` (float32, what HF's forward multiplies by, bit for bit) and
exports ``w_meg - 1``. The export is exact (``w_meg - 1`` is exact in float32 for
``w_meg >= 0.5``, so HF multiplies by ``w_meg`` again), the import only where ``1 + w`` keeps
every bit of ``w`` in float32 — every bf16 weight except some nonzero ``|w| < 2^-16``. Where it
does not (a float32 checkpoint; the mask of :func:`norm_to_megatron`), the import goes on, since
HF's own forward multiplies by the same rounded ``1 + w``, and warns naming the tensors whose
export will differ from the checkpoint by at most one float32 ulp of 1 (2^-23). Parameter
dtypes other than float32/float64 are refused (bfloat16 cannot hold ``1 + w``;
:func:`check_params_dtype`). The GDN ``out_norm`` is not zero-centered on either side.

Mixture-of-Experts layers (``num_experts`` > 0 on a layer outside ``mlp_only_layers``, every
``decoder_sparse_step``-th): routed experts with renormalised top-k and a sigmoid-gated
shared expert, mapped by :mod:`.moe`.

Refused (``ValueError`` naming the field): ``attention_bias``, RoPE scaling, an odd or empty
rotary part. Ignored on import, as transformers ignores them: the ``mtp.*`` tensors (the
multi-token-prediction head), so an export has none.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch import Tensor

ARCH = "Qwen3NextForCausalLM"
MODEL_TYPE = "qwen3_next"
# transformers 5.24's Qwen3NextConfig defaults for the fields the conversion reads, used
# where a config.json leaves one out (as from_pretrained would)
HF_DEFAULTS = {
    "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "decoder_sparse_step": 1, "num_experts": 512,
    "mlp_only_layers": [], "full_attention_interval": 4, "partial_rotary_factor": 0.25,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
}
GDN_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
              "linear_num_value_heads")
LAYER_TYPES = {"linear_attention": 1, "full_attention": 0}  # -> Megatron's linear_attention_freq entries
# The multi-token-prediction head of the hub checkpoints: transformers' Qwen3-Next drops it on
# load (_keys_to_ignore_on_load_unexpected), so its forward, the one converted, never uses it
IGNORED_PREFIX = "mtp."
# Megatron parameter dtypes that hold 1 + w of a float32 norm weight exactly
EXACT_NORM_DTYPES = (torch.float32, torch.float64)


def with_defaults(cfg: dict) -> dict:
    """``cfg`` with HF's defaults for the fields it leaves out (or sets to null)."""
    out = dict(cfg)
    for key, value in HF_DEFAULTS.items():
        if out.get(key) is None:
            out[key] = value
    return out


def layer_pattern(cfg: dict) -> List[int]:
    """Megatron's ``linear_attention_freq`` list: 1 for a Gated DeltaNet layer, 0 for attention.

    Raises:
        ValueError: ``layer_types`` of the wrong length or with an unknown type.
    """
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # HF: attention every full_attention_interval-th layer
        interval = cfg["full_attention_interval"]
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"config.json: full_attention_interval is {interval!r}, expected a positive integer")
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"config.json: layer_types has {len(types) if isinstance(types, list) else types!r} "
                         f"entries, expected num_hidden_layers={layers}")
    unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise ValueError(f"config.json: layer_types {unknown} are not supported (only "
                         f"{', '.join(LAYER_TYPES)})")
    return [LAYER_TYPES[t] for t in types]


def check_config(cfg: dict) -> None:
    """Raise ``ValueError`` naming the field if ``cfg`` (with :func:`with_defaults`) cannot be mapped."""
    for key in GDN_FIELDS + ("decoder_sparse_step",):
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.json: {key} is {value!r}, expected a positive integer")
    experts, dense = cfg["num_experts"], cfg["mlp_only_layers"]
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
        raise ValueError(f"config.json: num_experts is {experts!r}, expected a non-negative integer")
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"config.json: mlp_only_layers is {dense!r}, expected a list of layer indices")
    keys, values = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if values % keys:
        raise ValueError(f"config.json: linear_num_value_heads {values} is not a multiple of "
                         f"linear_num_key_heads {keys}")
    if cfg.get("attention_bias", False):
        raise ValueError("config.json: attention_bias=true is not supported for Qwen3-Next (Megatron's gated "
                         "linear_qkv bias and o_proj bias are not mapped)")
    layer_pattern(cfg)


def check_params_dtype(dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless ``dtype`` holds the shifted norm weights ``1 + w`` exactly."""
    if dtype not in EXACT_NORM_DTYPES:
        name = str(dtype).replace("torch.", "")
        raise ValueError(f"--dtype: {name} is not supported for {ARCH}: its RMSNorms multiply by 1 + w in "
                         f"float32, which megatron-core's local norms hold as their weight; a {name} weight "
                         "would round it (use fp32)")


def rotary_percent(cfg: dict, params: dict) -> float:
    """HF's ``partial_rotary_factor`` (in the RoPE parameters or top-level), checked."""
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    factor = float(HF_DEFAULTS["partial_rotary_factor"] if factor is None else factor)
    dim = int(cfg["head_dim"] * factor)
    if not 0.0 < factor <= 1.0 or dim < 2 or dim % 2:
        raise ValueError(f"config.json: partial_rotary_factor={factor} with head_dim={cfg['head_dim']} gives "
                         f"a rotary part of {dim} channels; an even, positive number up to head_dim is needed")
    return factor


def megatron_args(cfg: dict, params: dict) -> Tuple[dict, dict]:
    """``(TransformerConfig fields, GPTModel fields)`` beyond the common ones.

    Args:
        cfg: the HF config dict (with :func:`with_defaults`, checked by :func:`check_config`).
        params: HF's RoPE parameters (``rope_parameters`` updated by ``rope_scaling``).

    Raises:
        ValueError: RoPE scaling or a rotary part Megatron's RoPE cannot express, named.
    """
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in (None, "default"):
        raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported for {ARCH} (default only)")
    config = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=layer_pattern(cfg),
                  **{key: cfg[key] for key in GDN_FIELDS}, attention_output_gate=True, qk_layernorm=True,
                  # selects Megatron's torch GDN kernels (FLA's are CUDA/Triton)
                  deterministic_mode=True)
    return config, dict(rotary_percent=rotary_percent(cfg, params))


# ---------------------------------------------------------------------------- weights
def lost_bits_warning(names: List[str]) -> str:
    """The warning for zero-centered norm tensors whose ``1 + w`` (float32) drops bits of ``w``."""
    shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"checkpoint: {len(names)} zero-centered norm tensor(s) ({shown}) have entries that 1 + w in float32 "
            "does not hold exactly; the converted model computes what transformers computes (it multiplies by the "
            "same float32 1 + w), but the export gives these entries back within 2^-23 (one float32 ulp of 1), "
            "not bit for bit")


def norm_to_megatron(w: Tensor) -> Tuple[Tensor, Tensor]:
    """``(1 + w in float32, mask of the entries of w it does not keep)`` for a zero-centered
    HF norm weight ``w [n]``.

    HF's forward multiplies by ``1.0 + weight.float()``: the returned weight is that product's
    factor bit for bit. An entry is lost when ``(1 + w) - 1 != w`` in float32 (only nonzero
    ``|w| < 2^-16`` for a bf16 checkpoint); the caller warns about those (:func:`lost_bits_warning`).
    """
    shifted = w.to(torch.float32) + 1.0
    lost = (shifted - 1.0).to(w.dtype) != w
    return shifted, lost


def norm_from_megatron(w: Tensor) -> Tensor:
    """Inverse of :func:`norm_to_megatron` (``w_meg - 1``; exact for ``w_meg >= 0.5``)."""
    return w - 1.0


def _gdn_dims(cfg: dict) -> Tuple[int, int, int, int, int]:
    """``(key heads, value heads per key head, key head dim, value head dim, value heads)``."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    return nk, nv // nk, cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv


def gdn_to_megatron(take: Callable[..., Tensor], cfg: dict, hf: str, mg: str) -> Dict[str, Tensor]:
    """One Gated DeltaNet layer: HF ``{hf}`` (``...linear_attn.``) -> Megatron ``{mg}`` (``...self_attention.``).

    ``take(name, *shape)`` pops a tensor and checks its shape (:func:`megatron_branch.hf.mapping._taker`).
    """
    nk, r, dk, dv, nv = _gdn_dims(cfg)
    hidden = cfg["hidden_size"]
    # [nk * (2 dk + 2 r dv), H] -> [nk, 2 dk + 2 r dv, H] -> per key head q, k, v, z
    qkvz = take(hf + "in_proj_qkvz.weight", nk * (2 * dk + 2 * r * dv), hidden).reshape(nk, -1, hidden)
    q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
    # [nk * 2r, H] -> [nk, 2r, H] -> per key head b (beta), a (alpha)
    b, a = take(hf + "in_proj_ba.weight", nk * 2 * r, hidden).reshape(nk, 2 * r, hidden).split([r, r], dim=1)
    # each [nk, rows, H] -> [nk * rows, H]: whole sections in head order
    in_proj = torch.cat([t.reshape(-1, hidden) for t in (q, k, v, z, b, a)])
    return gdn_layer_to_megatron(take, cfg, hf, mg, in_proj)


def gdn_layer_to_megatron(take: Callable[..., Tensor], cfg: dict, hf: str, mg: str, in_proj: Tensor
                          ) -> Dict[str, Tensor]:
    """A Gated DeltaNet layer's Megatron tensors given its fused ``in_proj [rows, H]`` (laid out per
    family: Qwen3-Next interleaves per key head, Qwen3.5 concatenates): the rest maps 1:1."""
    nv, dv, hidden = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"], cfg["hidden_size"]
    conv = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + nv * dv
    return {
        mg + "in_proj.weight": in_proj,
        mg + "conv1d.weight": take(hf + "conv1d.weight", conv, 1, cfg["linear_conv_kernel_dim"]),
        mg + "A_log": take(hf + "A_log", nv),
        mg + "dt_bias": take(hf + "dt_bias", nv),
        mg + "out_norm.weight": take(hf + "norm.weight", dv),
        mg + "out_proj.weight": take(hf + "out_proj.weight", hidden, nv * dv),
    }


def gdn_from_megatron(take: Callable[..., Tensor], cfg: dict, mg: str, hf: str) -> Dict[str, Tensor]:
    """Inverse of :func:`gdn_to_megatron`."""
    nk, r, dk, dv, nv = _gdn_dims(cfg)
    in_proj = take(mg + "in_proj.weight")
    hidden = in_proj.shape[1]
    # [q; k; v; z; beta; alpha] -> each [nk, rows per key head, H]
    q, k, v, z, b, a = (t.reshape(nk, -1, hidden) for t in in_proj.split([nk * dk, nk * dk, nv * dv, nv * dv, nv,
                                                                          nv]))
    return {
        hf + "in_proj_qkvz.weight": torch.cat([q, k, v, z], dim=1).reshape(-1, hidden),
        hf + "in_proj_ba.weight": torch.cat([b, a], dim=1).reshape(-1, hidden),
        hf + "conv1d.weight": take(mg + "conv1d.weight"),
        hf + "A_log": take(mg + "A_log"),
        hf + "dt_bias": take(mg + "dt_bias"),
        hf + "norm.weight": take(mg + "out_norm.weight"),
        hf + "out_proj.weight": take(mg + "out_proj.weight"),
    }


def _heads(cfg: dict) -> Tuple[int, int, int]:
    return cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]


def attention_to_megatron(take: Callable[..., Tensor], take_norm: Callable[..., Tensor], cfg: dict, hf: str,
                          mg: str) -> Dict[str, Tensor]:
    """One gated attention layer: HF ``{hf}`` (``...self_attn.``) -> Megatron ``{mg}``.

    ``take_norm(name, size)`` takes a zero-centered norm weight and returns it shifted
    (:func:`norm_to_megatron`, refusing lost entries).
    """
    heads, groups, hd = _heads(cfg)
    hidden = cfg["hidden_size"]
    # [heads * 2 hd, H] -> [groups, heads/groups, 2 hd, H] -> query and gate, each [groups, heads/groups * hd, H]
    qg = take(hf + "q_proj.weight", heads * 2 * hd, hidden).reshape(groups, heads // groups, 2 * hd, hidden)
    query, gate = (t.reshape(groups, -1, hidden) for t in qg.split([hd, hd], dim=2))
    k = take(hf + "k_proj.weight", groups * hd, hidden).reshape(groups, hd, hidden)
    v = take(hf + "v_proj.weight", groups * hd, hidden).reshape(groups, hd, hidden)
    return {
        # per KV group [queries; gates; key; value] -> [groups * (2 heads/groups + 2) * hd, H]
        mg + "linear_qkv.weight": torch.cat([query, gate, k, v], dim=1).reshape(-1, hidden),
        mg + "q_layernorm.weight": take_norm(hf + "q_norm.weight", hd),
        mg + "k_layernorm.weight": take_norm(hf + "k_norm.weight", hd),
        mg + "linear_proj.weight": take(hf + "o_proj.weight", hidden, heads * hd),
    }


def attention_from_megatron(take: Callable[..., Tensor], cfg: dict, mg: str, hf: str) -> Dict[str, Tensor]:
    """Inverse of :func:`attention_to_megatron`."""
    heads, groups, hd = _heads(cfg)
    qkv = take(mg + "linear_qkv.weight")
    hidden = qkv.shape[1]
    per = heads // groups * hd
    # [groups * (2 per + 2 hd), H] -> [groups, 2 per + 2 hd, H] -> queries, gates, key, value
    query, gate, k, v = qkv.reshape(groups, -1, hidden).split([per, per, hd, hd], dim=1)
    # queries and gates [groups, heads/groups, hd, H] -> per head [query; gate]
    qg = torch.cat([query.reshape(groups, -1, hd, hidden), gate.reshape(groups, -1, hd, hidden)], dim=2)
    return {
        hf + "q_proj.weight": qg.reshape(-1, hidden),
        hf + "k_proj.weight": k.reshape(-1, hidden),
        hf + "v_proj.weight": v.reshape(-1, hidden),
        hf + "q_norm.weight": norm_from_megatron(take(mg + "q_layernorm.weight")),
        hf + "k_norm.weight": norm_from_megatron(take(mg + "k_layernorm.weight")),
        hf + "o_proj.weight": take(mg + "linear_proj.weight"),
    }
