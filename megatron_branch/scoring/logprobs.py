"""Per-rollout log-probabilities from one packed forward over the tree."""

from __future__ import annotations

from typing import Optional, Tuple, Union

from torch import Tensor

from megatron_branch.scoring.output_rows import scored_tokens
from megatron_branch.scoring.vocab import (  # noqa: F401 - re-exported
    check_model,
    child_logprobs,
    model_device,
    per_rollout,
    unique_token_logprobs,
    unwrap,
    vocab_parallel_entropy,
)
from megatron_branch.training.ddp import single_chunk
from megatron_branch.tree import BranchTree
from megatron_branch.scoring.unit import forward_unit


def rollout_logprobs(
    model, tree: BranchTree, *, entropy: bool = False, cp_comm_type: str = "allgather",
    score_mask: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Differentiable per-rollout log-probs from one packed forward over ``tree``.

    Runs the Megatron ``GPTModel`` (built with :func:`get_branch_layer_spec`) once over the
    ``U`` unique tokens, computes logits only there, and gathers
    ``lp[r, t] = log p(seq_r[t + 1] | seq_r[: t + 1])``. Uses Megatron's vocab-parallel
    cross-entropy, so it works with tensor-parallel logits.

    Args:
        model: a GPTModel built with the branch spec, with ``post_process=True``; possibly
            wrapped (``Float16Module``, Megatron's ``DistributedDataParallel``) or a
            one-element list of chunks.
        tree: the packed rollouts.
        entropy: also return per-token entropies.
        cp_comm_type: with context parallelism, ``"allgather"`` or ``"p2p"`` K/V exchange
            (see :mod:`megatron_branch.attention.context_parallel`); every CP rank gets the full,
            differentiable result.
        score_mask: ``[R, max_len - 1]``, nonzero where the loss reads ``lp`` (e.g. the
            response mask). The vocabulary projection then runs only on the parents of
            those tokens (:mod:`megatron_branch.scoring.output_rows`); other entries are 0. ``None``
            scores every token.

    Returns:
        ``lp [R, max_len - 1]`` float32, 0 past each rollout's end; with ``entropy=True``
        ``(lp, ent)`` of the same shape.

    Raises:
        ValueError: the model lacks tree attention, or a token id is outside its vocabulary.
    """
    model = single_chunk(model, "rollout_logprobs")
    check_model(model, tree)
    scored = None if score_mask is None else scored_tokens(tree, score_mask)
    idx, lp_child, ent_child = forward_unit(
        model, tree, 0, tree.unique_positions, cp_comm_type=cp_comm_type, entropy=entropy, scored=scored
    )
    idx = idx.to(lp_child.device)
    lp = lp_child.new_zeros(tree.unique_positions).index_put((idx,), lp_child)
    lp = per_rollout(lp, tree)
    if entropy:
        return lp, per_rollout(ent_child.new_zeros(tree.unique_positions).index_put((idx,), ent_child), tree)
    return lp
