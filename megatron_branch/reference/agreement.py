"""Agreement with a reference: log-probs, loss and every gradient.

:func:`grad_agreement` is the one gradient comparison of the package (the exactness
report, the benches, the study and the bias measurements all use it);
:func:`check_against_naive` runs branch replay and the naive computation on the same
rollouts and compares everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

import torch
from torch import Tensor

from megatron_branch.model import param_grad
from megatron_branch.reference.naive import naive_rollout_logprobs
from megatron_branch.scoring.logprobs import rollout_logprobs
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
    """``name -> accumulated gradient`` (``main_grad`` under Megatron DDP; zeros for
    parameters that got none), cloned."""
    out = {}
    for n, p in model.named_parameters():
        g = param_grad(p)
        out[n] = g.detach().clone() if g is not None else torch.zeros_like(p)
    return out


def rel_diff(a: Tensor, b: Tensor) -> float:
    """``max|a - b| / max|b|`` (absolute where ``b`` is all zero)."""
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


@dataclass
class GradAgreement:
    """How close a gradient is to a reference gradient (the one helper every comparison uses).

    Attributes:
        per_param: ``name -> max|g - g_ref| / max|g_ref|`` (:func:`rel_diff`).
        max_rel_diff: the largest of ``per_param``; ``worst_param`` names it.
        cosine: cosine similarity of the flattened gradients (0 when ``g`` is zero).
        rel_norm: ``|g| / |g_ref|``; rel_error: ``|g - g_ref| / |g_ref|`` (flattened; ``None``
            when the reference is zero).
    """

    per_param: Dict[str, float]
    max_rel_diff: float
    worst_param: str
    cosine: Optional[float]
    rel_norm: Optional[float]
    rel_error: Optional[float]


def grad_agreement(got: Dict[str, Tensor], ref: Dict[str, Tensor]) -> GradAgreement:
    """Compare ``name -> gradient`` dicts; names must match exactly.

    Raises:
        ValueError: the parameter names differ (the first few are named).
    """
    if set(got) != set(ref):
        raise ValueError(f"parameter names differ: {sorted(set(got) ^ set(ref))[:5]}")
    per_param = {n: rel_diff(got[n].float(), ref[n].float()) for n in ref}
    worst = max(per_param, key=per_param.get) if per_param else ""
    flat_got = torch.cat([got[n].detach().float().reshape(-1).cpu() for n in ref]) if ref else torch.zeros(0)
    flat_ref = torch.cat([ref[n].detach().float().reshape(-1).cpu() for n in ref]) if ref else torch.zeros(0)
    norm = float(flat_ref.norm())
    if norm == 0.0:
        cosine = rel_norm = rel_error = None
    else:
        cosine = (float(torch.nn.functional.cosine_similarity(flat_got, flat_ref, dim=0))
                  if float(flat_got.norm()) > 0 else 0.0)
        rel_norm = float(flat_got.norm()) / norm
        rel_error = float((flat_got - flat_ref).norm()) / norm
    return GradAgreement(per_param, per_param.get(worst, 0.0), worst, cosine, rel_norm, rel_error)


def compare_grads(got: Dict[str, Tensor], ref: Dict[str, Tensor]) -> Dict[str, float]:
    """Per-parameter relative gradient difference (:attr:`GradAgreement.per_param`)."""
    return grad_agreement(got, ref).per_param


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
    agreement = grad_agreement(grads(branch_model), grads(stock_model))
    return ExactnessReport(
        max_abs_logprob_diff=(lp_branch.detach() - lp_naive.detach()).abs().max().item(),
        loss_branch=loss_b.item(),
        loss_naive=loss_n.item(),
        max_rel_grad_diff=agreement.max_rel_diff,
        worst_param=agreement.worst_param,
        grad_rel_diffs=agreement.per_param,
    )
