"""Can this model score this tree exactly? Each check lives beside what it knows about."""

from __future__ import annotations

from megatron_branch.model import check_wrapper, unwrap
from megatron_branch.spec.attention import check_tree_attention
from megatron_branch.spec.moe import check_moe_layers
from megatron_branch.tree import BranchTree


def check_model(model, tree: BranchTree) -> None:
    """Refuse, with a ``ValueError`` naming what and where, a model/tree pair that
    branch replay cannot score exactly:

    * a wrapper that reduces gradients per backward (torch DDP/FSDP:
      :func:`megatron_branch.model.check_wrapper`);
    * a model without tree attention (:func:`megatron_branch.spec.attention.check_tree_attention`);
    * a stock Megatron MoE layer, whose router statistics would count shared tokens once
      (:func:`megatron_branch.spec.moe.check_moe_layers`);
    * a token id outside the model's vocabulary (:meth:`BranchTree.check_vocab`).
    """
    check_wrapper(model)
    check_tree_attention(model)
    check_moe_layers(model)
    vocab = getattr(unwrap(model), "vocab_size", None)
    if vocab is not None:
        tree.check_vocab(vocab)
