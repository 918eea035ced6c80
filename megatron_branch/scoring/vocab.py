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
    logits: Tensor, rows: Tensor, targets: Tensor, entropy: bool = False
) -> Tuple[Tensor, Optional[Tensor]]:
    """``log_softmax(logits[rows])[targets]`` (vocab-parallel), and optionally the entropy.

    Args:
        logits: ``[n, V / tp]``.
        rows: ``[m]`` row of each child's parent in ``logits`` (a branch point repeats).
        targets: ``[m]`` token id of each child.

    Returns:
        ``(lp [m], ent [m] or None)``, float32.
    """
    picked = logits.index_select(0, rows)  # [m, V/tp]
    ent = vocab_parallel_entropy(picked) if entropy else None  # before the in-place CE
    # vocab_parallel_cross_entropy: [s, b, V/tp], [s, b] -> [s, b]
    nll = vocab_parallel_cross_entropy(picked.float().unsqueeze(1), targets.unsqueeze(1)).squeeze(1)
    return -nll, ent
