"""Branch replay inside Megatron's pipeline schedules (``get_forward_backward_func``).

A packed tree is one micro-batch like any other: :func:`make_forward_step` returns the
``forward_step_func`` the schedules call; the last stage scores the tree and applies the
user's loss. Megatron-LM's ``pretrain`` takes the same function.

    losses = forward_backward(model, trees, loss_fn)   # wraps get_forward_backward_func()

The loss function returns ``(loss, 1, {"loss": ...})``: Megatron divides by the number of
micro-batches unless ``config.calculate_per_token_loss`` is set; set it when the loss is
normalised by global counts (:mod:`megatron_branch.losses`) and the micro-batch losses
must add up. Variable tree sizes need ``config.variable_seq_lengths=True``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from megatron_branch.cpu import cuda_factories_on_cpu
from megatron_branch.packed_seq import BranchPackedSeqParams
from megatron_branch.scoring import check_model, model_device, per_rollout, unique_token_logprobs, unwrap
from megatron_branch.tree import BranchTree

LossFn = Callable[[Tensor, Tensor], Tensor]


def _params(tree: BranchTree, model) -> BranchPackedSeqParams:
    config = unwrap(model).config
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return BranchPackedSeqParams.for_unit(tree, 0, tree.unique_positions, model_device(model), multiple=multiple)


def padded_length(tree: BranchTree, model) -> int:
    """The sequence length the schedules communicate for ``tree`` (``seq_length``)."""
    return _params(tree, model).total


def forward_backward(model, trees: Sequence[BranchTree], loss_fn: LossFn, forward_only: bool = False):
    """Run Megatron's schedule (``get_forward_backward_func``) over ``trees``, one tree per
    micro-batch. Returns the schedule's per-micro-batch loss dicts (last stage).

    On a CPU-only machine the schedule runs inside
    :func:`megatron_branch.cpu.cuda_factories_on_cpu` (it allocates with ``device="cuda"``).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    trees = list(trees)
    if len({t.unique_positions for t in trees}) > 1 and not unwrap(model).config.variable_seq_lengths:
        raise ValueError("trees: sizes differ; set config.variable_seq_lengths=True")
    with cuda_factories_on_cpu():
        return get_forward_backward_func()(
            forward_step_func=make_forward_step(loss_fn), data_iterator=iter(trees), model=[model],
            num_microbatches=len(trees), seq_length=padded_length(trees[0], model), micro_batch_size=1,
            forward_only=forward_only,
        )


def make_forward_step(loss_fn: LossFn):
    """A ``forward_step_func(data_iterator, model)`` whose iterator yields :class:`BranchTree`.

    Args:
        loss_fn: ``(lp [R, max_len - 1], rollout_ids [R]) -> scalar`` for one tree.
    """

    def forward_step(data_iterator, model):
        tree = next(data_iterator)
        check_model(model, tree)
        params = _params(tree, model)
        device = model_device(model)
        pad = params.total - params.num_real
        ids = torch.cat([tree.tokens, torch.zeros(pad, dtype=torch.long)]).to(device)
        output = model(ids.unsqueeze(0), params.positions.unsqueeze(0), attention_mask=None,
                       packed_seq_params=params)

        def loss_func(output_tensor: Tensor):
            # [1, n, V/tp] on the last stage
            lp, _ = unique_token_logprobs(output_tensor[0], tree)
            loss = loss_fn(per_rollout(lp, tree), torch.arange(tree.num_rollouts))
            return loss, torch.tensor(1, dtype=torch.int), {"loss": loss.detach()}

        return output, loss_func

    return forward_step
