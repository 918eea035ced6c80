"""``apply_branch_attention``: tree attention in the attention slots of any layer spec.

Installs the modules beside it: :class:`~megatron_branch.spec.self_attention.BranchSelfAttention`
(RoPE at tree depths), or :class:`~megatron_branch.spec.mla_attention.BranchMLASelfAttention`
for multi-latent attention layers, and :class:`~megatron_branch.spec.core_attention.BranchCoreAttention`
(the ``core_attention`` slot). :func:`check_tree_attention` is the matching model check.
"""

from __future__ import annotations

import copy
from typing import Optional

from megatron_branch._megatron import Attention, GatedDeltaNet, IdentityOp, MLASelfAttention, ModuleSpec, SelfAttention
from megatron_branch.spec.core_attention import BACKENDS, BranchCoreAttention
from megatron_branch.spec.gdn import BranchGatedDeltaNet
from megatron_branch.spec.layers import map_layers
from megatron_branch.spec.mla_attention import BranchMLASelfAttention
from megatron_branch.spec.self_attention import BranchSelfAttention


def apply_branch_attention(
    spec, backend: str = "cascade", chunk_size: Optional[int] = None, kernel: Optional[str] = None
):
    """A copy of any Megatron GPT layer or block spec with tree attention in every layer.

    Accepts what GPTModel accepts as ``transformer_layer_spec``: a layer ``ModuleSpec``, a
    ``TransformerBlockSubmodules`` (e.g. ``get_gpt_decoder_block_spec`` for MoE layer
    patterns) or a ``ModuleSpec`` of a ``TransformerBlock``. In each layer,
    ``self_attention.module`` becomes :class:`BranchSelfAttention` (or, for Megatron's
    ``MLASelfAttention``, :class:`BranchMLASelfAttention`) and its ``core_attention``
    :class:`BranchCoreAttention`; a Gated DeltaNet layer's ``GatedDeltaNet`` becomes
    :class:`~megatron_branch.spec.gdn.BranchGatedDeltaNet` (its recurrence along the
    tree); nothing else changes, so parameter names and shapes are the original spec's.

    Raises:
        ValueError: a layer whose sequence mixer is none of Megatron's ``SelfAttention``,
            ``MLASelfAttention`` and ``GatedDeltaNet`` (other attention variants, their
            subclasses).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    core = ModuleSpec(module=BranchCoreAttention, params={"backend": backend, "chunk_size": chunk_size, "kernel": kernel})
    return map_layers(spec, lambda layer: _with_branch_attention(layer, core))


def _with_branch_attention(layer: ModuleSpec, core: ModuleSpec) -> ModuleSpec:
    # Copy only the path to the two slots: every other slot stays the very object of the
    # original spec (megatron-core 0.17+ builds MLP slots with functools.partial, which
    # compares unequal once deep-copied).
    attn = getattr(layer.submodules, "self_attention", None)
    if attn is None or attn is IdentityOp or getattr(attn, "module", None) is IdentityOp:
        return layer  # no sequence mixer (HybridStack's MLP / MoE layers)
    module = attn.module if isinstance(attn.module, type) else None
    if GatedDeltaNet is not None and module is not None and issubclass(module, GatedDeltaNet):
        if module not in (GatedDeltaNet, BranchGatedDeltaNet):  # e.g. a GDN variant with other gates
            raise ValueError(f"self_attention: {module.__name__} is a variant of GatedDeltaNet the branch spec "
                             "does not know")
        return _with_module(layer, BranchGatedDeltaNet, attn.submodules)
    if module is MLASelfAttention or (module is not None and issubclass(module, BranchMLASelfAttention)):
        branch_module = BranchMLASelfAttention
    elif module is not None and issubclass(module, MLASelfAttention):
        # e.g. 0.19's FusedMLASelfAttention (--mla-down-proj-fusion): other parameters, other code
        raise ValueError(f"self_attention: {module.__name__} is a variant of MLASelfAttention the branch spec "
                         "does not know; use the unfused MLASelfAttention (e.g. no --mla-down-proj-fusion)")
    elif module is not None and issubclass(module, SelfAttention):
        branch_module = BranchSelfAttention
    else:
        name = getattr(attn.module, "__name__", type(attn.module).__name__)
        raise ValueError(f"self_attention: {name} is neither Megatron's SelfAttention nor its MLASelfAttention; "
                         "the branch spec replaces only their core attention (attention variants are not supported)")
    attn_sub = copy.copy(attn.submodules)
    attn_sub.core_attention = core
    return _with_module(layer, branch_module, attn_sub)


def _with_module(layer: ModuleSpec, module: type, submodules) -> ModuleSpec:
    """``layer`` with its sequence mixer's module and submodules replaced (copies on the path only)."""
    attn = layer.submodules.self_attention
    new_attn = copy.copy(attn)
    new_attn.module, new_attn.submodules, new_attn.params = module, submodules, dict(attn.params)
    layer_sub = copy.copy(layer.submodules)
    layer_sub.self_attention = new_attn
    new_layer = copy.copy(layer)
    new_layer.submodules, new_layer.params = layer_sub, dict(layer.params)
    return new_layer


def is_tree_mixer(module) -> bool:
    """``module`` is one of our tree sequence mixers (attention or GDN)."""
    return isinstance(module, (BranchCoreAttention, BranchGatedDeltaNet))


def is_branch_model(model) -> bool:
    """True if ``model`` (possibly wrapped) contains tree sequence mixers (attention or GDN)."""
    return any(is_tree_mixer(m) for m in model.modules())


NOT_A_BRANCH_MODEL = ("model: not built with megatron_branch.get_branch_layer_spec (no tree attention "
                      "layers); positions and visibility would be wrong")


def stock_mixer_error(name: str, module) -> Optional[str]:
    """Why ``module`` (named ``name``) would run a packed tree as one sequence, or ``None``."""
    stock_gdn = (GatedDeltaNet is not None and isinstance(module, GatedDeltaNet)
                 and not isinstance(module, BranchGatedDeltaNet))
    if stock_gdn or type(module).__name__ in ("MambaMixer", "MambaLayer"):
        return (f"{name}: {type(module).__name__} is a stock recurrent layer; it would run the packed tree "
                "as one sequence (build the model with apply_branch_attention; Mamba is not supported)")
    if isinstance(module, Attention) and not isinstance(module, (BranchSelfAttention, BranchMLASelfAttention)):
        # e.g. a HybridStack's DSA layer: stock attention would see the packed tree as one sequence
        return (f"{name}: {type(module).__name__} is stock attention without tree support (the branch spec "
                "installs tree attention in SelfAttention and MLASelfAttention layers only)")
    return None


def check_tree_attention(model) -> None:
    """Raise ``ValueError`` unless every sequence mixer of ``model`` (possibly wrapped) is a
    tree one: a stock layer would run the packed tree as one sequence."""
    if not is_branch_model(model):
        raise ValueError(NOT_A_BRANCH_MODEL)
    for name, m in model.named_modules():
        error = stock_mixer_error(name, m)
        if error:
            raise ValueError(error)
