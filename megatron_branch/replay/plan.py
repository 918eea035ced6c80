"""Split a packed tree into replay units: stems (cached) and chunks (forward+backward).

A *unit* is a contiguous packed range ``[start, end)`` run in one model forward. A
*stem* unit is forwarded once, its per-layer K/V cached and pushed on a stack; the units
below it attend to every cached token (all of them are ancestors) and, when they are
done, the stem's own backward runs and it is popped. A *chunk* unit is forwarded,
its rollouts' loss evaluated and backpropagated at once.

A stem is a chain of the tree (its *path*, whose K/V the units below read). With
``attach_subtrees`` it also runs the leading complete subtrees below the chain that fit
the budget, where that saves a unit: they are not cached (no later unit descends from
them), and their rollouts' loss is evaluated with the stem and backpropagated at its pop.
Every unit costs one model forward and backward of fixed cost, so fewer units run faster.

The walk is depth-first, so memory holds the caches along the current path plus one
unit. Every unit has at most ``max_chunk_tokens`` tokens: a segment longer than that is
cut into consecutive stem units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_branch.tree import BranchTree


@dataclass(frozen=True)
class ReplayOp:
    """One step of a replay plan.

    ``kind`` is ``"stem"`` (forward ``[start, end)`` and push its cache), ``"chunk"``
    (forward, loss and backward of ``[start, end)``) or ``"pop"`` (the final backward of
    the stem on top of the stack, then pop it). A stem's ``path_end`` (``None``: ``end``)
    ends its chain: the tokens ``[path_end, end)`` are complete subtrees run with it.
    """

    kind: str
    start: int = 0
    end: int = 0
    path_end: Optional[int] = None

    @property
    def cached_end(self) -> int:
        """End of the tokens whose K/V the units below read (a stem's chain)."""
        return self.end if self.path_end is None else self.path_end


class _Planner:
    def __init__(self, tree: BranchTree, budget: int, group_of_root: Optional[Dict[int, int]], attach: bool):
        self.tree = tree
        self.budget = budget
        self.attach = attach
        self.seg_at = {s.start: s for s in tree.segments}
        self.ops: List[ReplayOp] = []
        self.group_of_root = group_of_root or {}

    def run(self) -> None:
        """Plan the whole tree with an explicit work stack (no recursion: trees thousands
        of levels deep and stems cut into thousands of budget-sized pieces are fine)."""
        work: List[tuple] = [("forest", 0, self.tree.unique_positions)]
        while work:
            item = work.pop()
            if item[0] == "pop":
                self.ops.append(ReplayOp("pop"))
            elif item[0] == "chunk":
                self.ops.append(ReplayOp("chunk", item[1], item[2]))
            elif item[0] == "forest":
                work.extend(reversed(self._forest(item[1], item[2])))
            else:
                work.extend(reversed(self._subtree(*item[1:])))

    def _siblings(self, lo: int, hi: int) -> List[tuple]:
        """``(start, end, subtree_end)`` of the sibling subtrees tiling ``[lo, hi)``."""
        subtrees = []
        pos = lo
        while pos < hi:
            seg = self.seg_at[pos]
            subtrees.append((seg.start, seg.end, seg.subtree_end))
            pos = seg.subtree_end
        return subtrees

    def _forest(self, lo: int, hi: int) -> List[tuple]:
        """Sibling subtrees tiling ``[lo, hi)``: small ones grouped into chunks, in order."""
        items: List[tuple] = []
        group_lo = group_hi = None
        for span in self._spans(self._siblings(lo, hi)):
            s0, s1 = span[0][0], span[-1][2]
            if s1 - s0 <= self.budget:
                if group_lo is not None and s1 - group_lo > self.budget:
                    items.append(("chunk", group_lo, group_hi))
                    group_lo = None
                group_lo = s0 if group_lo is None else group_lo
                group_hi = s1
                continue
            if group_lo is not None:
                items.append(("chunk", group_lo, group_hi))
                group_lo = None
            if len(span) > 1:
                raise ValueError(
                    f"group_ids: a group's rollouts span {s1 - s0} tokens below their shared "
                    f"stem (packed {s0}..{s1}); max_chunk_tokens must be at least {s1 - s0}"
                )
            items.append(("subtree",) + span[0])
        if group_lo is not None:
            items.append(("chunk", group_lo, group_hi))
        return items

    def _subtree(self, start: int, end: int, subtree_end: int) -> List[tuple]:
        """The chain ``[start, end)`` and everything below it (ends at ``subtree_end``)."""
        if subtree_end - start <= self.budget:
            return [("chunk", start, subtree_end)]
        stem_end = min(end, start + self.budget)
        if stem_end < end:
            self.ops.append(ReplayOp("stem", start, stem_end))
            return [("subtree", stem_end, end, subtree_end), ("pop",)]
        attached, below = self._attached(start, end, subtree_end) if self.attach else (end, None)
        self.ops.append(ReplayOp("stem", start, attached, None if attached == end else end))
        return (below if below is not None else [("forest", attached, subtree_end)]) + [("pop",)]

    def _attached(self, start: int, end: int, subtree_end: int) -> Tuple[int, List[tuple]]:
        """End of the complete subtrees below the chain ``[start, end)`` that run with it (the
        leading sibling spans that fit the budget, if that saves a unit, else ``end``) and
        the planned items of the rest of its subtree."""
        pos = end
        for span in self._spans(self._siblings(end, subtree_end)):
            if span[-1][2] - start > self.budget:
                break
            pos = span[-1][2]
        alone = self._forest(end, subtree_end)
        if pos == end:
            return end, alone
        rest = self._forest(pos, subtree_end)
        return (pos, rest) if len(rest) < len(alone) else (end, alone)

    def _spans(self, subtrees):
        """Sibling subtrees merged into contiguous spans that keep groups together."""
        if not self.group_of_root:
            return [[s] for s in subtrees]
        first: Dict[int, int] = {}
        reach = list(range(len(subtrees)))
        for i, (s0, _, s1) in enumerate(subtrees):
            for g in self._groups_in(s0, s1):
                if g in first:
                    reach[first[g]] = max(reach[first[g]], i)
                else:
                    first[g] = i
        spans, i = [], 0
        while i < len(subtrees):
            j, far = i, reach[i]
            while j < far:
                j += 1
                far = max(far, reach[j])
            spans.append(subtrees[i : far + 1])
            i = far + 1
        return spans

    def _groups_in(self, lo: int, hi: int):
        return {g for idx, g in self.group_of_root.items() if lo <= idx < hi}


def plan_replay(
    tree: BranchTree, max_chunk_tokens: Optional[int], group_ids: Optional[Sequence[int]] = None,
    attach_subtrees: bool = False,
) -> List[ReplayOp]:
    """The replay plan of ``tree``.

    Args:
        tree: the packed rollouts.
        max_chunk_tokens: most tokens per unit; ``None`` runs the whole tree as one chunk.
        group_ids: ``[R]`` ids; rollouts with the same id have their loss evaluated in
            the same call (e.g. DPO pairs).
        attach_subtrees: let a stem also run complete subtrees below its chain where that
            saves a unit (exact replay keeping the stems' activations; see the module
            docstring). Off for tail-only replay, whose stems are constants.

    Raises:
        ValueError: a non-positive budget, ``group_ids`` of the wrong length, or a group
            that cannot fit one chunk (the message gives the budget needed).
    """
    U = tree.unique_positions
    if max_chunk_tokens is None:
        return [ReplayOp("chunk", 0, U)]
    if int(max_chunk_tokens) < 1:
        raise ValueError(f"max_chunk_tokens: must be a positive number of tokens, got {max_chunk_tokens}")
    group_of_last = None
    if group_ids is not None:
        if len(group_ids) != tree.num_rollouts:
            raise ValueError(f"group_ids: {len(group_ids)} entries for {tree.num_rollouts} rollouts")
        ends = last_token(tree)
        group_of_last = {int(ends[r]): int(g) for r, g in enumerate(group_ids)}
    planner = _Planner(tree, int(max_chunk_tokens), group_of_last, attach_subtrees)
    planner.run()
    ops = planner.ops
    if group_ids is not None:
        _check_groups(tree, ops, group_ids)
    return ops


def path_capacity(ops: Sequence[ReplayOp], rows_of: Optional[Callable[[ReplayOp], int]] = None) -> int:
    """Most stem rows on the stack at once: the rows a path cache needs.

    Args:
        ops: the plan.
        rows_of: rows a stem unit adds on this rank (default its chain's tokens; under
            context parallelism their CP share).
    """
    depth, stack, most = 0, [], 0
    for op in ops:
        if op.kind == "stem":
            stack.append(rows_of(op) if rows_of is not None else op.cached_end - op.start)
            depth += stack[-1]
            most = max(most, depth)
        elif op.kind == "pop":
            depth -= stack.pop()
    return most


def last_token(tree: BranchTree) -> np.ndarray:
    """``[R]`` packed index of each rollout's last token."""
    rows = tree.rows.numpy()
    return rows[np.arange(tree.num_rollouts), tree.lengths.numpy() - 1]


def unit_of_rollouts(tree: BranchTree, ops: Sequence[ReplayOp]) -> Dict[int, List[int]]:
    """``op index -> rollouts whose last token lies in that unit``."""
    starts = [(op.start, i) for i, op in enumerate(ops) if op.kind != "pop"]
    starts.sort()
    keys = np.array([s for s, _ in starts])
    owner: Dict[int, List[int]] = {}
    for r, idx in enumerate(last_token(tree)):
        pos = int(np.searchsorted(keys, idx, side="right")) - 1
        owner.setdefault(starts[pos][1], []).append(r)
    return owner


def _check_groups(tree, ops, group_ids) -> None:
    unit_of = {}
    for op_idx, rollouts in unit_of_rollouts(tree, ops).items():
        for r in rollouts:
            unit_of[r] = op_idx
    seen: Dict[int, int] = {}
    for r, g in enumerate(group_ids):
        if seen.setdefault(int(g), unit_of[r]) != unit_of[r]:
            raise ValueError(
                f"group_ids: group {int(g)} has rollouts ending inside a shared stem and below "
                f"it; raise max_chunk_tokens so the group's subtree fits one chunk"
            )
