"""One training iteration on Megatron's machinery, as Megatron-LM's ``train_step`` runs it.

1. zero DDP's grad buffers and the optimizer;
2. forward/backward over the rank's micro-batches: Megatron's schedule
   (``get_forward_backward_func``, any pipeline layout) with one tree per micro-batch, or
   streaming replay per micro-batch (``max_chunk_tokens``, no pipeline) with DDP's
   reduction held until the step's final backward;
3. Megatron's ``finalize_model_grads`` (DP x CP bucket reduction, sequence-parallel and
   qk-norm gradients over TP, tied embeddings over PP, division by the global token
   count of ``calculate_per_token_loss``);
4. the Megatron optimizer's ``step`` (gradient clipping, bf16 main parameters, the
   distributed optimizer's sharded update and parameter all-gather).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_branch._megatron import finalize_model_grads
from megatron_branch.cpu import cuda_factories_on_cpu
from megatron_branch.layout import ParallelLayout
from megatron_branch.losses import batch_part
from megatron_branch.model import as_chunks, is_megatron_ddp, model_device, unwrap
from megatron_branch.replay.step import replay_step, split_loss
from megatron_branch.scoring.temperature import micro_batch_temperatures
from megatron_branch.spec.moe import routers
from megatron_branch.spec.moe.routing_replay import moe_layer_columns
from megatron_branch.training.ddp import zero_grads
from megatron_branch.training.optimizer import check_optimizer, optimizer_step
from megatron_branch.training.runtime_check import ExactnessCheck, sample_rollouts
from megatron_branch.training.schedule import (
    LossFn,
    MicroBatch,
    as_micro_batch,
    forward_backward,
    micro_batch_routing,
    token_count,
)


@dataclass
class StepResult:
    """What one training iteration did (this rank's view).

    Attributes:
        loss_sum: the sum of ``loss_fn``'s losses over this rank's micro-batches (last stage).
        num_tokens: the global token count Megatron normalised by.
        grad_norm: the optimizer's gradient norm (before clipping).
        update_successful: False when a loss scaler skipped the step.
        num_microbatches: micro-batches this rank ran.
        max_logprob_diff: the run-time exactness check's result when this step was checked
            (:class:`~megatron_branch.training.runtime_check.ExactnessCheck`), else ``None``.
    """

    loss_sum: float
    num_tokens: int
    grad_norm: Optional[float]
    update_successful: bool
    num_microbatches: int
    max_logprob_diff: Optional[float] = None


def configure(model, optimizer=None) -> None:
    """Point the model config's hooks at Megatron's machinery, as Megatron-LM's ``setup``
    does: ``no_sync_func`` (DDP), ``finalize_model_grads_func`` and, for fp16 loss
    scaling, ``grad_scale_func``. Hooks already set are left alone."""
    chunks = as_chunks(model)
    config = unwrap(chunks[0]).config
    if all(is_megatron_ddp(c) for c in chunks):
        if config.no_sync_func is None:
            config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        if config.finalize_model_grads_func is None:
            config.finalize_model_grads_func = finalize_model_grads
    if optimizer is not None and config.grad_scale_func is None:
        config.grad_scale_func = optimizer.scale_loss


def forward_backward_step(
    model,
    data: Sequence[MicroBatch],
    loss_fn: LossFn,
    *,
    max_chunk_tokens: Optional[int] = None,
    prefix_grad: str = "exact",
    recompute_stem: bool = False,
    cp_comm_type: str = "allgather",
    forward_step_func=None,
    temperature=None,
    routing=None,
) -> Tuple[float, int]:
    """Steps 1-3 of an iteration: zero the grad buffers, forward/backward every micro-batch,
    ``finalize_model_grads``. Afterwards every rank's ``main_grad`` holds the batch gradient
    (its distributed-optimizer shard, with ``use_distributed_optimizer``).

    Args:
        model: a Megatron-DDP-wrapped chunk or Megatron's list of chunks.
        data: this data-parallel rank's micro-batches (``plan_data_parallel(...).ranks[dp_rank]``).
        loss_fn: ``(lp [r, width], rollout_ids [r]) -> (loss_sum, num_tokens)``; the
            config must have ``calculate_per_token_loss=True``.
        max_chunk_tokens: streaming replay budget per forward (pipeline size 1 only);
            ``None`` runs each micro-batch in one pass through Megatron's schedule.
        prefix_grad, recompute_stem, cp_comm_type: as for :func:`megatron_branch.replay_step`.
        forward_step_func: a different Megatron forward step for the schedule (the naive
            truth, :func:`megatron_branch.reference.naive.make_naive_forward_step`).
        temperature: the sampling temperature, one number or one per rollout of the global
            batch (log-probs of ``softmax(logits / T)``).
        routing: rollout routing replay (MoE): per rollout of the global batch, the
            ``[len_r, moe_layers, topk]`` experts the engine chose (or one
            ``[R, >= max_len, moe_layers, topk]`` tensor); every micro-batch's is checked
            before any work (:func:`megatron_branch.spec.moe.routing_replay.tree_routing`).

    Returns:
        ``(loss_sum, global_num_tokens)``: this rank's summed loss (last pipeline stage)
        and the token count Megatron divided the gradients by.

    Raises:
        ValueError: a chunk not wrapped in Megatron's DDP, ``calculate_per_token_loss``
            off, or streaming with pipeline parallelism.
    """
    chunks = as_chunks(model)
    for c in chunks:
        if not is_megatron_ddp(c):
            raise ValueError("model: training needs chunks wrapped in Megatron's DistributedDataParallel "
                             "(megatron_branch.training.wrap_ddp)")
    config = unwrap(chunks[0]).config
    if not config.calculate_per_token_loss:
        raise ValueError("calculate_per_token_loss: set TransformerConfig(calculate_per_token_loss=True) "
                         "so Megatron normalises by the global token count")
    configure(chunks)
    items = [as_micro_batch(x) for x in data]
    if not items:
        raise ValueError("data: this rank has no micro-batches")
    streaming = max_chunk_tokens is not None or prefix_grad != "exact" or recompute_stem
    replayed = None
    if routing is not None:  # every micro-batch's checked before any work
        columns = moe_layer_columns([r for c in chunks for r in routers(c)])
        replayed = [micro_batch_routing(chunks[0], item, routing, columns) for item in items]
    zero_grads(chunks)
    if not streaming:
        box = {}
        finalize = config.finalize_model_grads_func

        def finalize_and_keep(model_chunks, num_tokens, **kwargs):
            finalize(model_chunks, num_tokens, **kwargs)  # all-reduces num_tokens in place
            box["tokens"] = None if num_tokens is None else int(num_tokens)

        config.finalize_model_grads_func = finalize_and_keep
        try:
            out = forward_backward(chunks, items, loss_fn, forward_step_func=forward_step_func,
                                   cp_comm_type=cp_comm_type, temperature=temperature, routing=routing)
        finally:
            config.finalize_model_grads_func = finalize
        loss_sum = float(sum(float(d["lm loss"][0]) for d in out)) if out else 0.0
        return loss_sum, int(box["tokens"]) if box.get("tokens") is not None else -1
    if len(chunks) > 1 or ParallelLayout.current().pp > 1:
        raise ValueError("max_chunk_tokens: streaming replay runs without pipeline parallelism; "
                         "with pipeline stages use one pass per micro-batch")
    return _streaming(chunks[0], items, loss_fn, config, max_chunk_tokens=max_chunk_tokens,
                      prefix_grad=prefix_grad, recompute_stem=recompute_stem, cp_comm_type=cp_comm_type,
                      temperature=temperature, routing=replayed)


def train_step(model, optimizer, data: Sequence[MicroBatch], loss_fn: LossFn, *,
               verify: Optional[ExactnessCheck] = None, **replay) -> StepResult:
    """One optimizer step over this rank's micro-batches: :func:`forward_backward_step`
    then the Megatron optimizer's ``step`` (``optimizer.zero_grad`` first).

    Args:
        model, data, loss_fn, **replay: as for :func:`forward_backward_step`.
        optimizer: from :func:`megatron_branch.training.get_optimizer`.
        verify: a run-time exactness check (``ExactnessCheck(every=N, tolerance=...)``):
            on its due steps, before the update, a few rollouts of the first micro-batch
            are recomputed the plain way and the largest log-prob difference goes to
            :attr:`StepResult.max_logprob_diff` (raises above its tolerance).

    Raises:
        ValueError: as :func:`forward_backward_step`, a non-Megatron optimizer, or
            ``verify`` with pipeline parallelism.
        ExactnessError: the run-time check found a difference above its tolerance.
    """
    check_optimizer(optimizer)
    configure(model, optimizer)
    optimizer.zero_grad()
    diff = None
    if verify is not None and verify.due():
        diff = _verify(model, data, verify, replay.get("temperature"))
    loss_sum, tokens = forward_backward_step(model, data, loss_fn, **replay)
    ok, grad_norm, _ = optimizer_step(optimizer)
    return StepResult(loss_sum, tokens, grad_norm, bool(ok), len(data), diff)


def _verify(model, data, check: ExactnessCheck, temperature) -> float:
    chunks = as_chunks(model)
    if len(chunks) > 1 or ParallelLayout.current().pp > 1:
        raise ValueError("verify_every: the run-time exactness check runs without pipeline parallelism")
    item = as_micro_batch(data[0])
    picked = sample_rollouts(item.tree, check.rollouts)
    temps = micro_batch_temperatures(temperature, item.rollouts, item.batch_size)
    return check.run(chunks[0], [item.tree.sequence(r) for r in picked],
                     temps.values[temps.column[torch.tensor(picked, dtype=torch.long)]])


def _streaming(model, items: List, loss_fn: LossFn, config, temperature=None, routing=None, **replay) -> tuple:
    """Streaming replay per micro-batch; DDP reduces in the last micro-batch's final backward."""
    cp_rank = ParallelLayout.current().cp_rank
    device = model_device(model)
    total = torch.zeros([], dtype=torch.int, device=device)  # Megatron all-reduces it in finalize
    loss_sum = 0.0
    scale = config.grad_scale_func
    for i, item in enumerate(items):

        def chunk_loss(lp, ids, item=item):
            with batch_part(len(ids), item.global_rollouts):  # a micro-batch is part of the global batch
                loss, count = split_loss(loss_fn(item.pad(lp), item.rollouts[ids]))
            if count is None:
                raise ValueError("loss_fn: must return (loss_sum, num_tokens) for training")
            return (scale(loss) if scale is not None else loss), count

        last = i == len(items) - 1
        ctx = contextlib.nullcontext() if last else model.no_sync()
        mask = None if item.score_mask is None else item.score_mask[:, : max(item.tree.max_len - 1, 0)]
        with ctx:
            temps = micro_batch_temperatures(temperature, item.rollouts, item.batch_size)
            stats = replay_step(model, item.tree, chunk_loss, score_mask=mask,
                                temperature=temps.values[temps.column],
                                routing=None if routing is None else routing[i], **replay)
        total += token_count(stats.num_tokens, cp_rank, device)
        loss_sum += stats.loss
    finalize = config.finalize_model_grads_func or finalize_model_grads
    with cuda_factories_on_cpu():
        finalize([model], total)
    return loss_sum, int(total)
