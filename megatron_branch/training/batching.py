"""Whole-tree data parallelism: a global batch split into trees, balanced over DP ranks,
packed into micro-batches.

A GRPO group (the rollouts of one prompt, possibly multi-turn) is never cut: cutting it
across data-parallel ranks or micro-batches would lose the sharing it exists for. Groups
are balanced over the DP ranks by estimated work (longest-processing-time first), with
work = ``linear_weight`` x unique positions + visible attention pairs, then each rank's
groups are packed first-fit-decreasing into micro-batches of at most
``micro_batch_tokens`` unique tokens (one forest per micro-batch). Losses are normalised
by global counts (Megatron's ``calculate_per_token_loss``), so the update does not depend
on this layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from megatron_branch.tree import BranchTree, Rollout


@dataclass
class TreeMicroBatch:
    """One micro-batch: whole groups of a global batch packed as one tree (a forest).

    Attributes:
        tree: the packed rollouts of this micro-batch.
        rollouts: ``[r]`` index in the global batch of each of the tree's rollouts.
        width: the global batch's ``max_len - 1``; per-rollout log-probs handed to a loss
            are padded to it, so global ``[R, width]`` tensors can be indexed by ``rollouts``.
        score_mask: ``[r, width]``, nonzero where the loss reads log-probs (logits are then
            computed only there); ``None`` scores every token.
        batch_size: rollouts in the global batch (all micro-batches of all data-parallel
            ranks); ``None``: this micro-batch's. A loss call on fewer must not normalise
            by its own counts (:func:`megatron_branch.losses.batch_part`).
    """

    tree: BranchTree
    rollouts: Tensor
    width: int
    score_mask: Optional[Tensor] = None
    batch_size: Optional[int] = None

    @classmethod
    def of(cls, tree: BranchTree) -> "TreeMicroBatch":
        """A whole tree as its own global batch."""
        return cls(tree, torch.arange(tree.num_rollouts), max(tree.max_len - 1, 0), None, tree.num_rollouts)

    @property
    def global_rollouts(self) -> int:
        """:attr:`batch_size`, or this micro-batch's rollouts when it is not known."""
        return self.batch_size if self.batch_size is not None else self.tree.num_rollouts

    def pad(self, lp: Tensor) -> Tensor:
        """``[r, tree.max_len - 1] -> [r, width]`` (zeros past each rollout's end)."""
        return torch.nn.functional.pad(lp, (0, self.width - lp.shape[-1]))


@dataclass
class GroupWork:
    """One group's size: rollouts, unique positions, visible attention pairs, work."""

    group: int
    rollouts: List[int]
    unique_positions: int
    attention_pairs: int
    work: float


@dataclass
class DataParallelPlan:
    """Micro-batches per data-parallel rank, and how balanced they are."""

    ranks: List[List[TreeMicroBatch]]
    groups: List[List[GroupWork]]
    naive_positions: int
    extra: Dict[str, float] = field(default_factory=dict)

    @property
    def work(self) -> List[float]:
        return [sum(g.work for g in gs) for gs in self.groups]

    @property
    def imbalance(self) -> float:
        """max / mean work over the DP ranks (1.0 is perfect)."""
        work = self.work
        mean = sum(work) / len(work)
        return max(work) / mean if mean > 0 else 1.0

    def report(self) -> str:
        lines = [f"{'dp rank':>8s}{'groups':>8s}{'micro-batches':>15s}{'unique tokens':>15s}{'work':>14s}"]
        for r, (mbs, gs) in enumerate(zip(self.ranks, self.groups)):
            tokens = sum(mb.tree.unique_positions for mb in mbs)
            lines.append(f"{r:>8d}{len(gs):>8d}{len(mbs):>15d}{tokens:>15d}{self.work[r]:>14.3g}")
        lines.append(f"max/mean work over DP ranks: {self.imbalance:.3f}")
        return "\n".join(lines)


def group_work(sequences: Sequence[Rollout], group_ids: Sequence[int], linear_weight: float) -> List[GroupWork]:
    """Per group (in order of first appearance): its rollouts and estimated work."""
    members: Dict[int, List[int]] = {}
    for r, g in enumerate(group_ids):
        members.setdefault(int(g), []).append(r)
    out = []
    for g, rollouts in members.items():
        tree = BranchTree.from_sequences([sequences[r] for r in rollouts])
        pairs = tree.attention_pairs()
        out.append(GroupWork(g, rollouts, tree.unique_positions, pairs,
                             linear_weight * tree.unique_positions + pairs))
    return out


