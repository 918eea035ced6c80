"""How far an approximate mode is from exact: tail-only replay and MoE token dropping.

Both run the approximate computation and the exact one on the same weights and compare
the gradients with :func:`megatron_branch.reference.agreement.grad_agreement`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from megatron_branch._megatron import TopKRouter
from megatron_branch.model import GradSync, as_chunks, param_grad, single_chunk
from megatron_branch.reference.agreement import grad_agreement, grads
from megatron_branch.reference.naive import naive_moe_logprobs
from megatron_branch.replay.replayer import LossFn
from megatron_branch.replay.step import replay_step
from megatron_branch.scoring.logprobs import rollout_logprobs
from megatron_branch.spec.moe import routers, tokens_per_expert
from megatron_branch.tree import BranchTree


def _saved_grads(model) -> List[Optional[Tensor]]:
    return [None if param_grad(p) is None else param_grad(p).detach().clone() for p in model.parameters()]


def _set_grads(model, saved: Sequence[Optional[Tensor]]) -> None:
    for p, g in zip(model.parameters(), saved):
        main = getattr(p, "main_grad", None)
        if main is not None:
            main.copy_(g if g is not None else torch.zeros_like(main))
        else:
            p.grad = g


def prefix_grad_bias(model, tree: BranchTree, loss_fn: LossFn, **kwargs) -> Dict[str, Optional[float]]:
    """How far the tail-only gradient is from the exact one, for the same step.

    Runs :func:`megatron_branch.replay_step` in both modes (gradients, ``main_grad``
    under Megatron DDP, are restored afterwards; DDP's reduction is held) and returns
    ``cosine`` (cosine similarity), ``rel_norm`` (``|g_detached| / |g_exact|``) and
    ``rel_error`` (``|g_detached - g_exact| / |g_exact|``) of this rank's local gradients
    (``None`` when the exact gradient is zero). ``kwargs`` go to ``replay_step``.
    """
    model = single_chunk(model, "prefix_grad_bias")
    saved = _saved_grads(model)
    found = {}
    with GradSync(as_chunks(model)).hold():
        for mode in ("exact", "detached"):
            _set_grads(model, [None] * len(saved))
            replay_step(model, tree, loss_fn, prefix_grad=mode, **kwargs)
            found[mode] = grads(model)
    _set_grads(model, saved)
    agreement = grad_agreement(found["detached"], found["exact"])
    return {"cosine": agreement.cosine, "rel_norm": agreement.rel_norm, "rel_error": agreement.rel_error}


def token_dropping_bias(branch_model, stock_model, sequences: Sequence, loss_fn) -> Dict[str, float]:
    """How far ``moe_token_dropping="approximate"`` is from naive training with token dropping.

    Runs ``loss_fn(lp)`` once on the tree (``branch_model``) and once on the naive batch
    (``stock_model``, same weights and capacity factor; :func:`~megatron_branch.reference.naive.naive_moe_logprobs`) and
    compares. Gradients are left as after the two backwards (zero them before a step).

    Returns:
        ``max_abs_logprob_diff``, ``loss_rel_diff``, ``grad_cosine``, ``grad_rel_error``
        (``|g_tree - g_naive| / |g_naive|``) and ``dropped_tree`` / ``dropped_naive``: the
        fraction of the naive batch's token-to-expert assignments dropped (tree tokens
        weighted by multiplicity).
    """
    tree = BranchTree.from_sequences(sequences)
    found = routers(branch_model)
    for m in (branch_model, stock_model):
        m.zero_grad(set_to_none=True)
    tokens_per_expert(branch_model, reset=True)
    lp_tree = rollout_logprobs(branch_model, tree)
    loss_tree = loss_fn(lp_tree)
    loss_tree.backward()
    kept_tree = float(tokens_per_expert(branch_model, reset=True).sum())

    kept = []
    hooks = [m.register_forward_hook(lambda mod, args, out: kept.append(out[1])) for m in stock_model.modules()
             if isinstance(m, TopKRouter)]
    try:
        lp_naive = naive_moe_logprobs(stock_model, sequences)
    finally:
        for h in hooks:
            h.remove()
    loss_naive = loss_fn(lp_naive)
    loss_naive.backward()
    lengths = torch.tensor([len(s) for s in sequences])
    valid = (torch.arange(int(lengths.max()))[:, None] < lengths[None, :]).reshape(-1)  # [s * b], s-major
    kept_naive = float(sum(int(rmap[valid.to(rmap.device)].sum()) for rmap in kept))
    assigned = tree.naive_positions * found[0].topk * len(found) if found else 1.0
    agreement = grad_agreement(grads(branch_model), grads(stock_model))
    return {
        "max_abs_logprob_diff": float((lp_tree.detach() - lp_naive.detach()).abs().max()),
        "loss_rel_diff": abs(float(loss_tree) - float(loss_naive)) / max(abs(float(loss_naive)), 1e-30),
        "grad_cosine": agreement.cosine,
        "grad_rel_error": agreement.rel_error,
        "dropped_tree": 1.0 - kept_tree / assigned,
        "dropped_naive": 1.0 - kept_naive / assigned,
    }
