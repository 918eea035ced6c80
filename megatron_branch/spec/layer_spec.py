"""Layer specs: Megatron's stock local GPT layer with tree attention in place."""

from __future__ import annotations

import copy
from typing import Optional

from megatron_branch._deps import HAVE_TE
from megatron_branch._megatron import (
    ModuleSpec,
    SelfAttention,
    TransformerBlock,
    TransformerBlockSubmodules,
    get_gpt_layer_local_spec,
)
from megatron_branch.spec.core_attention import BACKENDS, BranchCoreAttention
from megatron_branch.spec.self_attention import BranchSelfAttention


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
    depths; same parameters) and ``self_attention.submodules.core_attention`` becomes
    :class:`BranchCoreAttention`. Parameter names and shapes equal the stock spec's, so
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
            (``normalization``, ``qk_layernorm``, ``num_experts``, ``moe_grouped_gemm``, ...).
            With ``num_experts`` the MoE layers keep the naive batch's router statistics
            (:func:`megatron_branch.spec.moe.apply_branch_moe`); ``moe_token_dropping``
            (``"refuse"`` or ``"approximate"``) is passed to it.

    Returns:
        The layer spec, for ``GPTModel(transformer_layer_spec=...)``.

    Raises:
        ValueError: an unknown backend, ``multi_latent_attention=True`` (MLA has its
            own attention module and is not supported), or ``use_te=True`` without an
            importable Transformer Engine.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    moe_token_dropping = local_spec_kwargs.pop("moe_token_dropping", "refuse")
    if local_spec_kwargs.get("multi_latent_attention"):
        raise ValueError("multi_latent_attention: MLA is not supported by the branch spec")
    if use_te is None:
        use_te = HAVE_TE
    if use_te:
        if not HAVE_TE:
            raise ValueError(
                "use_te: Transformer Engine is not importable here; install the [te] extra on a "
                "GPU machine (pip install -e '.[te]') or use the default local spec"
            )
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        local_spec_kwargs.pop("normalization", None)
        base = get_gpt_layer_with_transformer_engine_spec(**local_spec_kwargs)
    else:
        base = get_gpt_layer_local_spec(**local_spec_kwargs)
    spec = apply_branch_attention(base, backend=backend, chunk_size=chunk_size, kernel=kernel)
    if local_spec_kwargs.get("num_experts"):
        from megatron_branch.spec.moe import apply_branch_moe

        spec = apply_branch_moe(spec, token_dropping=moe_token_dropping)
    return spec


def apply_branch_attention(
    spec, backend: str = "cascade", chunk_size: Optional[int] = None, kernel: Optional[str] = None
):
    """A copy of any Megatron GPT layer or block spec with tree attention in every layer.

    Accepts what GPTModel accepts as ``transformer_layer_spec``: a layer ``ModuleSpec``, a
    ``TransformerBlockSubmodules`` (e.g. ``get_gpt_decoder_block_spec`` for MoE layer
    patterns) or a ``ModuleSpec`` of a ``TransformerBlock``. In each layer,
    ``self_attention.module`` becomes :class:`BranchSelfAttention` and its
    ``core_attention`` :class:`BranchCoreAttention`; nothing else changes, so parameter
    names and shapes are the original spec's.

    Raises:
        ValueError: a layer whose self-attention is not Megatron's ``SelfAttention``
            (multi-latent attention, experimental attention variants).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    core = ModuleSpec(module=BranchCoreAttention, params={"backend": backend, "chunk_size": chunk_size, "kernel": kernel})
    return _map_layers(spec, lambda layer: _with_branch_attention(layer, core))


def _with_branch_attention(layer: ModuleSpec, core: ModuleSpec) -> ModuleSpec:
    # Copy only the path to the two slots: every other slot stays the very object of the
    # original spec (megatron-core 0.17+ builds MLP slots with functools.partial, which
    # compares unequal once deep-copied).
    attn = layer.submodules.self_attention
    if not (isinstance(attn.module, type) and issubclass(attn.module, SelfAttention)):
        name = getattr(attn.module, "__name__", type(attn.module).__name__)
        raise ValueError(f"self_attention: {name} is not Megatron's SelfAttention; the branch spec "
                         "replaces only its core attention (MLA and attention variants are not supported)")
    attn_sub = copy.copy(attn.submodules)
    attn_sub.core_attention = core
    new_attn = copy.copy(attn)
    new_attn.module, new_attn.submodules, new_attn.params = BranchSelfAttention, attn_sub, dict(attn.params)
    layer_sub = copy.copy(layer.submodules)
    layer_sub.self_attention = new_attn
    new_layer = copy.copy(layer)
    new_layer.submodules, new_layer.params = layer_sub, dict(layer.params)
    return new_layer


def _map_layers(spec, fn):
    if isinstance(spec, TransformerBlockSubmodules):
        out = copy.copy(spec)
        out.layer_specs = [fn(layer) for layer in spec.layer_specs]
        return out
    if isinstance(spec, ModuleSpec) and isinstance(spec.module, type) and issubclass(spec.module, TransformerBlock):
        out = copy.copy(spec)
        out.submodules = _map_layers(spec.submodules, fn)
        return out
    if isinstance(spec, ModuleSpec):
        return fn(spec)
    raise ValueError(f"spec: expected a layer or block spec, got {type(spec).__name__}")


def is_branch_model(model) -> bool:
    """True if ``model`` (possibly wrapped) contains tree attention layers."""
    return any(isinstance(m, BranchCoreAttention) for m in model.modules())