def plan_data_parallel(
    sequences: Sequence[Rollout],
    group_ids: Sequence[int],
    dp_size: int,
    *,
    micro_batch_tokens: Optional[int] = None,
    streaming: bool = False,
    linear_weight: float = 0.0,
    score_mask: Optional[Tensor] = None,
) -> DataParallelPlan:
    """Split a global batch into whole-group micro-batches for every DP rank.

    Args:
        sequences: the ``R`` rollouts of the global batch (token ids).
        group_ids: ``[R]`` group of each rollout (e.g. its prompt); a group is never cut.
        dp_size: data-parallel ranks.
        micro_batch_tokens: most unique tokens per micro-batch (``None``: one micro-batch
            per rank).
        streaming: a group larger than ``micro_batch_tokens`` becomes a micro-batch of its
            own (streaming replay bounds its memory); otherwise it is an error.
        linear_weight: per-token linear work in attention-pair units
            (:func:`megatron_branch.scoring.unit.linear_weight`).
        score_mask: ``[R, max_len - 1]``, nonzero where the loss reads log-probs (the
            response mask): each micro-batch gets its rows, so logits are computed only there.

    Returns:
        The :class:`DataParallelPlan`.

    Raises:
        ValueError: ``group_ids`` of the wrong length, fewer groups than DP ranks (a rank
            would have nothing to train on), a non-positive budget, or a group larger
            than the budget without ``streaming``.
    """
    if len(group_ids) != len(sequences):
        raise ValueError(f"group_ids: {len(group_ids)} entries for {len(sequences)} rollouts")
    if dp_size < 1:
        raise ValueError(f"dp_size: must be >= 1, got {dp_size}")
    if micro_batch_tokens is not None and micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens: must be a positive number of tokens, got {micro_batch_tokens}")
    groups = group_work(sequences, group_ids, linear_weight)
    if len(groups) < dp_size:
        raise ValueError(
            f"group_ids: {len(groups)} groups cannot feed {dp_size} data-parallel ranks (groups are "
            f"never cut); use at least {dp_size} prompts or fewer DP ranks"
        )
    if micro_batch_tokens is not None and not streaming:
        for g in groups:
            if g.unique_positions > micro_batch_tokens:
                raise ValueError(
                    f"micro_batch_tokens: group {g.group} has {g.unique_positions} unique tokens, more "
                    f"than the budget of {micro_batch_tokens}; raise the budget or use streaming replay"
                )
    # Longest-processing-time first: biggest group to the least loaded rank.
    per_rank: List[List[GroupWork]] = [[] for _ in range(dp_size)]
    load = [0.0] * dp_size
    for g in sorted(groups, key=lambda g: -g.work):
        r = min(range(dp_size), key=lambda i: (load[i], i))
        per_rank[r].append(g)
        load[r] += g.work
    width = max(len(s) for s in sequences) - 1
    if score_mask is not None and tuple(score_mask.shape) != (len(sequences), width):
        raise ValueError(f"score_mask: expected shape [{len(sequences)}, {width}], got {tuple(score_mask.shape)}")
    ranks = []
    for gs in per_rank:
        gs.sort(key=lambda g: g.rollouts[0])
        ranks.append([_micro_batch(sequences, ids, width, score_mask) for ids in _pack(gs, micro_batch_tokens)])
    return DataParallelPlan(ranks, per_rank, sum(len(s) for s in sequences))


def _micro_batch(sequences, ids: List[int], width: int, score_mask: Optional[Tensor]) -> TreeMicroBatch:
    rollouts = torch.tensor(ids, dtype=torch.long)
    return TreeMicroBatch(BranchTree.from_sequences([sequences[r] for r in ids]), rollouts, width,
                          None if score_mask is None else score_mask[rollouts], len(sequences))


def _pack(groups: List[GroupWork], budget: Optional[int]) -> List[List[int]]:
    """First-fit decreasing by unique tokens; each bin lists its rollouts in batch order."""
    if budget is None:
        return [sorted(r for g in groups for r in g.rollouts)]
    bins: List[List[GroupWork]] = []
    used: List[int] = []
    for g in sorted(groups, key=lambda g: (-g.unique_positions, g.rollouts[0])):
        for i, u in enumerate(used):
            if u + g.unique_positions <= budget:
                bins[i].append(g)
                used[i] += g.unique_positions
                break
        else:
            bins.append([g])
            used.append(g.unique_positions)
    packed = [sorted(r for g in b for r in g.rollouts) for b in bins]
    return sorted(packed, key=lambda ids: ids[0])
