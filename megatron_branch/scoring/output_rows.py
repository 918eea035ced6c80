"""Logits only where a loss reads them.

A packed tree's log-probs need the logits of the *parents* of the scored tokens only:
never of a leaf (a rollout's last token predicts nothing), and not of prompt tokens a
loss masks out. At the headline shape (a 131,072-token prompt, a 128K vocabulary) the
unread prompt logits alone would be ~34 GB in bf16. :func:`output_rows` selects hidden
rows right before Megatron's own output layer (``GPTModel.output_layer``, a
``ColumnParallelLinear``), so the vocabulary projection, its softmax and its memory scale
with the rows scored. Megatron 0.19's inference path does the same selection for its
last-token logits; here it also carries the backward.

Under sequence parallelism the output layer's input is split over the tensor-parallel
ranks; the rows are gathered first (whose backward only splits, since the output layer
then all-reduces its input gradient, as it does without sequence parallelism).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

from megatron_branch._megatron import gather_from_sequence_parallel_region
from megatron_branch.model import HOST, unwrap


@contextlib.contextmanager
def select_output_rows(model, rows: Tensor) -> Iterator[None]:
    """Inside, the model's output layer sees only the hidden rows ``rows`` (this rank's
    sequence positions, before any sequence-parallel split), so the model returns logits
    ``[b, len(rows), V / tp]``. A no-op on pipeline stages without the output layer.

    Args:
        model: a (possibly wrapped) GPTModel.
        rows: ``[m]`` LongTensor of positions in the sequence this rank runs; a position
            may repeat (:class:`~megatron_branch.scoring.unit.UnitRows` gives a branch point
            once per scored child, so each child has its own logits row).
    """
    gpt = unwrap(model)
    layer = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", False) else None
    if layer is None:
        yield
        return
    saved = (layer.sequence_parallel, layer.allreduce_dgrad)
    tp = layer.tp_group.size() if getattr(layer, "tp_group", None) is not None else 1

    def select(module, args, kwargs):
        hidden = args[0]  # [s (or s / tp under SP), b, h]
        if saved[0]:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=module.tp_group)
            module.sequence_parallel, module.allreduce_dgrad = False, tp > 1
        # [s, b, h] -> [m, b, h]
        return (hidden.index_select(0, rows.to(hidden.device)),) + tuple(args[1:]), kwargs

    def restore(module, args, output):
        module.sequence_parallel, module.allreduce_dgrad = saved
        return output

    before = layer.register_forward_pre_hook(select, with_kwargs=True)
    after = layer.register_forward_hook(restore)
    try:
        yield
    finally:
        before.remove()
        after.remove()
        layer.sequence_parallel, layer.allreduce_dgrad = saved


def scored_tokens(tree, score_mask: Tensor) -> Tensor:
    """``[U]`` bool: packed tokens whose log-prob some rollout's loss reads.

    Args:
        tree: the packed tree.
        score_mask: ``[R, max_len - 1]`` (bool or 0/1), ``score_mask[r, t]`` true when the
            loss reads ``lp[r, t]`` (the log-prob of token ``t + 1``), e.g. the response mask.

    Raises:
        ValueError: the mask's shape is not ``[R, max_len - 1]``.
    """
    width = max(tree.max_len - 1, 0)
    if not isinstance(score_mask, Tensor) or tuple(score_mask.shape) != (tree.num_rollouts, width):
        shape = tuple(score_mask.shape) if isinstance(score_mask, Tensor) else type(score_mask).__name__
        raise ValueError(f"score_mask: expected shape [{tree.num_rollouts}, {width}] (rollouts, max_len - 1), "
                         f"got {shape}")
    rows = tree.rows[:, 1:]
    picked = rows[(score_mask.cpu() != 0) & (rows >= 0)]
    needed = torch.zeros(tree.unique_positions, dtype=torch.bool, device=HOST)  # host, like the tree
    needed[picked] = True
    return needed
