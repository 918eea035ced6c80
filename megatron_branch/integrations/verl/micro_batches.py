"""Micro-batches that keep every GRPO group whole, for verl's Megatron engine.

verl splits a mini-batch into micro-batches by token budget (``rearrange_micro_batches``),
which balances work but cuts the ``uid`` groups whose rollouts share a prompt, so a tree
per micro-batch would lose the sharing it exists for. :func:`group_micro_batches` has the
contract of verl's ``prepare_micro_batches`` (the micro-batch TensorDicts and, per
micro-batch, the indices verl's ``restore_dynamic_batch`` uses to put the outputs back in
the mini-batch's order) and:

* packs whole groups first-fit-decreasing under ``max_token_len_per_gpu`` *unique* tokens
  (a group's prefix tree: what the step computes);
* gives every data-parallel rank the same number of micro-batches (verl's schedule needs
  it): the count is the maximum over the DP group, reached by splitting the largest
  micro-batches (whole groups first; a group is cut only when a rank has fewer groups than
  micro-batches: still exact, only less shared);
* rounds the count up to a multiple of ``num_batches_divided_by`` (virtual pipeline).

Only with ``use_dynamic_bsz`` (verl restores the order from the indices); static
micro-batch sizes keep verl's own contiguous chunks.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_branch.model import HOST
from megatron_branch.tree import BranchTree


def _groups(uids: Sequence, lengths: Sequence[int]) -> List[List[int]]:
    members: Dict[object, List[int]] = {}
    for i, u in enumerate(uids):
        members.setdefault(u, []).append(i)
    return list(members.values())


def pack_groups(sequences: Sequence[torch.Tensor], uids: Sequence, budget: int) -> List[List[int]]:
    """Sample indices per micro-batch: whole groups, first-fit decreasing by unique tokens."""
    groups = _groups(uids, [len(s) for s in sequences])
    sized = [(BranchTree.from_sequences([sequences[i] for i in g]).unique_positions, g) for g in groups]
    bins: List[List[int]] = []
    used: List[int] = []
    for size, g in sorted(sized, key=lambda x: (-x[0], x[1][0])):
        for b, u in enumerate(used):
            if u + size <= budget:
                bins[b] += g
                used[b] += size
                break
        else:
            bins.append(list(g))
            used.append(size)
    return [sorted(b) for b in bins]


def split_to(bins: List[List[int]], uids: Sequence, count: int) -> List[List[int]]:
    """Split the largest micro-batches until there are ``count`` (whole groups first)."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        bins.sort(key=len, reverse=True)
        big = bins.pop(0)
        groups = _groups([uids[i] for i in big], [0] * len(big))
        if len(groups) > 1:  # halve by groups
            half = len(groups) // 2
            left = sorted(big[i] for g in groups[:half] for i in g)
            right = sorted(big[i] for g in groups[half:] for i in g)
        elif len(big) > 1:  # one group left: cut it (exact, less shared)
            left, right = big[: len(big) // 2], big[len(big) // 2:]
        else:
            raise ValueError(f"micro-batches: this rank has {sum(len(b) for b in bins) + 1} rollouts, fewer than the "
                             f"{count} micro-batches another data-parallel rank needs")
        bins += [left, right]
    return sorted(bins, key=lambda b: b[0])


def group_micro_batches(data, dp_group=None, num_batches_divided_by: Optional[int] = None,
                        **unused) -> Tuple[list, List[List[int]]]:
    """verl's ``prepare_micro_batches`` contract, with whole groups (see the module docstring)."""
    from verl.utils import tensordict_utils as tu  # verl is this integration's own dependency

    input_ids = data["input_ids"]
    sequences = list(input_ids.unbind())
    uids = [str(u) for u in list(data["uid"])] if "uid" in data.keys() else [str(i) for i in range(len(sequences))]
    budget = int(tu.get_non_tensor_data(data, key="max_token_len_per_gpu", default=0)) * int(
        tu.get_non_tensor_data(data, key="sp_size", default=1))
    if budget <= 0:
        raise ValueError("max_token_len_per_gpu: group micro-batches need verl's token budget (use_dynamic_bsz)")
    bins = pack_groups([s.to(HOST) for s in sequences], uids, budget)
    count = torch.tensor(len(bins), device=input_ids.device)
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    target = int(count)
    if num_batches_divided_by:
        target = -(-target // num_batches_divided_by) * num_batches_divided_by
    bins = split_to(bins, uids, target)
    return [tu.index_select_tensor_dict(data, idx) for idx in bins], bins
