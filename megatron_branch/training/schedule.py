"""Branch replay inside Megatron's schedules (``get_forward_backward_func``).

A packed tree (or a :class:`~megatron_branch.training.batching.TreeMicroBatch`, whole
groups of a global batch) is one micro-batch like any other: :func:`make_forward_step`
returns the ``forward_step_func`` the schedules call, for every pipeline stage, with
context parallelism (each CP rank runs its work-balanced shard of the tree) and tensor
parallelism. Megatron-LM's ``pretrain`` takes the same function.

Loss convention (Megatron's ``calculate_per_token_loss=True``): ``loss_fn(lp, ids)``
returns ``(loss_sum, num_tokens)`` — e.g. ``ppo_policy_loss(..., global_tokens=1.0)[0]``
and ``mask.sum()`` — and Megatron divides the accumulated gradients by the global token
count in ``finalize_model_grads``. Micro-batches are whole trees of unequal size, so the
default per-micro-batch mean would weight tokens differently from one big batch; it is
refused rather than silently different.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from megatron_branch._megatron import get_forward_backward_func
from megatron_branch.cpu import cuda_factories_on_cpu
from megatron_branch.layout import ParallelLayout
from megatron_branch.losses import batch_part
from megatron_branch.model import HOST, as_chunks, unwrap
from megatron_branch.scoring.checks import check_model
from megatron_branch.scoring.logprobs import per_rollout
from megatron_branch.scoring.output_rows import scored_tokens, select_output_rows
from megatron_branch.scoring.temperature import Temperature, micro_batch_temperatures
from megatron_branch.scoring.unit import ChildIndex, UnitRows, prepare_unit, score_unit, unit_multiple
from megatron_branch.spec.moe import routers
from megatron_branch.spec.moe.routing_replay import Routing, TreeRouting, moe_layer_columns, tree_routing
from megatron_branch.training.batching import TreeMicroBatch
from megatron_branch.tree import BranchTree

LossFn = Callable[[Tensor, Tensor], Union[Tensor, Tuple[Tensor, Tensor]]]
MicroBatch = Union[BranchTree, TreeMicroBatch]


def as_micro_batch(item: MicroBatch) -> TreeMicroBatch:
    if isinstance(item, TreeMicroBatch):
        return item
    if isinstance(item, BranchTree):
        return TreeMicroBatch.of(item)
    raise ValueError(f"data: expected BranchTree or TreeMicroBatch items, got {type(item).__name__}")


def padded_length(tree: BranchTree, model) -> int:
    """The packed length the schedules see for ``tree`` (SP padding included)."""
    multiple = unit_multiple(unwrap(model).config)
    return -(-tree.unique_positions // multiple) * multiple


def token_count(count, cp_rank: int, device) -> Tensor:
    """Megatron's per-micro-batch token count: an int tensor on the model's ``device``
    (Megatron all-reduces it in ``finalize_model_grads``; NCCL needs it on the GPU),
    reported by CP rank 0 only (every CP rank computes the whole tree's loss; Megatron sums
    counts over DP x CP)."""
    value = float(count)
    if value != round(value):
        raise ValueError(f"loss_fn: num_tokens must be an integer count, got {value}")
    return torch.tensor(int(round(value)) if cp_rank == 0 else 0, dtype=torch.int, device=device)


def report(loss: Tensor, tokens: Tensor) -> Tensor:
    """The ``[loss_sum, num_tokens]`` pair Megatron-LM's ``train_step`` averages over the
    global token count (its per-token loss reporting)."""
    return torch.stack([loss.detach().float().reshape(()), tokens.float().reshape(())])


def forward_backward(
    model,
    data: Sequence[MicroBatch],
    loss_fn: LossFn,
    forward_only: bool = False,
    *,
    forward_step_func: Optional[Callable] = None,
    cp_comm_type: str = "allgather",
    temperature: Optional[Temperature] = None,
    routing: Optional[Routing] = None,
):
    """Run Megatron's schedule (``get_forward_backward_func``) over ``data``, one tree per
    micro-batch. Returns the schedule's per-micro-batch dicts (last pipeline stage).

    Args:
        model: a model chunk or Megatron's list of chunks (possibly DDP-wrapped). The
            config's ``no_sync_func``/``finalize_model_grads_func`` are used as set
            (:func:`megatron_branch.training.train_step` sets Megatron's).
        data: :class:`BranchTree` or :class:`TreeMicroBatch` micro-batches.
        loss_fn: ``(lp [r, width], rollout_ids [r]) -> (loss_sum, num_tokens)``; a bare
            scalar is accepted only with ``forward_only``.
        forward_only: no backward (e.g. to collect log-probs).
        forward_step_func: replaces :func:`make_forward_step` (e.g. the naive truth,
            :func:`megatron_branch.reference.naive.make_naive_forward_step`).
        cp_comm_type: context-parallel K/V exchange.
        temperature: the sampling temperature, one number or one per rollout of the global
            batch (:mod:`megatron_branch.scoring.temperature`).
        routing: rollout routing replay (MoE): per rollout of the global batch
            ``[len_r, moe_layers, topk]`` experts (or one ``[R, >= max_len, moe_layers,
            topk]`` tensor); every micro-batch's is checked before the schedule runs
            (:func:`megatron_branch.spec.moe.routing_replay.tree_routing`).

    Returns:
        One dict per micro-batch: ``{"lm loss": [loss_sum, num_tokens]}`` (a bare loss
        with ``forward_only`` scalar losses), as Megatron-LM's ``train_step`` reports it.

    On a CPU-only machine the schedule runs inside
    :func:`megatron_branch.cpu.cuda_factories_on_cpu` (it allocates with ``device="cuda"``).
    """
    chunks = as_chunks(model)
    items = [as_micro_batch(x) for x in data]
    if not items:
        raise ValueError("data: no micro-batches")
    config = unwrap(chunks[0]).config
    if not forward_only and not config.calculate_per_token_loss:
        raise ValueError(
            "calculate_per_token_loss: set TransformerConfig(calculate_per_token_loss=True); "
            "branch-replay micro-batches are whole trees of unequal size and Megatron's "
            "per-micro-batch mean would weight their tokens differently from one batch"
        )
    sizes = {padded_length(x.tree, chunks[0]) for x in items}
    if len(sizes) > 1 and config.pipeline_model_parallel_size > 1 and not config.variable_seq_lengths:
        raise ValueError("data: micro-batch trees differ in size; set config.variable_seq_lengths=True")
    columns = None
    if routing is not None:  # checked before any work; the layer columns are a collective under PP
        columns = moe_layer_columns([r for c in chunks for r in routers(c)])
        for item in items:
            micro_batch_routing(chunks[0], item, routing, columns)
    step = forward_step_func or make_forward_step(loss_fn, forward_only, cp_comm_type, temperature, routing,
                                                  routing_columns=columns)
    with cuda_factories_on_cpu():
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(items),
            model=chunks, num_microbatches=len(items), seq_length=max(sizes), micro_batch_size=1,
            forward_only=forward_only,
        )


def micro_batch_routing(model, item: TreeMicroBatch, routing: Optional[Routing],
                        columns: Optional[Dict[int, int]] = None) -> Optional[TreeRouting]:
    """The replayed experts of one micro-batch's tree, from the global batch's ``routing``
    (per rollout, or one padded ``[R, S, moe_layers, topk]`` tensor); errors name the
    rollouts by their index in the global batch."""
    if routing is None:
        return None
    ids = item.rollouts.to(HOST)
    part = routing[ids] if isinstance(routing, Tensor) and routing.dim() == 4 else [routing[int(r)] for r in ids]
    return tree_routing(item.tree, part, routers(model), rollout_ids=ids.tolist(), columns=columns,
                        config=unwrap(model).config)


def make_forward_step(loss_fn: LossFn, forward_only: bool = False, cp_comm_type: str = "allgather",
                      temperature: Optional[Temperature] = None, routing: Optional[Routing] = None, *,
                      routing_columns: Optional[Dict[int, int]] = None):
    """A ``forward_step_func(data_iterator, model)`` whose iterator yields trees or
    :class:`TreeMicroBatch`.

    Args:
        loss_fn: ``(lp [r, width], rollout_ids [r]) -> (loss_sum, num_tokens)`` for one
            micro-batch (``rollout_ids`` index the global batch); see the module docstring.
        forward_only: accept bare scalar losses (no gradient is taken).
        cp_comm_type: context-parallel K/V exchange.
        temperature: the sampling temperature, one number or one per rollout of the global batch.
        routing: rollout routing replay, per rollout of the global batch (as for
            :func:`forward_backward`).
        routing_columns: the model's MoE layer columns
            (:func:`~megatron_branch.spec.moe.routing_replay.moe_layer_columns`, a
            collective under pipeline parallelism: compute them before the schedule).
    """
    if routing is not None and routing_columns is None and ParallelLayout.current().pp > 1:
        raise ValueError("routing: under pipeline parallelism pass routing_columns=moe_layer_columns(...) "
                         "computed on every stage before the schedule (or use forward_backward)")

    def forward_step(data_iterator, model):
        item = as_micro_batch(next(data_iterator))
        tree = item.tree
        check_model(model, tree)
        temps = micro_batch_temperatures(temperature, item.rollouts, item.batch_size)
        n = tree.unique_positions
        replayed = micro_batch_routing(model, item, routing, routing_columns)
        params, ids = prepare_unit(model, tree, 0, n, cp_comm_type=cp_comm_type, routing=replayed)
        children = ChildIndex(tree)
        scored = None if item.score_mask is None else scored_tokens(tree, item.score_mask[:, : tree.max_len - 1])
        rows = UnitRows(tree, 0, n, params, children, scored)
        with select_output_rows(model, rows.rows):
            output = model(ids.unsqueeze(0), params.positions.unsqueeze(0), attention_mask=None,
                           packed_seq_params=params)

        def loss_func(output_tensor: Tensor):
            # [1, m, V/tp] on the last stage: the scored tokens' parents, one row each
            idx, lp_child, _ = score_unit(output_tensor.squeeze(0), tree, 0, n, params, children, unit_rows=rows,
                                          scored=scored, temperatures=None if temps.is_one else temps.values,
                                          consume_logits=True)  # Megatron's loss_func owns output_tensor
            lp = lp_child.new_zeros(n, temps.count).index_put((idx.to(lp_child.device),), lp_child)
            ids_r = torch.arange(tree.num_rollouts, device=HOST)  # indexes the host rollout ids
            with batch_part(tree.num_rollouts, item.global_rollouts):  # a micro-batch of the global batch
                out = loss_fn(item.pad(per_rollout(lp, tree, column=temps.column)), item.rollouts[ids_r])
            loss, count = (out[0], out[1]) if isinstance(out, (tuple, list)) else (out, None)
            if count is None:
                if not forward_only:
                    raise ValueError("loss_fn: must return (loss_sum, num_tokens) for training")
                return loss, {"lm loss": loss.detach().float().reshape(1)}
            cp_rank = ParallelLayout.current().cp_rank
            tokens = token_count(count, cp_rank, lp.device)
            return loss, tokens, {"lm loss": report(loss, tokens)}

        return output, loss_func

    return forward_step
