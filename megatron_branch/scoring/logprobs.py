"""Per-rollout log-probabilities from one packed forward over the tree.

``rollout_logprobs`` runs the unit forward (:mod:`megatron_branch.scoring.unit`) over the
whole tree and gathers the unique tokens' log-probs into ``[R, max_len - 1]``
(:func:`per_rollout`); a shared token's value is gathered by every rollout that holds it,
so autograd sums their gradients into it.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from megatron_branch.model import HOST, refresh_fp8_weights, single_chunk
from megatron_branch.scoring.checks import check_model
from megatron_branch.scoring.output_rows import scored_tokens
from megatron_branch.scoring.temperature import Temperature, Temperatures
from megatron_branch.scoring.unit import forward_unit
from megatron_branch.scoring.vocab import child_logprobs
from megatron_branch.spec.moe.routing_replay import Routing, tree_routing
from megatron_branch.tree import BranchTree


def rollout_logprobs(
    model, tree: BranchTree, *, entropy: bool = False, cp_comm_type: str = "allgather",
    score_mask: Optional[Tensor] = None, temperature: Optional[Temperature] = None,
    routing: Optional[Routing] = None,
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
        temperature: the sampling temperature, one number or one per rollout: log-probs
            and entropies of ``softmax(logits / T)``, as the rollout engine sampled
            (:mod:`megatron_branch.scoring.temperature`). Default 1.
        routing: rollout routing replay (MoE): per rollout an integer tensor
            ``[len_r, moe_layers, topk]`` of the experts the rollout engine chose at each
            position, forced through Megatron's ``RouterReplay`` (needs
            ``moe_enable_routing_replay=True``); rollouts sharing a
            token must agree on its experts
            (:mod:`megatron_branch.spec.moe.routing_replay`). ``None``: the routers choose.

    Returns:
        ``lp [R, max_len - 1]`` float32, 0 past each rollout's end; with ``entropy=True``
        ``(lp, ent)`` of the same shape.

    Raises:
        ValueError: the model lacks tree attention, a token id is outside its vocabulary,
            a temperature is not a finite number > 0 or has the wrong length, or a bad
            ``routing`` (see :func:`~megatron_branch.spec.moe.routing_replay.tree_routing`).
    """
    model = single_chunk(model, "rollout_logprobs")
    found = check_model(model, tree)
    replayed = tree_routing(tree, routing, found)
    refresh_fp8_weights(model)  # the weights may have changed since the last forward
    temps = Temperatures.of(temperature, tree.num_rollouts)
    scored = None if score_mask is None else scored_tokens(tree, score_mask)
    idx, lp_child, ent_child = forward_unit(
        model, tree, 0, tree.unique_positions, cp_comm_type=cp_comm_type, entropy=entropy, scored=scored,
        temperatures=None if temps.is_one else temps.values, routing=replayed,
    )
    idx = idx.to(lp_child.device)
    lp = per_rollout(lp_child.new_zeros(tree.unique_positions, temps.count).index_put((idx,), lp_child), tree,
                     column=temps.column)
    if entropy:
        ent = ent_child.new_zeros(tree.unique_positions, temps.count).index_put((idx,), ent_child)
        return lp, per_rollout(ent, tree, column=temps.column)
    return lp


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
    ent = None if ent_child is None else torch.zeros_like(lp).index_put((child,), ent_child[:, 0])
    return lp.index_put((child,), lp_child[:, 0]), ent


def per_rollout(values: Tensor, tree: BranchTree, rollouts: Optional[Tensor] = None,
                column: Optional[Tensor] = None) -> Tensor:
    """Gather packed per-token values into ``[R, max_len - 1]`` (0 past each end).

    ``out[r, t] = values[rows[r, t + 1]]``: the value of predicting token ``t + 1``;
    ``rollouts`` selects a subset of rows. ``values`` ``[U, k]`` (one column per
    temperature) is read at each rollout's ``column[r]`` (``[R]``, for all rollouts).
    """
    ids = torch.arange(tree.num_rollouts, device=HOST) if rollouts is None else rollouts.to(HOST)
    rows = tree.rows[ids, 1:].to(values.device)
    valid = rows >= 0
    if values.dim() == 1:
        out = values[rows.clamp(min=0)]
    else:
        col = (column[ids] if column is not None else torch.zeros(len(ids), dtype=torch.long, device=HOST))
        out = values[rows.clamp(min=0), col.to(values.device)[:, None]]
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))
