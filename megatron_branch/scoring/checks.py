"""Can this model score this tree exactly? Each check lives beside what it knows about."""

from __future__ import annotations

from typing import List

from megatron_branch.model import check_wrapper, is_te_module, low_precision_error, unwrap
from megatron_branch.spec.attention import NOT_A_BRANCH_MODEL, is_tree_mixer, stock_mixer_error
from megatron_branch.spec.moe.router import BranchTopKRouter
from megatron_branch.spec.moe.routers import stock_moe_error
from megatron_branch.tree import BranchTree


def check_model(model, tree: BranchTree) -> List[BranchTopKRouter]:
    """Refuse, with a ``ValueError`` naming what and where, a model/tree pair that
    branch replay cannot score exactly:

    * a wrapper that reduces gradients per backward (torch DDP/FSDP:
      :func:`megatron_branch.model.check_wrapper`);
    * a model without tree attention (:func:`megatron_branch.spec.attention.check_tree_attention`);
    * a stock Megatron MoE layer, whose router statistics would count shared tokens once
      (:func:`megatron_branch.spec.moe.check_moe_layers`);
    * a token id outside the model's vocabulary (:meth:`BranchTree.check_vocab`);
    * ``fp8`` / ``fp4`` in the config of a model without Transformer Engine linears, which
      would run in full precision (:func:`megatron_branch.model.low_precision_error`).

    One walk over the modules (it runs every step), the errors raised in that order.

    Returns:
        the model's branch routers in layer order (:func:`megatron_branch.spec.moe.routers`).
    """
    check_wrapper(model)
    tree_mixers, mixer_error, moe_error, found, has_te = False, None, None, [], False
    for name, m in model.named_modules():
        tree_mixers = tree_mixers or is_tree_mixer(m)
        has_te = has_te or is_te_module(m)
        mixer_error = mixer_error or stock_mixer_error(name, m)
        moe_error = moe_error or stock_moe_error(name, m)
        if isinstance(m, BranchTopKRouter):
            found.append(m)
    for error in (None if tree_mixers else NOT_A_BRANCH_MODEL, mixer_error, moe_error,
                  low_precision_error(model, has_te)):
        if error:
            raise ValueError(error)
    vocab = getattr(unwrap(model), "vocab_size", None)
    if vocab is not None:
        tree.check_vocab(vocab)
    return found
