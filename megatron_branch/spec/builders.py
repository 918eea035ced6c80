"""Small Llama-style Megatron GPT models for tests, the demo and benchmarks."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_branch._megatron import GPTModel, TransformerConfig, get_gpt_layer_local_spec
from megatron_branch.cpu import cuda_factories_on_cpu
from megatron_branch.spec import get_branch_layer_spec


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
        branch: the branch spec (tree attention) if True, else Megatron's stock local spec.
        max_sequence_length: longest position.
        spec_kwargs: extra keywords for the layer spec (``backend``, ``chunk_size``, ...).
        seed: seeds the CPU generator before initialisation, for reproducible weights.
        **model_kwargs: forwarded to ``GPTModel`` (e.g. ``share_embeddings_and_output_weights``).
    """
    spec_kwargs = dict(spec_kwargs or {})
    spec_kwargs.setdefault("normalization", config.normalization)
    spec_kwargs.setdefault("qk_layernorm", config.qk_layernorm)
    if branch:
        spec = get_branch_layer_spec(**spec_kwargs)
    else:
        for key in ("backend", "chunk_size", "kernel"):
            spec_kwargs.pop(key, None)
        spec = get_gpt_layer_local_spec(**spec_kwargs)
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
