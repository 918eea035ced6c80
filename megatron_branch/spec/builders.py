"""Small Llama-style Megatron GPT models for tests, the demo and benchmarks."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_branch._megatron import (
    GPTModel,
    HybridModel,
    MLATransformerConfig,
    TransformerConfig,
    get_gpt_layer_local_spec,
)
from megatron_branch.cpu import cuda_factories_on_cpu
from megatron_branch.spec import get_branch_layer_spec
from megatron_branch.spec.attention import apply_branch_attention
from megatron_branch.spec.layer_spec import get_branch_hybrid_block_spec
from megatron_branch.spec.moe.pattern import mix_dense_and_moe, moe_layer_pattern
from megatron_branch.spec.stock_hybrid import get_local_hybrid_block_spec, get_local_hybrid_stack_spec
from megatron_branch.spec.stock_mla import get_stock_mla_layer_spec


def llama_config(
    num_layers: int = 2,
    hidden_size: int = 128,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    ffn_hidden_size: Optional[int] = None,
    params_dtype: torch.dtype = torch.float32,
    **overrides,
) -> TransformerConfig:
    """A Llama-style ``TransformerConfig``: RMSNorm, SwiGLU, GQA, no biases, no dropout.

    Fusions that need CUDA kernels are off so the model also runs on CPU.
    """
    kwargs = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        ffn_hidden_size=ffn_hidden_size or 3 * hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        layernorm_epsilon=1e-6,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def mla_config(
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    q_lora_rank: Optional[int] = 32,
    kv_lora_rank: int = 16,
    qk_head_dim: int = 16,
    qk_pos_emb_head_dim: int = 8,
    v_head_dim: int = 12,
    rope_type: str = "rope",
    **overrides,
) -> MLATransformerConfig:
    """A DeepSeek-V3-style ``MLATransformerConfig`` (multi-latent attention; query/key heads
    of ``qk_head_dim + qk_pos_emb_head_dim``, value heads of ``v_head_dim``), with the
    CPU-safe settings of :func:`llama_config`. ``rope_type="yarn"`` adds DeepSeek's YaRN
    defaults (scaling factor 4, mscale 1) unless overridden."""
    base = llama_config(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                        num_query_groups=num_attention_heads)
    kwargs = {f: getattr(base, f) for f in (
        "ffn_hidden_size", "normalization", "gated_linear_unit", "activation_func", "add_bias_linear",
        "hidden_dropout", "attention_dropout", "bias_dropout_fusion", "bias_activation_fusion",
        "apply_rope_fusion", "masked_softmax_fusion", "gradient_accumulation_fusion", "persist_layer_norm",
        "use_cpu_initialization", "params_dtype", "layernorm_epsilon")}
    kwargs.update(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                  multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                  qk_head_dim=qk_head_dim, qk_pos_emb_head_dim=qk_pos_emb_head_dim, v_head_dim=v_head_dim,
                  rope_type=rope_type, rotary_base=10000)
    if rope_type == "yarn":
        kwargs.update(rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=64)
    kwargs.update(overrides)
    return MLATransformerConfig(**kwargs)


def hybrid_config(
    num_layers: int = 4,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    linear_attention_freq=2,
    linear_conv_kernel_dim: int = 4,
    linear_key_head_dim: int = 16,
    linear_value_head_dim: int = 16,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    **overrides,
) -> TransformerConfig:
    """A Qwen3-Next-style hybrid config: Gated DeltaNet layers with an attention layer every
    ``linear_attention_freq``-th layer (or a per-layer list, 1 = GDN, 0 = attention), with
    the CPU-safe settings of :func:`llama_config`. ``deterministic_mode`` is on: it selects
    Megatron's torch GDN kernels (FLA's are CUDA/Triton)."""
    overrides.setdefault("deterministic_mode", True)
    return llama_config(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=linear_attention_freq, linear_conv_kernel_dim=linear_conv_kernel_dim,
        linear_key_head_dim=linear_key_head_dim, linear_value_head_dim=linear_value_head_dim,
        linear_num_key_heads=linear_num_key_heads, linear_num_value_heads=linear_num_value_heads, **overrides)


def build_gpt(
    config: TransformerConfig,
    vocab_size: int,
    *,
    branch: bool = True,
    max_sequence_length: int = 4096,
    spec_kwargs: Optional[dict] = None,
    seed: Optional[int] = None,
    **model_kwargs,
) -> GPTModel:
    """A ``GPTModel`` with RoPE and untied embeddings.

    Args:
        config: e.g. from :func:`llama_config`.
        vocab_size: vocabulary size.
        branch: the branch spec (tree attention) if True, else Megatron's stock local spec
            (for multi-latent attention :func:`~megatron_branch.spec.stock_mla.get_stock_mla_layer_spec`,
            for hybrid GDN configs :func:`~megatron_branch.spec.stock_hybrid.get_local_hybrid_block_spec`).
        max_sequence_length: longest position.
        spec_kwargs: extra keywords for the layer spec (``backend``, ``chunk_size``, ...); with
            ``num_experts`` and a ``config.moe_layer_freq`` that keeps some layers dense, a block
            spec of dense and MoE layers (:func:`~megatron_branch.spec.moe.pattern.mix_dense_and_moe`).
        seed: seeds the CPU generator before initialisation, for reproducible weights.
        **model_kwargs: forwarded to ``GPTModel`` (e.g. ``share_embeddings_and_output_weights``).
    """
    spec_kwargs = dict(spec_kwargs or {})
    spec_kwargs.setdefault("normalization", config.normalization)
    spec_kwargs.setdefault("qk_layernorm", config.qk_layernorm)
    mla = bool(getattr(config, "multi_latent_attention", False))
    hybrid = getattr(config, "experimental_attention_variant", None) == "gated_delta_net"
    pattern = moe_layer_pattern(config) if spec_kwargs.get("num_experts") else None
    if branch and pattern:  # dense and MoE layers (config.moe_layer_freq): a block spec
        dense_kwargs = {k: v for k, v in spec_kwargs.items() if k not in ("num_experts", "moe_grouped_gemm")}
        if hybrid:
            dense, moe = (get_branch_hybrid_block_spec(config, **kw) for kw in (dense_kwargs, spec_kwargs))
        else:
            dense, moe = (get_branch_layer_spec(multi_latent_attention=mla, **kw) for kw in (dense_kwargs, spec_kwargs))
        spec = mix_dense_and_moe(config, dense, moe, pattern)
    elif branch and hybrid:
        spec = get_branch_hybrid_block_spec(config, **spec_kwargs)
    elif branch:
        spec = get_branch_layer_spec(multi_latent_attention=mla, **spec_kwargs)
    else:
        for key in ("backend", "chunk_size", "kernel"):
            spec_kwargs.pop(key, None)
        if hybrid:
            spec = get_local_hybrid_block_spec(config, **spec_kwargs)
        else:
            spec = get_stock_mla_layer_spec(**spec_kwargs) if mla else get_gpt_layer_local_spec(**spec_kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    model_kwargs.setdefault("share_embeddings_and_output_weights", False)
    model_kwargs.setdefault("position_embedding_type", "rope")
    # Tied embeddings under pipeline parallelism move the last stage's copy with .cuda().
    with cuda_factories_on_cpu():
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            **model_kwargs,
        )


def build_hybrid(
    config: TransformerConfig,
    vocab_size: int,
    hybrid_layer_pattern: str,
    *,
    branch: bool = True,
    max_sequence_length: int = 4096,
    spec_kwargs: Optional[dict] = None,
    seed: Optional[int] = None,
) -> "HybridModel":
    """Megatron's ``HybridModel`` on the local hybrid stack
    (:func:`~megatron_branch.spec.stock_hybrid.get_local_hybrid_stack_spec`), with the
    branch pieces (``apply_branch_attention``) if ``branch``.

    Args:
        config: e.g. from :func:`hybrid_config` (``num_layers`` = the pattern's length).
        hybrid_layer_pattern: Megatron's layer symbols, e.g. ``"G-*-"`` (GDN, MLP,
            attention, MLP).
        spec_kwargs: ``backend``/``chunk_size``/``kernel`` of the tree attention.
    """
    spec_kwargs = dict(spec_kwargs or {})
    stack = get_local_hybrid_stack_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm)
    if branch:
        stack = apply_branch_attention(stack, **spec_kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    with cuda_factories_on_cpu():
        return HybridModel(config=config, hybrid_stack_spec=stack, vocab_size=vocab_size,
                           max_sequence_length=max_sequence_length, hybrid_layer_pattern=hybrid_layer_pattern,
                           position_embedding_type="rope", share_embeddings_and_output_weights=False)
