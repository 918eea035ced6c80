"""Micro-batches that keep every GRPO group whole, for verl's Megatron engine.

verl splits a mini-batch into micro-batches by token budget (``rearrange_micro_batches``),
which balances work but cuts the ``uid`` groups whose rollouts share a prompt, so a tree
per micro-batch would lose the sharing it exists for. :func:`group_micro_batches` has the
contract of verl's ``prepare_micro_batches`` (the micro-batch TensorDicts and, per
micro-batch, the indices verl's ``restore_dynamic_batch`` uses to put the outputs back in
the mini-batch's order) and:

* packs whole groups first-fit-decreasing under ``max_token_len_per_gpu`` *unique* tokens
  (a group's prefix tree: what the step computes); a group whose tree alone is larger is cut
  at rollout boundaries into parts that fit (:func:`split_group`: each part recomputes the
  prefix it shares; exact), so no micro-batch computes more than the budget;
* gives every data-parallel rank the same number of micro-batches (verl's schedule needs
  it): the count is the maximum over the DP group, reached by splitting the largest
  micro-batches (whole groups first; a group is cut only when a rank has fewer groups than
  micro-batches: still exact, only less shared);
* rounds the count up to a multiple of ``num_batches_divided_by`` (virtual pipeline).

Only with ``use_dynamic_bsz`` (verl restores the order from the indices); static
micro-batch sizes keep verl's own contiguous chunks.

:class:`SharingStats` counts, per ``forward_backward_batch``, the tokens verl's stock engine
would compute (naive), the unique ones branch replay computed, and the groups that arrived
split (across micro-batches or data-parallel ranks): verl's metrics ``branch/*``. A batch
without ``uid`` is one group per rollout.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from megatron_branch.model import HOST
from megatron_branch.tree import BranchTree


def _groups(uids: Sequence, lengths: Sequence[int]) -> List[List[int]]:
    members: Dict[object, List[int]] = {}
    for i, u in enumerate(uids):
        members.setdefault(u, []).append(i)
    return list(members.values())


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two token sequences."""
    m = min(len(a), len(b))
    differ = (a[:m] != b[:m]).nonzero()
    return int(differ[0]) if len(differ) else m


def split_group(sequences: Sequence[torch.Tensor], members: Sequence[int], budget: int) -> List[List[int]]:
    """``members`` (indices into ``sequences``, one group) cut at rollout boundaries into parts
    whose prefix trees fit ``budget`` unique tokens. Rollouts are taken in token order, so each
    part holds neighbours that share the most; each part recomputes the prefix it shares.

    A trie grows by a sequence's length minus its longest common prefix with one already in
    it, so each part's size is kept as rollouts join it.

    Raises:
        ValueError: a single rollout longer than ``budget``, naming ``max_token_len_per_gpu``.
    """
    order = sorted(members, key=lambda i: sequences[i].tolist())
    parts: List[List[int]] = []
    current: List[int] = []
    size = 0
    for i in order:
        seq = sequences[i]
        if len(seq) > budget:
            raise ValueError(f"max_token_len_per_gpu: a rollout of {len(seq)} tokens does not fit the "
                             f"budget of {budget} tokens (raise actor.ppo_max_token_len_per_gpu / "
                             "log_prob_max_token_len_per_gpu)")
        grows = len(seq) - max((_common_prefix(seq, sequences[j]) for j in current), default=0)
        if current and size + grows > budget:
            parts.append(sorted(current))
            current, grows = [], len(seq)
            size = 0
        current.append(i)
        size += grows
    if current:
        parts.append(sorted(current))
    return parts


def pack_groups(sequences: Sequence[torch.Tensor], uids: Sequence, budget: int) -> List[List[int]]:
    """Sample indices per micro-batch: whole groups, first-fit decreasing by unique tokens,
    none above ``budget`` (a group whose tree is larger is cut by :func:`split_group`)."""
    items = []
    for g in _groups(uids, [len(s) for s in sequences]):
        size = BranchTree.from_sequences([sequences[i] for i in g]).unique_positions
        if size <= budget:
            items.append((size, g))
            continue
        for part in split_group(sequences, g, budget):
            items.append((BranchTree.from_sequences([sequences[i] for i in part]).unique_positions, part))
    bins: List[List[int]] = []
    used: List[int] = []
    for size, g in sorted(items, key=lambda x: (-x[0], x[1][0])):
        for b, u in enumerate(used):
            if u + size <= budget:  # a sum of trees bounds the tree of their union
                bins[b] += g
                used[b] += size
                break
        else:
            bins.append(list(g))
            used.append(size)
    return [sorted(b) for b in bins]


def batch_uids(data) -> List[str]:
    """The ``uid`` of every sample of a verl batch; without ``uid``, one group per rollout."""
    num = len(data["input_ids"].offsets()) - 1 if data["input_ids"].is_nested else int(data["input_ids"].shape[0])
    if "uid" not in data.keys():
        return [f"\0rollout{i}" for i in range(num)]  # cannot collide with verl's uuid strings
    return [str(u) for u in list(data["uid"])]


class SharingStats:
    """What branch replay shared in one ``forward_backward_batch`` call (this rank's micro-batches)."""

    def __init__(self) -> None:
        self.naive_tokens = 0
        self.unique_tokens = 0
        self.split_groups = 0
        self._where: Dict[str, Set[int]] = {}  # uid -> micro-batches holding its rollouts
        self._sizes: Dict[str, int] = {}
        self._micro_batches = 0

    def add(self, values: torch.Tensor, offsets: torch.Tensor, uids: Sequence[str]) -> None:
        """One micro-batch: packed tokens ``values`` of sequences bounded by ``offsets``."""
        bounds = offsets.to(HOST)
        flat = values.detach().to(HOST)
        tree = BranchTree.from_sequences([flat[int(a):int(b)] for a, b in zip(bounds[:-1], bounds[1:])])
        self.naive_tokens += int(bounds[-1] - bounds[0])
        self.unique_tokens += tree.unique_positions
        for u in uids:
            self._where.setdefault(u, set()).add(self._micro_batches)
            self._sizes[u] = self._sizes.get(u, 0) + 1
        self._micro_batches += 1

    def metrics(self, group=None) -> Dict[str, float]:
        """verl metrics: ``branch/naive_tokens``, ``branch/unique_tokens``, ``branch/share_ratio``
        (the fraction of naive tokens not recomputed: 0 = nothing shared) and
        ``branch/split_groups`` (groups of more than one rollout that arrived in several
        micro-batches here or on several data-parallel ranks of ``group``).

        A collective over ``group`` (every rank of it must call) when it has more than one rank.
        """
        split = {u for u, where in self._where.items() if len(where) > 1}
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            everyone: List[Optional[Dict[str, int]]] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, self._sizes, group=group)
            ranks: Dict[str, int] = {}
            for sizes in everyone:
                for u in sizes or {}:
                    ranks[u] = ranks.get(u, 0) + 1
            split |= {u for u, n in ranks.items() if n > 1}
        self.split_groups = len(split)
        naive = max(self.naive_tokens, 1)
        return {"branch/naive_tokens": float(self.naive_tokens), "branch/unique_tokens": float(self.unique_tokens),
                "branch/share_ratio": 1.0 - self.unique_tokens / naive if self.naive_tokens else 0.0,
                "branch/split_groups": float(self.split_groups)}


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
    uids = batch_uids(data)
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
