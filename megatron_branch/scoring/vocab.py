"""Log-probs and entropies from vocab-parallel logits rows.

The logits of a packed unit are split over the tensor-parallel ranks along the
vocabulary (``[n, V / tp]``); Megatron's ``vocab_parallel_cross_entropy`` and the
entropy below reduce over that split, so every TP rank gets the full-vocabulary values.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from megatron_branch._megatron import reduce_from_tensor_model_parallel_region, vocab_parallel_cross_entropy
from megatron_branch.layout import ParallelLayout


def vocab_parallel_entropy(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` for vocab-parallel logits ``[..., V / tp]`` (float32)."""
    logits = logits.float()
    local_max = logits.max(dim=-1, keepdim=True).values.detach()
    tp_group = ParallelLayout.current().group("tp")
    if tp_group is not None:
        torch.distributed.all_reduce(local_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        reduce = reduce_from_tensor_model_parallel_region
    else:
        reduce = lambda x: x  # noqa: E731
    shifted = logits - local_max
    exp = shifted.exp()
    z = reduce(exp.sum(-1))
    ez = reduce((exp * shifted).sum(-1))
    return z.log() - ez / z


def _first_children(rows: Tensor, n: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Split children by their logits row: ``first [n]`` (row ``i``'s first child, or -1
    for a row with none), ``rest [e]`` (the other children: a branch point's second child
    on) and ``order [m]``, where child ``c`` is entry ``order[c]`` of ``[first rows,
    rest]``."""
    m = rows.numel()
    sorted_rows, by_row = torch.sort(rows, stable=True)
    head = torch.ones(m, dtype=torch.bool, device=rows.device)
    head[1:] = sorted_rows[1:] != sorted_rows[:-1]
    first = torch.full((n,), -1, dtype=torch.long, device=rows.device)
    first[sorted_rows[head]] = by_row[head]
    rest = by_row[~head]
    order = torch.empty(m, dtype=torch.long, device=rows.device)
    order[by_row[head]] = sorted_rows[head]
    order[rest] = torch.arange(n, n + rest.numel(), device=rows.device)
    return first, rest, order


def child_logprobs(
    logits: Tensor, rows: Tensor, targets: Tensor, entropy: bool = False, temperatures: Optional[Tensor] = None,
    consume: bool = False, row_children: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """``log_softmax(logits[rows] / T)[targets]`` (vocab-parallel) for each temperature, and
    optionally the entropy of ``softmax(logits[rows] / T)``.

    Every logits row is scored against its first child's target as it stands; only the
    further children of branch points gather their parent's row (a tree has few), so no
    ``[m, V / tp]`` copy of the logits (the largest activation at a real vocabulary) and
    no scatter-add backward is made. A row without a child is scored against token 0 and
    dropped (zero gradient).

    Args:
        logits: ``[n, V / tp]``; modified only with ``consume``.
        rows: ``[m]`` row of each child's parent in ``logits`` (a branch point repeats).
        targets: ``[m]`` token id of each child.
        temperatures: ``[k]`` distinct temperatures (``None``: one column at 1.0, no division).
        consume: this is the caller's last read of ``logits``, so Megatron's in-place
            cross-entropy may overwrite them (as Megatron's own loss does with the model's
            logits) instead of a copy.
        row_children: ``[n]`` the child of each logits row, when every row has exactly one
            (``rows`` is then a permutation and this its inverse: no sort to find them).

    Returns:
        ``(lp [m, k], ent [m, k] or None)``, float32: column ``j`` at ``temperatures[j]``.
    """
    if row_children is not None:
        first, rest, order = row_children, rows[:0], rows
    else:
        first, rest, order = _first_children(rows, logits.shape[0])
    row_targets = torch.where(first >= 0, targets[first.clamp(min=0)], torch.zeros_like(first))
    parts = [(logits, row_targets)]
    if rest.numel():  # (an empty gather would still give the logits a full-size zero gradient)
        parts.append((logits.index_select(0, rows[rest]), targets[rest]))
    values = [1.0] if temperatures is None else [float(t) for t in temperatures]
    lps, ents = [], []
    for t in values:
        lp_t, ent_t = [], []
        for part, part_targets in parts:
            base = part.float()
            # Megatron's cross-entropy works in place on a float32 input: on a fresh float
            # copy, or on a tensor of ours (a gather, or consumed logits) no later column reads
            fresh = base is not part
            ours = part is not logits or consume
            scaled = base / t if t != 1.0 else (base if fresh or (ours and len(values) == 1) else base.clone())
            if entropy:
                ent_t.append(vocab_parallel_entropy(scaled))  # before the in-place CE
            # vocab_parallel_cross_entropy: [s, b, V/tp], [s, b] -> [s, b]
            lp_t.append(-vocab_parallel_cross_entropy(scaled.unsqueeze(1), part_targets.unsqueeze(1)).squeeze(1))
        lps.append(torch.cat(lp_t).index_select(0, order))
        if entropy:
            ents.append(torch.cat(ent_t).index_select(0, order))
    return torch.stack(lps, dim=1), (torch.stack(ents, dim=1) if entropy else None)
