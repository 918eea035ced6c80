"""Exactness checked at run time: every N steps, a few rollouts recomputed the plain way.

The tests prove branch replay exact on their models and data; a user's own model, data and
layout get this check during training. Every ``every`` steps it takes ``rollouts`` rollouts
of one group (they share a prefix, so the tree path's sharing is exercised), computes their
log-probs twice with the current weights and temperature — once as a tree of those
rollouts (the branch path), once each rollout alone as a plain causal sequence (the branch
layer without tree data computes what Megatron's stock spec computes) — and reports the
largest difference; above ``tolerance`` it raises.

Cost, per checked step: two forwards (no backward) of ``rollouts`` rollouts, e.g. about
``2 x 2 / R`` of a step's forward work for ``R`` rollouts per rank, nothing on other steps.
Under context parallelism a plain sequence cannot be split over the CP ranks, so each
rollout runs alone as a one-rollout tree (no sharing), still every CP rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from megatron_branch.layout import ParallelLayout
from megatron_branch.model import HOST
from megatron_branch.reference.naive import naive_rollout_logprobs
from megatron_branch.scoring.logprobs import rollout_logprobs
from megatron_branch.tree import BranchTree


class ExactnessError(ValueError):
    """Branch replay's log-probs differ from the per-rollout computation beyond the tolerance."""


@dataclass
class ExactnessCheck:
    """Run-time agreement check, called once per training step.

    Args:
        every: check on every ``every``-th call (the first call is checked).
        rollouts: rollouts of one group recomputed each time (>= 2, so they share a prefix).
        tolerance: largest accepted ``max |lp_tree - lp_plain|``; ``None`` reports only.

    Attributes:
        history: ``(call, max_abs_logprob_diff)`` of every check made.
    """

    every: int = 100
    rollouts: int = 2
    tolerance: Optional[float] = 1e-3
    calls: int = 0
    history: List[tuple] = field(default_factory=list)

    def __post_init__(self):
        if int(self.every) < 1:
            raise ValueError(f"verify_every: must be >= 1, got {self.every}")
        if int(self.rollouts) < 1:
            raise ValueError(f"verify_rollouts: must be >= 1, got {self.rollouts}")
        if self.tolerance is not None and not self.tolerance > 0:
            raise ValueError(f"verify_tolerance: must be > 0 or None, got {self.tolerance}")

    def due(self) -> bool:
        """Count a call; True when this one is checked."""
        self.calls += 1
        return (self.calls - 1) % self.every == 0

    def run(self, model, sequences: Sequence[torch.Tensor], temperatures: Optional[torch.Tensor] = None) -> float:
        """``max |lp_tree - lp_plain|`` over ``sequences`` (the sample); raises above the tolerance.

        Args:
            model: one model chunk (wrapped or not) on its last pipeline stage.
            sequences: the sampled rollouts' token ids.
            temperatures: ``[r]`` their sampling temperatures (``None``: 1).
        """
        temps = None if temperatures is None else temperatures.to(HOST, torch.float64)
        with torch.no_grad():
            tree = BranchTree.from_sequences(list(sequences))
            lp_tree = rollout_logprobs(model, tree, temperature=temps)
            if ParallelLayout.current().cp > 1:
                plain = [rollout_logprobs(model, BranchTree.from_sequences([s]),
                                          temperature=None if temps is None else temps[i:i + 1])[0]
                         for i, s in enumerate(sequences)]
                width = lp_tree.shape[1]
                lp_plain = torch.stack([torch.nn.functional.pad(p, (0, width - p.numel())) for p in plain])
            else:
                # the model as the step runs it (Float16Module / DDP wrappers included)
                lp_plain = naive_rollout_logprobs(model, list(sequences), temperature=temps)
        diff = float((lp_tree.float() - lp_plain.float().to(lp_tree.device)).abs().max())
        self.history.append((self.calls, diff))
        if self.tolerance is not None and diff > self.tolerance:
            raise ExactnessError(
                f"run-time exactness check (call {self.calls}): branch replay's log-probs differ from the per-rollout "
                f"forward by {diff:.3e} > verify_tolerance {self.tolerance:g} on {len(sequences)} rollouts of one group; "
                "stop and report: this model, layout or data is not handled exactly")
        return diff


def sample_group(tree: BranchTree, count: int) -> List[torch.Tensor]:
    """``count`` rollouts of ``tree`` that share the longest prefix with rollout 0 (its group)."""
    return [tree.sequence(r) for r in sample_rollouts(tree, count)]


def sample_rollouts(tree: BranchTree, count: int) -> List[int]:
    """Indices of ``count`` rollouts sharing the longest prefix with rollout 0 (rollout 0 first)."""
    first = tree.rows[0]
    shared = [(int(((tree.rows[r] == first) & (first >= 0)).sum()), -r) for r in range(tree.num_rollouts)]
    return [-r for _, r in sorted(shared, reverse=True)][:count]
