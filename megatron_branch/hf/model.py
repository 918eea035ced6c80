"""Branch-spec GPTModels from Hugging Face checkpoints, and a live model's weights back.

``model, config = load_gpt_from_hf(hf_dir)`` builds the Megatron GPTModel (branch spec),
loads the weights and returns the pair (the model and its ``TransformerConfig``; pass
``model`` on, not the pair); ``export_hf_state(model, hf_config)`` returns a live (possibly TP/PP/EP sharded)
model's full weights under HF names — what an RL stack sends to its rollout engine after
each step. Mapping rules: :mod:`megatron_branch.hf.mapping`.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from megatron_branch._megatron import gdn_unavailable_reason
from megatron_branch.full_state import WEIGHT_BUFFERS, full_state, load_full_state
from megatron_branch.hf.io import read_config, read_weights
from megatron_branch.hf.mapping import (
    check_params_dtype,
    hf_to_megatron,
    megatron_args_from_hf,
    megatron_to_hf,
    num_experts,
)
from megatron_branch.layout import ParallelLayout
from megatron_branch.spec.builders import build_gpt, hybrid_config, llama_config, mla_config


def build_from_hf_config(hf_cfg: dict, params_dtype: torch.dtype = torch.float32, spec_kwargs: Optional[dict] = None,
                         **config_overrides):
    """``(GPTModel, TransformerConfig)`` with the branch spec for a HF config dict (random weights);
    an ``MLATransformerConfig`` for multi-latent attention (DeepSeek-V3), a hybrid Gated
    DeltaNet config (:func:`~megatron_branch.spec.builders.hybrid_config`) for Qwen3-Next.

    Raises:
        ValueError: an unsupported config, or a ``params_dtype`` that cannot hold its
            weights exactly (:func:`~megatron_branch.hf.mapping.check_params_dtype`).
    """
    check_params_dtype(hf_cfg, params_dtype)
    config_kwargs, model_kwargs = megatron_args_from_hf(hf_cfg)
    layout = ParallelLayout.current()
    needs_sp = config_kwargs.get("experimental_attention_variant") or config_kwargs.get("num_moe_experts")
    if needs_sp and layout.initialized and layout.tp > 1:
        # the branch GDN layer refuses TP without sequence parallelism (its out_norm gradient
        # is summed over the TP ranks only for sequence-parallel norms; spec/gdn.py), and so does
        # megatron-core's TransformerConfig for MoE layers under TP
        config_kwargs.update(tensor_model_parallel_size=layout.tp, sequence_parallel=True)
    config_kwargs.update(config_overrides)
    if num_experts(hf_cfg):  # Megatron's MoE layers with sequential experts, branch statistics
        spec_kwargs = {"num_experts": num_experts(hf_cfg), "moe_grouped_gemm": False, **(spec_kwargs or {})}
    # DeepSeek-V3: an MLATransformerConfig (multi-latent attention); Qwen3-Next: the hybrid
    # GDN config (deterministic_mode: Megatron's torch GDN kernels); otherwise a plain one
    if config_kwargs.get("multi_latent_attention"):
        make_config = mla_config
    elif config_kwargs.get("experimental_attention_variant") == "gated_delta_net":
        reason = gdn_unavailable_reason()
        if reason:  # megatron-core 0.16 has no GatedDeltaNet: say so before TransformerConfig rejects the fields
            raise ValueError(f"{(hf_cfg.get('architectures') or [hf_cfg.get('model_type')])[0]}: {reason}")
        config_kwargs.pop("experimental_attention_variant")  # hybrid_config sets it
        make_config = hybrid_config
    else:
        make_config = llama_config
    config = make_config(params_dtype=params_dtype, **config_kwargs)
    if layout.initialized:
        model_kwargs.setdefault("pre_process", layout.first_stage)
        model_kwargs.setdefault("post_process", layout.last_stage)
    vocab = model_kwargs.pop("vocab_size")
    max_len = model_kwargs.pop("max_sequence_length")
    model = build_gpt(config, vocab, max_sequence_length=max_len, spec_kwargs=spec_kwargs, **model_kwargs)
    return model, config


def load_gpt_from_hf(hf_dir: str, params_dtype: torch.dtype = torch.float32, **spec_kwargs):
    """Build a branch-spec GPTModel for ``hf_dir`` and load its safetensors weights.

    Works on any TP/PP layout already initialised (weights are sliced per rank)::

        model, config = mb.hf.load_gpt_from_hf(hf_dir)
        lp = mb.rollout_logprobs(model, tree)  # the model, not the pair

    Args:
        hf_dir: a Hugging Face checkpoint directory (``config.json`` and safetensors).
        params_dtype: the parameters' dtype (checked to hold the weights exactly).
        **spec_kwargs: extra keywords for the branch layer spec.

    Returns:
        A tuple ``(model, config)``: the ``GPTModel`` (this rank's TP/PP shard, weights
        loaded, on the CPU) and the ``TransformerConfig`` it was built with (an
        ``MLATransformerConfig`` for multi-latent attention). The package's functions that
        take a model refuse the pair with a ``ValueError``.
    """
    hf_cfg = read_config(hf_dir)
    model, config = build_from_hf_config(hf_cfg, params_dtype, spec_kwargs)
    state = hf_to_megatron(read_weights(hf_dir), hf_cfg)
    load_state(model, cast_weights(state, params_dtype))
    return model, config


def cast_weights(state: Dict[str, Tensor], dtype: torch.dtype) -> Dict[str, Tensor]:
    """``state`` in the parameters' ``dtype``; the weight buffers Megatron keeps in float32
    (the router's expert bias: :data:`~megatron_branch.full_state.WEIGHT_BUFFERS`) as they are."""
    return {k: v if k.endswith(WEIGHT_BUFFERS) else v.to(dtype) for k, v in state.items()}


def load_state(model, state: Dict[str, Tensor]) -> None:
    """Load unsharded stock-named weights on any TP/PP/EP layout
    (:func:`megatron_branch.full_state.load_full_state`)."""
    load_full_state(model, state)


def model_state(model, which: str = "param") -> Dict[str, Tensor]:
    """Unsharded stock-named weights (or grads) of a live model (collective over TP, PP and EP;
    :func:`megatron_branch.full_state.full_state`)."""
    return full_state(model, which)


def export_hf_state(model, hf_cfg: dict, dtype: Optional[torch.dtype] = None) -> Dict[str, Tensor]:
    """The model's full weights under HF names (collective over TP, PP and, for MoE, EP;
    every rank gets them)."""
    state = model_state(model, "param")
    if hf_cfg.get("tie_word_embeddings"):
        state.pop("output_layer.weight", None)
    out = megatron_to_hf(state, hf_cfg)
    return {k: v.to(dtype) for k, v in out.items()} if dtype is not None else out


__all__ = ["build_from_hf_config", "cast_weights", "export_hf_state", "load_gpt_from_hf", "load_state", "model_state"]
