"""``get_branch_layer_spec``: Megatron's stock GPT layer spec with the branch pieces in place.

A sequence of ``apply_*`` steps, each beside the modules it installs, as torchtitan's
``parallelize_*`` applies its parallelisms: :func:`~megatron_branch.spec.attention.apply_branch_attention`
(tree attention), :func:`~megatron_branch.spec.moe.apply_branch_moe` (router statistics
weighted by multiplicity). The same steps apply to any layer or block spec a user builds.
"""

from __future__ import annotations

from typing import Optional

from megatron_branch._deps import HAVE_TE
from megatron_branch._megatron import ModuleSpec, get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec
from megatron_branch.spec.attention import apply_branch_attention
from megatron_branch.spec.core_attention import BACKENDS
from megatron_branch.spec.moe import apply_branch_moe
from megatron_branch.spec.stock_hybrid import get_local_hybrid_block_spec


def get_branch_layer_spec(
    backend: str = "cascade",
    chunk_size: Optional[int] = None,
    kernel: Optional[str] = None,
    use_te: Optional[bool] = False,
    **local_spec_kwargs,
) -> ModuleSpec:
    """``ModuleSpec`` of a ``TransformerLayer``: the stock local spec with tree attention.

    The layer is ``get_gpt_layer_local_spec(**local_spec_kwargs)`` with two slots
    changed: ``self_attention.module`` becomes :class:`BranchSelfAttention` (RoPE at tree
    depths; same parameters) — :class:`BranchMLASelfAttention` with
    ``multi_latent_attention=True`` — and ``self_attention.submodules.core_attention``
    becomes :class:`BranchCoreAttention`. Parameter names and shapes equal the stock spec's, so
    checkpoints load unchanged in both directions. Never touches Transformer Engine.

    Args:
        backend: ``"cascade"`` (default, mask-free) or ``"dense"`` (boolean mask reference).
        chunk_size: most queries per cascade piece (bounds working memory).
        kernel: cascade piece kernel; ``None`` picks by device.
        use_te: build on Megatron's Transformer Engine spec instead (TE linears and
            layer-norm-linears, so ``TransformerConfig(fp8=...)`` runs the GEMMs in FP8 while
            tree attention stays in the compute dtype); ``None`` = when TE imports. TE
            names parameters differently (e.g. ``linear_qkv.layer_norm_weight``).
        **local_spec_kwargs: forwarded to Megatron's ``get_gpt_layer_local_spec`` (or the TE
            spec function: ``normalization`` is then taken from the config)
            (``normalization``, ``qk_layernorm``, ``num_experts``, ``moe_grouped_gemm``,
            ``multi_latent_attention`` (with an ``MLATransformerConfig``), ...).
            With ``num_experts`` the MoE layers keep the naive batch's router statistics
            (:func:`megatron_branch.spec.moe.apply_branch_moe`); ``moe_token_dropping``
            (``"refuse"`` or ``"approximate"``) is passed to it.

    Returns:
        The layer spec, for ``GPTModel(transformer_layer_spec=...)``.

    Raises:
        ValueError: an unknown backend, or ``use_te=True`` without an importable
            Transformer Engine.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    moe_token_dropping = local_spec_kwargs.pop("moe_token_dropping", "refuse")
    if use_te is None:
        use_te = HAVE_TE
    if use_te:
        if not HAVE_TE:
            raise ValueError(
                "use_te: Transformer Engine is not importable here; install the [te] extra on a "
                "GPU machine (pip install -e '.[te]') or use the default local spec"
            )
        local_spec_kwargs.pop("normalization", None)
        base = get_gpt_layer_with_transformer_engine_spec(**local_spec_kwargs)
    else:
        base = get_gpt_layer_local_spec(**local_spec_kwargs)
    # The branch pieces, each installed by its own step (a no-op where its slot is absent).
    spec = apply_branch_attention(base, backend=backend, chunk_size=chunk_size, kernel=kernel)
    spec = apply_branch_moe(spec, token_dropping=moe_token_dropping)
    return spec


def get_branch_hybrid_block_spec(
    config,
    backend: str = "cascade",
    chunk_size: Optional[int] = None,
    kernel: Optional[str] = None,
    **local_spec_kwargs,
):
    """Block spec of a hybrid Gated DeltaNet model (Qwen3-Next / Qwen3.5 layout) with the
    branch pieces: Megatron's GDN/attention layer pattern
    (:func:`~megatron_branch.spec.stock_hybrid.get_local_hybrid_block_spec`, from
    ``config.linear_attention_freq``) with :func:`apply_branch_attention` applied, which
    puts tree attention in the attention layers and the tree recurrence in the GDN layers.

    Args:
        config: a ``TransformerConfig`` with ``experimental_attention_variant="gated_delta_net"``
            (and ``deterministic_mode=True`` on CPU: Megatron's torch kernels).
        backend, chunk_size, kernel: as for :func:`get_branch_layer_spec`.
        **local_spec_kwargs: forwarded to Megatron's ``get_gpt_layer_local_spec``; with
            ``num_experts`` every layer's MLP is a branch MoE layer (Qwen3-Next / Qwen3.5-MoE;
            ``moe_token_dropping`` as for :func:`get_branch_layer_spec`).

    Returns:
        A ``TransformerBlockSubmodules`` for ``GPTModel(transformer_layer_spec=...)``.

    Raises:
        ValueError: an unknown backend, or a megatron-core without GatedDeltaNet (0.16)
            or without flash-linear-attention installed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    moe_token_dropping = local_spec_kwargs.pop("moe_token_dropping", "refuse")
    base = get_local_hybrid_block_spec(config, **local_spec_kwargs)
    spec = apply_branch_attention(base, backend=backend, chunk_size=chunk_size, kernel=kernel)
    return apply_branch_moe(spec, token_dropping=moe_token_dropping)  # a no-op without num_experts
