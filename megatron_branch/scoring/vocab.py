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


def child_logprobs(
    logits: Tensor, rows: Tensor, targets: Tensor, entropy: bool = False, temperatures: Optional[Tensor] = None
) -> Tuple[Tensor, Optional[Tensor]]:
    """``log_softmax(logits[rows] / T)[targets]`` (vocab-parallel) for each temperature, and
    optionally the entropy of ``softmax(logits[rows] / T)``.

    Args:
        logits: ``[n, V / tp]``.
        rows: ``[m]`` row of each child's parent in ``logits`` (a branch point repeats).
        targets: ``[m]`` token id of each child.
        temperatures: ``[k]`` distinct temperatures (``None``: one column at 1.0, no division).

    Returns:
        ``(lp [m, k], ent [m, k] or None)``, float32: column ``j`` at ``temperatures[j]``.
    """
    picked = logits.index_select(0, rows)  # [m, V/tp]
    values = [1.0] if temperatures is None else [float(t) for t in temperatures]
    lps, ents = [], []
    for t in values:
        # Megatron's cross-entropy works in place on a float32 input: one copy per column
        scaled = picked.float() / t if t != 1.0 else (picked.float().clone() if len(values) > 1 else picked.float())
        if entropy:
            ents.append(vocab_parallel_entropy(scaled))  # before the in-place CE
        # vocab_parallel_cross_entropy: [s, b, V/tp], [s, b] -> [s, b]
        lps.append(-vocab_parallel_cross_entropy(scaled.unsqueeze(1), targets.unsqueeze(1)).squeeze(1))
    return torch.stack(lps, dim=1), (torch.stack(ents, dim=1) if entropy else None)
