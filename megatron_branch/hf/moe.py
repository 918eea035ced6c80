"""Mixture-of-Experts layers, HF <-> Megatron: which layers, the router's fields, the tensors.

The MoE part of :mod:`megatron_branch.hf.mapping`, one rule set per architecture
(:data:`FAMILIES`). Megatron's side is its ``MoELayer`` with sequential experts
(``moe_grouped_gemm=False``): router ``mlp.router.weight``, expert ``j`` at
``mlp.experts.local_experts.{j}`` (``linear_fc1`` = ``[gate; up]``, ``linear_fc2`` = down),
shared experts at ``mlp.shared_experts`` (one MLP of ``moe_shared_expert_intermediate_size``,
its sigmoid gate ``gate_weight [1, hidden]`` with ``moe_shared_expert_gate``), the expert-bias
buffer ``mlp.router.expert_bias`` (float32, also in the checkpoint).

Routing, HF -> Megatron (checked against transformers' forward in tests/test_hf_moe_families.py):

* softmax then top-k without renormalising (Qwen3-MoE ``norm_topk_prob=false``):
  ``moe_router_pre_softmax=True``; renormalised top-k (Mixtral, Qwen3-Next, Qwen3.5-MoE,
  ``norm_topk_prob=true``): top-k of the logits then softmax over them (the same numbers);
* DeepSeek-V3 / GLM-4.5: ``sigmoid`` scores (``moe_router_score_function``), top-k chosen on
  ``scores + e_score_correction_bias`` (``moe_router_enable_expert_bias``, the bias loaded
  into ``expert_bias``), weights the chosen unbiased scores, renormalised
  (``norm_topk_prob``; Megatron always renormalises more than one expert), times
  ``routed_scaling_factor`` (``moe_router_topk_scaling_factor``). Group-limited routing
  (``n_group`` groups, ``topk_group`` kept, each group scored by its top-2 experts) is
  Megatron's ``moe_router_num_groups`` / ``moe_router_group_topk``, whose group score sums the
  top ``topk / group_topk`` experts: equal when that is 2, refused otherwise. HF computes these
  routers in float32 (``moe_router_dtype="fp32"``);
* the shared expert: Qwen3-Next / Qwen3.5-MoE ``shared_expert`` with its
  ``sigmoid(shared_expert_gate(x))`` gate (``moe_shared_expert_gate``), DeepSeek-V3 / GLM-4.5
  ``shared_experts`` of ``n_shared_experts * moe_intermediate_size`` without a gate.

Dense layers between MoE layers (HF's ``mlp_only_layers`` / ``decoder_sparse_step``,
``first_k_dense_replace``) are Megatron's ``moe_layer_freq`` as a per-layer list. Expert
weights are read per expert (``experts.{j}.gate_proj`` ...), as ``save_pretrained`` writes
them and the hub checkpoints hold them. The aux-loss coefficient is HF's
``router_aux_loss_coef`` where HF trains with it (``output_router_logits``), else 0; expert-bias
updates during training follow Megatron's ``moe_router_bias_update_rate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class Family:
    """How one architecture names and configures its MoE layers.

    Attributes:
        experts: config.json field(s) with the routed expert count (the first one set).
        ffn: config.json field with an expert's intermediate size.
        block: HF prefix of the MoE block inside a layer.
        names: HF names of an expert's (gate, up, down) projections.
        layers: which HF rule picks the MoE layers: ``"all"``, ``"sparse_step"``
            (``mlp_only_layers`` / ``decoder_sparse_step``) or ``"first_k_dense"``.
        score: ``"softmax"`` or ``"sigmoid"`` (then group-limited routing, a correction bias
            and a routed scaling factor).
        normalise: ``norm_topk_prob`` when config.json leaves it out (``None``: always).
        shared: HF prefix of the shared expert(s) in the block (``None``: none).
        shared_gate: HF name of the shared expert's sigmoid gate (``None``: ungated).
    """

    experts: Tuple[str, ...]
    ffn: str
    block: str = "mlp."
    names: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    layers: str = "all"
    score: str = "softmax"
    normalise: Optional[bool] = False
    shared: Optional[str] = None
    shared_gate: Optional[str] = None


_DEEPSEEK_LIKE = dict(experts=("n_routed_experts",), ffn="moe_intermediate_size", layers="first_k_dense",
                      score="sigmoid", normalise=True, shared="shared_experts.")
_QWEN_SHARED = dict(shared="shared_expert.", shared_gate="shared_expert_gate.weight")
FAMILIES: Dict[str, Family] = {
    "Qwen3MoeForCausalLM": Family(("num_experts", "num_local_experts"), "moe_intermediate_size", layers="sparse_step"),
    "MixtralForCausalLM": Family(("num_local_experts", "num_experts"), "intermediate_size", "block_sparse_moe.",
                                 ("w1", "w3", "w2"), normalise=None),
    "Qwen3NextForCausalLM": Family(("num_experts",), "moe_intermediate_size", layers="sparse_step", normalise=True,
                                   **_QWEN_SHARED),
    "Qwen3_5MoeForCausalLM": Family(("num_experts",), "moe_intermediate_size", normalise=None, **_QWEN_SHARED),
    "DeepseekV3ForCausalLM": Family(**_DEEPSEEK_LIKE),
    "Glm4MoeForCausalLM": Family(**_DEEPSEEK_LIKE),
}
# HF's config defaults for the routing fields of the sigmoid families (DeepseekV3Config, Glm4MoeConfig)
SIGMOID_DEFAULTS = {"DeepseekV3ForCausalLM": dict(n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                                  n_shared_experts=1, first_k_dense_replace=3),
                    "Glm4MoeForCausalLM": dict(n_group=1, topk_group=1, routed_scaling_factor=1.0,
                                               n_shared_experts=1, first_k_dense_replace=1)}
EXPERT_BIAS = "gate.e_score_correction_bias"  # HF, in the block; Megatron: mlp.router.expert_bias


def _int(cfg: dict, key: str, minimum: int = 1) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"config.json: {key} is {value!r}, expected {kind} integer")
    return value


def _get(cfg: dict, arch: str, key: str):
    value = cfg.get(key)
    return SIGMOID_DEFAULTS.get(arch, {}).get(key) if value is None else value


def num_experts(cfg: dict, arch: str) -> int:
    """Routed experts per MoE layer (0 without MoE layers)."""
    family = FAMILIES.get(arch)
    if family is None:
        return 0
    value = next((cfg[k] for k in family.experts if cfg.get(k) is not None), 0)
    return value if moe_layers(cfg, arch) else 0


def moe_layers(cfg: dict, arch: str) -> List[int]:
    """The layers HF builds as MoE blocks (its decoder layer's rule), in order."""
    family = FAMILIES.get(arch)
    if family is None:
        return []
    layers = cfg["num_hidden_layers"]
    experts = next((cfg[k] for k in family.experts if cfg.get(k) is not None), 0)
    if not experts:
        return []
    if family.layers == "first_k_dense":
        first = _get(cfg, arch, "first_k_dense_replace")
        first = _int(dict(first_k_dense_replace=first), "first_k_dense_replace", 0)
        return list(range(first, layers))
    if family.layers == "sparse_step":
        step, dense = cfg.get("decoder_sparse_step") or 1, cfg.get("mlp_only_layers") or []
        return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return list(range(layers))


def check_config(cfg: dict, arch: str) -> None:
    """Raise ``ValueError`` naming the field if the MoE layers of ``cfg`` cannot be mapped exactly."""
    family = FAMILIES[arch]
    if not moe_layers(cfg, arch):
        return
    for key in (next(k for k in family.experts if cfg.get(k) is not None), family.ffn, "num_experts_per_tok"):
        _int(cfg, key)
    topk, experts = cfg["num_experts_per_tok"], num_experts(cfg, arch)
    if topk > experts:
        raise ValueError(f"config.json: num_experts_per_tok {topk} exceeds the {experts} experts")
    if family.shared_gate is not None:
        _int(cfg, "shared_expert_intermediate_size", 0)
    if family.score != "sigmoid":
        return
    _int(dict(n_shared_experts=_get(cfg, arch, "n_shared_experts")), "n_shared_experts", 0)
    normalise = cfg.get("norm_topk_prob", family.normalise)
    if bool(normalise) != (topk > 1):
        raise ValueError(f"config.json: norm_topk_prob={normalise} with num_experts_per_tok={topk} is not supported: "
                         "Megatron's sigmoid router renormalises the top-k weights exactly when k > 1")
    groups, keep = _get(cfg, arch, "n_group"), _get(cfg, arch, "topk_group")
    groups = _int(dict(n_group=groups), "n_group")
    keep = _int(dict(topk_group=keep), "topk_group")
    if experts % groups or keep > groups:
        raise ValueError(f"config.json: n_group={groups}, topk_group={keep} do not divide the {experts} experts "
                         "into groups to keep")
    if keep < groups and topk // keep != 2:
        raise ValueError(f"config.json: topk_group={keep} with num_experts_per_tok={topk} is not supported: HF scores "
                         "a group by its top-2 experts, Megatron by its top num_experts_per_tok // topk_group (here "
                         f"{topk // keep})")
    scale = _get(cfg, arch, "routed_scaling_factor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"config.json: routed_scaling_factor is {scale!r}, expected a positive number")


def shared_size(cfg: dict, arch: str) -> int:
    """The shared expert's intermediate size (0: none)."""
    family = FAMILIES[arch]
    if family.shared is None:
        return 0
    if family.shared_gate is not None:
        return cfg.get("shared_expert_intermediate_size") or 0
    return _get(cfg, arch, "n_shared_experts") * cfg[family.ffn]


def megatron_args(cfg: dict, arch: str) -> dict:
    """``TransformerConfig`` MoE fields for ``cfg`` (checked by :func:`check_config`); ``{}``
    without MoE layers."""
    moe = moe_layers(cfg, arch)
    if not moe:
        return {}
    family, layers = FAMILIES[arch], cfg["num_hidden_layers"]
    topk = cfg["num_experts_per_tok"]
    normalise = family.normalise is None or bool(cfg.get("norm_topk_prob", family.normalise))
    coeff = float(cfg.get("router_aux_loss_coef", 0.0)) if cfg.get("output_router_logits") else 0.0
    out = dict(num_moe_experts=num_experts(cfg, arch), moe_router_topk=topk, moe_ffn_hidden_size=cfg[family.ffn],
               moe_router_score_function=family.score, moe_aux_loss_coeff=coeff,
               moe_router_pre_softmax=family.score == "softmax" and not normalise)
    if len(moe) < layers:
        out["moe_layer_freq"] = [int(i in moe) for i in range(layers)]
    shared = shared_size(cfg, arch)
    if shared:
        out.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=family.shared_gate is not None)
    if family.score == "sigmoid":
        groups, keep = _get(cfg, arch, "n_group"), _get(cfg, arch, "topk_group")
        if keep < groups:  # otherwise every group is kept: plain top-k
            out.update(moe_router_num_groups=groups, moe_router_group_topk=keep)
        scale = float(_get(cfg, arch, "routed_scaling_factor"))
        # HF computes these routers' logits in float32 whatever the model's dtype (bf16 weights too)
        out.update(moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=scale if scale != 1.0 else None,
                   moe_router_dtype="fp32")
    return out


# ---------------------------------------------------------------------------- weights
def _mlp_to_megatron(take: Callable[..., Tensor], hf: str, mg: str, names, ffn: int, hidden: int) -> Dict[str, Tensor]:
    gate, up, down = names
    return {mg + "linear_fc1.weight": torch.cat([take(f"{hf}{gate}.weight", ffn, hidden),
                                                 take(f"{hf}{up}.weight", ffn, hidden)]),
            mg + "linear_fc2.weight": take(f"{hf}{down}.weight", hidden, ffn)}


def _mlp_from_megatron(take: Callable[..., Tensor], mg: str, hf: str, names) -> Dict[str, Tensor]:
    gate, up = take(mg + "linear_fc1.weight").chunk(2)
    return {f"{hf}{names[0]}.weight": gate, f"{hf}{names[1]}.weight": up,
            f"{hf}{names[2]}.weight": take(mg + "linear_fc2.weight")}


def to_megatron(take: Callable[..., Tensor], cfg: dict, arch: str, hf: str, mg: str) -> Dict[str, Tensor]:
    """One MoE layer: HF ``{hf}`` (``model.layers.{i}.``) -> Megatron ``{mg}`` (``decoder.layers.{i}.``).

    ``take(name, *shape)`` pops a tensor and checks its shape (:func:`megatron_branch.hf.mapping._taker`).
    """
    family, hidden = FAMILIES[arch], cfg["hidden_size"]
    experts, ffn, block = num_experts(cfg, arch), cfg[family.ffn], hf + family.block
    out = {mg + "mlp.router.weight": take(block + "gate.weight", experts, hidden)}
    if family.score == "sigmoid":
        out[mg + "mlp.router.expert_bias"] = take(block + EXPERT_BIAS, experts)
    for j in range(experts):
        out.update(_mlp_to_megatron(take, f"{block}experts.{j}.", f"{mg}mlp.experts.local_experts.{j}.",
                                    family.names, ffn, hidden))
    shared = shared_size(cfg, arch)
    if shared:
        out.update(_mlp_to_megatron(take, block + family.shared, mg + "mlp.shared_experts.",
                                    FAMILIES["Qwen3MoeForCausalLM"].names, shared, hidden))
        if family.shared_gate is not None:
            out[mg + "mlp.shared_experts.gate_weight"] = take(block + family.shared_gate, 1, hidden)
    return out


def from_megatron(take: Callable[..., Tensor], cfg: dict, arch: str, mg: str, hf: str) -> Dict[str, Tensor]:
    """Inverse of :func:`to_megatron`."""
    family = FAMILIES[arch]
    block = hf + family.block
    out = {block + "gate.weight": take(mg + "mlp.router.weight")}
    if family.score == "sigmoid":
        out[block + EXPERT_BIAS] = take(mg + "mlp.router.expert_bias")
    for j in range(num_experts(cfg, arch)):
        out.update(_mlp_from_megatron(take, f"{mg}mlp.experts.local_experts.{j}.", f"{block}experts.{j}.",
                                      family.names))
    if shared_size(cfg, arch):
        out.update(_mlp_from_megatron(take, mg + "mlp.shared_experts.", block + family.shared,
                                      FAMILIES["Qwen3MoeForCausalLM"].names))
        if family.shared_gate is not None:
            out[block + family.shared_gate] = take(mg + "mlp.shared_experts.gate_weight")
    return out
