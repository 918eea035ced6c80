"""The MoE phase of a replay step: when the routers need the whole tree's counts first.

A streaming step forwards and backwards part of the tree before the rest has been
routed, so an aux loss (which needs the naive batch's expert counts) gets them from one
forward-only pass over the tree made first
(:func:`megatron_branch.replay.step.collect_routing_statistics`), unless every backward
of the plan runs after its last forward (one trailing chunk below the stems, the common
shape of a G-rollout group): then the step's own forwards count the tree and the aux
losses' gradients read the counts at the backward. This module decides which, and checks
that expert-parallel ranks can run the step at all.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from megatron_branch.layout import ParallelLayout
from megatron_branch.replay.plan import ReplayOp
from megatron_branch.spec.moe import AUX_LOSSES, BranchTopKRouter, routers


def forwards_in_parts(ops: Sequence[ReplayOp]) -> bool:
    """The plan forwards the tree in more than one unit."""
    return sum(op.kind in ("stem", "chunk") for op in ops) > 1


def routed_before_backward(ops: Sequence[ReplayOp]) -> bool:
    """Every model backward of the plan runs after its last forward (at most one chunk,
    the last unit; the stems' backwards run at their pops): the step's own forwards have
    then routed the whole tree before any aux loss needs its counts, so no statistics pass
    is needed (:class:`~megatron_branch.spec.moe.RoutingStatistics` ``in_step``)."""
    forwards = [i for i, op in enumerate(ops) if op.kind in ("stem", "chunk")]
    backwards = [i for i, op in enumerate(ops) if op.kind in ("chunk", "pop")]
    return not forwards or not backwards or min(backwards) >= max(forwards)


def needs_routing_statistics(model, ops: Sequence[ReplayOp], found: Optional[List[BranchTopKRouter]] = None) -> bool:
    """Whether a replay step with the plan ``ops`` needs the whole tree's router counts
    first: an aux loss is on, the model trains with gradients, and the step forwards the
    tree in parts. ``found``: the model's routers, when the caller has them."""
    found = routers(model) if found is None else found
    if not found or not torch.is_grad_enabled() or not any(r.training for r in found):
        return False
    if not any(r.get_aux_loss_coeff(kind) > 0 for r in found for kind in AUX_LOSSES):
        return False
    return forwards_in_parts(ops)


def check_expert_parallel_plan(model, ops: Sequence[ReplayOp], *, recompute_stem: bool = False,
                               prefix_grad: str = "exact", found: Optional[List[BranchTopKRouter]] = None) -> None:
    """Raise unless every rank of the expert-parallel group runs the same sequence of
    forwards and backwards (every MoE forward is an all-to-all over the EP group, so a
    rank with more or fewer units would hang the others). Collective over the EP group
    when the model has MoE layers and EP has more than one rank.

    Raises:
        ValueError: the ranks' replay plans differ (EP across data-parallel ranks whose
            trees split into different units): use one packed pass
            (``max_chunk_tokens=None``), or trees and budgets that give equal plans.
    """
    ep_group = ParallelLayout.current().group("ep")
    if ep_group is None or not (routers(model) if found is None else found):
        return
    mine = (tuple(op.kind for op in ops), bool(recompute_stem), prefix_grad)
    plans = [None] * ep_group.size()
    torch.distributed.all_gather_object(plans, mine, group=ep_group)
    if any(plan != mine for plan in plans):
        counts = [f"{sum(k != 'pop' for k in plan[0])} units" for plan in plans]
        raise ValueError(
            f"expert parallelism: the ranks of the EP group would run different replay plans ({', '.join(counts)}); "
            "each MoE forward is an all-to-all over the group, so every rank must run the same sequence of "
            "forwards and backwards. Use max_chunk_tokens=None (one packed pass per tree) or trees and budgets "
            "with equal plans on every rank of the group")
