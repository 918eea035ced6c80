"""Scoring helpers: vocab-parallel log-probs and entropies of packed tokens, model checks."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from megatron_branch._megatron import (
    parallel_state,
    reduce_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from megatron_branch.spec import is_branch_model
from megatron_branch.tree import BranchTree


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def check_model(model, tree: BranchTree) -> None:
    from megatron_branch.training.ddp import check_wrapper

    check_wrapper(model)
    if not is_branch_model(model):
        raise ValueError(
            "model: not built with megatron_branch.get_branch_layer_spec (no tree attention "
            "layers); positions and visibility would be wrong"
        )
    from megatron_branch._megatron import MoELayer
    from megatron_branch.spec.moe import BranchMoELayer

    stock_moe = next((n for n, m in model.named_modules() if isinstance(m, MoELayer)
                      and not isinstance(m, BranchMoELayer)), None)
    if stock_moe is not None:
        # Megatron's router computes its batch statistics (aux losses, expert-bias counts,
        # capacity) over the tokens it sees: the unique tree tokens, not the naive batch.
        raise ValueError(
            f"model: {stock_moe} is Megatron's stock MoELayer, whose router statistics would count each "
            "shared token once instead of once per rollout; build the spec with "
            "get_branch_layer_spec(num_experts=...) or apply megatron_branch.spec.moe.apply_branch_moe to it"
        )
    vocab = getattr(unwrap(model), "vocab_size", None)
    if vocab is not None and tree.unique_positions and int(tree.tokens.max()) >= vocab:
        bad = int(tree.tokens.max())
        rollout = int((tree.rows == int((tree.tokens == bad).nonzero()[0])).any(1).nonzero()[0])
        raise ValueError(f"rollout {rollout}: tokens contains id {bad} outside the vocabulary of size {vocab}")


def unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def vocab_parallel_entropy(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` for vocab-parallel logits ``[..., V / tp]`` (float32)."""
    logits = logits.float()
    local_max = logits.max(dim=-1, keepdim=True).values.detach()
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(
            local_max, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
        )
        reduce = reduce_from_tensor_model_parallel_region
    else:
        reduce = lambda x: x  # noqa: E731
    shifted = logits - local_max
    exp = shifted.exp()
    z = reduce(exp.sum(-1))
    ez = reduce((exp * shifted).sum(-1))
    return z.log() - ez / z


def child_logprobs(
    logits: Tensor, rows: Tensor, targets: Tensor, entropy: bool = False
) -> Tuple[Tensor, Optional[Tensor]]:
    """``log_softmax(logits[rows])[targets]`` (vocab-parallel), and optionally the entropy.

    Args:
        logits: ``[n, V / tp]``.
        rows: ``[m]`` row of each child's parent in ``logits`` (a branch point repeats).
        targets: ``[m]`` token id of each child.

    Returns:
        ``(lp [m], ent [m] or None)``, float32.
    """
    picked = logits.index_select(0, rows)  # [m, V/tp]
    ent = vocab_parallel_entropy(picked) if entropy else None  # before the in-place CE
    # vocab_parallel_cross_entropy: [s, b, V/tp], [s, b] -> [s, b]
    nll = vocab_parallel_cross_entropy(picked.float().unsqueeze(1), targets.unsqueeze(1)).squeeze(1)
    return -nll, ent


def unique_token_logprobs(
    logits: Tensor, tree: BranchTree, entropy: bool = False
) -> Tuple[Tensor, Optional[Tensor]]:
    """Log-prob of every packed token given its parent, from packed logits.

    Args:
        logits: ``[U, V / tp]`` logits of the packed sequence (vocab-parallel).
        tree: the packed tree.
        entropy: also return the entropy of the distribution at each token's parent.

    Returns:
        ``(lp [U], ent [U] or None)`` float32; roots (no parent) get 0. A branch point's
        logits row serves each of its children.
    """
    parents = tree.parents.to(logits.device)
    child = (parents >= 0).nonzero(as_tuple=True)[0]
    lp_child, ent_child = child_logprobs(logits, parents[child], tree.tokens.to(logits.device)[child], entropy)
    lp = torch.zeros(tree.unique_positions, dtype=torch.float32, device=logits.device)
    ent = None if ent_child is None else torch.zeros_like(lp).index_put((child,), ent_child)
    return lp.index_put((child,), lp_child), ent


def per_rollout(values: Tensor, tree: BranchTree, rollouts: Optional[Tensor] = None) -> Tensor:
    """Gather packed per-token values into ``[R, max_len - 1]`` (0 past each end).

    ``out[r, t] = values[rows[r, t + 1]]``: the value of predicting token ``t + 1``;
    ``rollouts`` selects a subset of rows.
    """
    rows = tree.rows[:, 1:] if rollouts is None else tree.rows[rollouts, 1:]
    rows = rows.to(values.device)
    valid = rows >= 0
    out = values[rows.clamp(min=0)]
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))
