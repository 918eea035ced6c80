"""Megatron-LM entry points: ``--spec megatron_branch.megatron_lm branch_layer_spec``.

Megatron-LM's ``pretrain_gpt.py`` resolves ``--spec MODULE NAME`` to an attribute of a
module and uses it as the transformer layer spec; this module provides one for the usual
Llama-style setting, and :func:`get_branch_spec` for others. Feed packed trees with
:func:`megatron_branch.pipeline.make_forward_step`.
"""

from __future__ import annotations

from megatron_branch.spec import get_branch_layer_spec


def get_branch_spec(normalization: str = "RMSNorm", qk_layernorm: bool = False, **kwargs):
    """The branch layer spec (tree attention in Megatron's local layer)."""
    return get_branch_layer_spec(normalization=normalization, qk_layernorm=qk_layernorm, **kwargs)


branch_layer_spec = get_branch_spec()
