"""A model's branch routers: finding them, binding a step's statistics, reading their counts."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional

import torch
from torch import Tensor

from megatron_branch._megatron import MoELayer
from megatron_branch.spec.moe.layer import BranchMoELayer
from megatron_branch.spec.moe.router import BranchTopKRouter
from megatron_branch.spec.moe.statistics import RoutingStatistics


def routers(model) -> List[BranchTopKRouter]:
    """The model's :class:`BranchTopKRouter` modules, in layer order."""
    return [m for m in model.modules() if isinstance(m, BranchTopKRouter)]


def stock_moe_error(name: str, module) -> Optional[str]:
    """Why ``module`` (named ``name``) cannot run under tree data, or ``None``: Megatron's
    router computes its batch statistics (aux losses, expert-bias counts, capacity) over
    the tokens it sees: under tree data, the unique tokens, not the naive batch's copies —
    a silently different result."""
    if isinstance(module, MoELayer) and not isinstance(module, BranchMoELayer):
        return (f"model: {name} is Megatron's stock MoELayer, whose router statistics would count each "
                "shared token once instead of once per rollout; build the spec with "
                "get_branch_layer_spec(num_experts=...) or apply megatron_branch.spec.moe.apply_branch_moe to it")
    return None


def check_moe_layers(model) -> None:
    """Raise ``ValueError`` naming the first stock ``MoELayer`` of ``model`` (:func:`stock_moe_error`)."""
    for name, m in model.named_modules():
        error = stock_moe_error(name, m)
        if error:
            raise ValueError(error)


@contextlib.contextmanager
def routing_statistics(model, statistics: Optional[RoutingStatistics],
                       found: Optional[List[BranchTopKRouter]] = None) -> Iterator[None]:
    """Inside, the model's routers (``found``, when the caller has them) take streaming
    units' aux-loss counts from ``statistics``."""
    found = routers(model) if found is None else found
    for router in found:
        router.use_statistics(statistics)
    try:
        yield
    finally:
        for router in found:
            router.use_statistics(None)


@contextlib.contextmanager
def collecting_statistics(model, statistics: RoutingStatistics,
                          found: Optional[List[BranchTopKRouter]] = None) -> Iterator[List[BranchTopKRouter]]:
    """Inside, every tree forward's routing is recorded into ``statistics``; yields the
    routers (``found``, when the caller has them)."""
    found = routers(model) if found is None else found
    for router in found:
        router.collect_into(statistics)
    try:
        yield found
    finally:
        for router in found:
            router.collect_into(None)


def tokens_per_expert(model, reset: bool = False) -> Tensor:
    """``[moe_layers, E]`` tokens routed to each expert since the last reset, counted like
    Megatron's expert-bias counts (forwards with gradients; this rank's tokens, each tree
    token times its multiplicity). Sum over TP x CP (x DP) for the global figure."""
    found = routers(model)
    rows = [r.tokens_per_expert if r.tokens_per_expert is not None
            else torch.zeros(r.config.num_moe_experts, dtype=torch.float64) for r in found]
    if reset:
        for r in found:
            r.tokens_per_expert = None
    return torch.stack([row.cpu() for row in rows]) if rows else torch.zeros(0)
