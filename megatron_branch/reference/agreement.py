"""Compare branch replay with the naive computation: log-probs, loss, every gradient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

import torch
from torch import Tensor

from megatron_branch.scoring.logprobs import rollout_logprobs
from megatron_branch.reference.naive import naive_rollout_logprobs
from megatron_branch.tree import BranchTree

LossFn = Callable[[Tensor], Tensor]


@dataclass
class ExactnessReport:
    """Differences between branch replay and the naive per-rollout computation."""

    max_abs_logprob_diff: float
    loss_branch: float
    loss_naive: float
    max_rel_grad_diff: float
    worst_param: str
    grad_rel_diffs: Dict[str, float]

    @property
    def loss_rel_diff(self) -> float:
        return abs(self.loss_branch - self.loss_naive) / max(abs(self.loss_naive), 1e-30)


def grads(model) -> Dict[str, Tensor]:
    """``name -> grad`` (zeros for parameters that got none)."""
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def rel_diff(a: Tensor, b: Tensor) -> float:
    """``max|a - b| / max|b|`` (absolute where ``b`` is all zero)."""
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def compare_grads(got: Dict[str, Tensor], ref: Dict[str, Tensor]) -> Dict[str, float]:
    """Per-parameter relative gradient difference; names must match exactly."""
    if set(got) != set(ref):
        raise ValueError(f"parameter names differ: {sorted(set(got) ^ set(ref))[:5]}")
    return {n: rel_diff(got[n].float(), ref[n].float()) for n in ref}


def check_against_naive(
    branch_model,
    stock_model,
    sequences: Sequence,
    loss_fn: LossFn,
    tree: Optional[BranchTree] = None,
    branch_logprobs: Optional[Callable[[object, BranchTree], Tensor]] = None,
) -> ExactnessReport:
    """Run ``loss_fn`` on branch-replay and naive log-probs and compare everything.

    Args:
        branch_model: GPTModel built with the branch spec.
        stock_model: GPTModel built with Megatron's stock local spec, same weights.
        sequences: the rollouts.
        loss_fn: ``[R, T]`` log-probs -> scalar loss.
        tree: the packed tree (built from ``sequences`` if None).
        branch_logprobs: how to get the branch log-probs (default :func:`rollout_logprobs`).
    """
    tree = tree or BranchTree.from_sequences(sequences)
    for m in (branch_model, stock_model):
        m.zero_grad(set_to_none=True)
    lp_branch = (branch_logprobs or rollout_logprobs)(branch_model, tree)
    loss_b = loss_fn(lp_branch)
    loss_b.backward()
    lp_naive = naive_rollout_logprobs(stock_model, sequences)
    loss_n = loss_fn(lp_naive)
    loss_n.backward()
    diffs = compare_grads(grads(branch_model), grads(stock_model))
    worst = max(diffs, key=diffs.get)
    return ExactnessReport(
        max_abs_logprob_diff=(lp_branch.detach() - lp_naive.detach()).abs().max().item(),
        loss_branch=loss_b.item(),
        loss_naive=loss_n.item(),
        max_rel_grad_diff=diffs[worst],
        worst_param=worst,
        grad_rel_diffs=diffs,
    )
