"""``replay_step``: a memory-bounded branch-replay forward/backward with a user's loss.

The tree is walked depth first (:mod:`megatron_branch.replay.plan`). A stem unit is
forwarded once and its per-layer K/V cached (:mod:`megatron_branch.attention.path_cache`); its
log-probs are handed to the loss as leaf tensors. Each chunk below it attends to the
cache, evaluates ``loss_fn`` on the rollouts that end in it, and runs its backward at
once, which accumulates parameter gradients, the stem's ``dK/dV`` and the gradients of
the stem's log-probs. When a stem's subtree is done, one backward of the stem feeds in
everything accumulated. The result equals ``loss.backward()`` over all rollouts.

Costs (U = unique positions, S = tokens in stem units):

* ``prefix_grad="exact"``, ``recompute_stem=False``: forward U, backward U; memory holds
  the activations of the stems on the current path plus one chunk. A stem also runs the
  complete subtrees below its chain that fit the budget where that saves a unit
  (:func:`~megatron_branch.replay.plan.plan_replay`'s ``attach_subtrees``).
* ``prefix_grad="exact"``, ``recompute_stem=True``: forward U + S, backward U; memory
  holds only the stems' K/V (2 x kv_heads x head_dim per token per layer) plus one chunk.
* ``prefix_grad="detached"`` (tail-only): forward U, backward U - S; the stem is a
  constant, so its parameters get no gradient through it — cheaper and biased
  (:func:`megatron_branch.reference.bias.prefix_grad_bias` measures how much).

MoE models: a step that forwards the tree in parts with an aux loss on needs the whole
tree's router counts. Where every backward of its plan runs after its last forward (one
trailing chunk below the stems) its own forwards count them and the aux losses read them
at the backward; otherwise it first collects them with one forward-only pass
(:func:`collect_routing_statistics`; :mod:`megatron_branch.replay.routing` decides). Under
expert parallelism the ranks' plans are checked to match first.

The steps themselves are :class:`megatron_branch.replay.replayer.Replayer`'s.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_branch.model import model_device, refresh_fp8_weights, single_chunk
from megatron_branch.peak_memory import PeakMemory
from megatron_branch.replay.fp8 import check_fp8_plan
from megatron_branch.replay.plan import path_capacity, plan_replay, unit_of_rollouts
from megatron_branch.replay.replayer import LossFn, Replayer, split_loss  # noqa: F401 - split_loss re-exported
from megatron_branch.replay.routing import check_expert_parallel_plan, needs_routing_statistics, routed_before_backward
from megatron_branch.scoring.checks import check_model
from megatron_branch.scoring.output_rows import scored_tokens
from megatron_branch.scoring.temperature import Temperature, Temperatures
from megatron_branch.scoring.unit import local_unit_rows
from megatron_branch.spec.moe import RoutingStatistics, collecting_statistics
from megatron_branch.spec.moe import routing_statistics as bound_statistics
from megatron_branch.spec.moe.routing_replay import Routing, tree_routing
from megatron_branch.tree import BranchTree

PrefixGrad = Literal["exact", "detached"]


@dataclass
class ReplayStats:
    """What a replay step did.

    Attributes:
        loss: the step's total loss (sum of ``loss_fn`` over chunks).
        num_chunks: chunk units (forward + loss + backward).
        num_stems: stem units (forwarded once, K/V cached).
        unique_positions: packed tree size ``U``.
        naive_positions: ``sum(len(rollout))``.
        positions_forwarded: token positions run through the model, recompute included.
        positions_recomputed: stem positions forwarded a second time.
        peak_cache_bytes: most K/V bytes held in the prefix cache at once.
        peak_memory_bytes: peak bytes allocated during the step (``measure_memory``).
        prefix_grad: ``"exact"`` or ``"detached"``.
        num_tokens: sum of the counts ``loss_fn`` returned with its losses (``None`` when
            it returned bare scalars): the normaliser of Megatron's per-token loss.
    """

    loss: float
    num_chunks: int
    num_stems: int
    unique_positions: int
    naive_positions: int
    positions_forwarded: int
    positions_recomputed: int
    peak_cache_bytes: int
    peak_memory_bytes: Optional[int]
    prefix_grad: str
    num_tokens: Optional[float] = None


def replay_step(
    model,
    tree: BranchTree,
    loss_fn: LossFn,
    *,
    max_chunk_tokens: Optional[int] = None,
    prefix_grad: PrefixGrad = "exact",
    recompute_stem: bool = False,
    group_ids: Optional[Sequence[int]] = None,
    measure_memory: bool = False,
    cp_comm_type: str = "allgather",
    score_mask: Optional[Tensor] = None,
    routing_statistics: Optional[RoutingStatistics] = None,
    temperature: Optional[Temperature] = None,
    routing: Optional[Routing] = None,
) -> ReplayStats:
    """One branch-replay forward/backward of ``loss_fn`` over the rollouts of ``tree``.

    Args:
        model: a GPTModel built with :func:`get_branch_layer_spec`, possibly wrapped
            (``Float16Module``, Megatron's ``DistributedDataParallel``), or a one-element
            list of such chunks. Under Megatron DDP the gradients accumulate in
            ``main_grad`` and every backward but the last is run under ``no_sync()``, so
            with ``overlap_grad_reduce`` each bucket is reduced once, after its last
            contribution (held entirely when called inside the caller's ``no_sync()``).
        tree: the packed rollouts.
        loss_fn: ``(lp [r, max_len - 1], rollout_ids [r]) -> scalar`` or
            ``-> (loss_sum, num_tokens)``, called once per chunk with the rollouts that end
            in it (``lp`` as from ``rollout_logprobs``). The step's loss is the sum over
            calls, so the loss must be additive over rollouts: normalise by global counts
            (``mb.losses`` ``global_tokens`` / ``global_seqs``), or return sums and counts
            and let Megatron normalise (``calculate_per_token_loss``; see
            :mod:`megatron_branch.training`).
        max_chunk_tokens: most tokens per forward; ``None`` runs one packed pass.
        prefix_grad: ``"exact"`` (gradients equal per-rollout training) or
            ``"detached"`` (tail-only: stems are constants).
        recompute_stem: recompute each stem's forward for its backward instead of
            keeping its activations (exact mode only; trades compute for memory).
        group_ids: ``[R]``; rollouts with equal ids reach ``loss_fn`` together (DPO pairs).
        measure_memory: record ``peak_memory_bytes`` (slower on CPU).
        cp_comm_type: context-parallel K/V exchange (``"allgather"`` or ``"p2p"``); the
            stems' cached K/V stay sharded over the CP ranks.
        score_mask: ``[R, max_len - 1]``, nonzero where ``loss_fn`` reads ``lp`` (e.g. the
            response mask): logits are computed only for those tokens' parents, and the
            other entries of ``lp`` are 0. ``None`` scores every token.
        routing_statistics: MoE models: the whole tree's router counts, if already
            collected (:func:`collect_routing_statistics`, e.g. with the old-policy
            log-probs); otherwise a step that needs them collects them itself.
        temperature: the sampling temperature, one number or one per rollout (log-probs
            of ``softmax(logits / T)``; :mod:`megatron_branch.scoring.temperature`).
        routing: rollout routing replay (MoE): per rollout ``[len_r, moe_layers, topk]``
            experts the engine chose, as for :func:`megatron_branch.rollout_logprobs`;
            every unit's forward (and a recomputed stem's) replays them.

    Returns:
        :class:`ReplayStats`. Parameter ``.grad`` (``main_grad`` under Megatron DDP) hold
        the accumulated gradient, as after ``loss.backward()``. Under ``torch.no_grad()``
        nothing is backpropagated.

    Raises:
        ValueError: the model lacks tree attention, a bad ``prefix_grad`` or budget, a
            ``loss_fn`` that does not return a scalar, groups that cannot fit, or a bad
            ``routing`` (:func:`~megatron_branch.spec.moe.routing_replay.tree_routing`).
    """
    if prefix_grad not in ("exact", "detached"):
        raise ValueError(f"prefix_grad: {prefix_grad!r} is not one of ('exact', 'detached')")
    model = single_chunk(model, "replay_step")
    found = check_model(model, tree)  # and the MoE routers, from the same walk
    replayed = tree_routing(tree, routing, found)  # checked before any work
    refresh_fp8_weights(model)  # an optimizer step may have changed them since the last forward
    temps = Temperatures.of(temperature, tree.num_rollouts)
    exact = prefix_grad == "exact" and torch.is_grad_enabled()
    # A stem may also run complete subtrees below it (one unit fewer) where its graph is kept
    # for its pop anyway; not with recomputed or constant stems.
    attach = exact and not recompute_stem
    ops = plan_replay(tree, max_chunk_tokens, group_ids, attach_subtrees=attach)
    # MoE phase: an aux loss over a tree forwarded in parts needs the whole tree's router
    # counts before the first backward: from the step's own forwards where the plan has
    # no backward before its last forward, else from a forward-only pass first, which
    # forwards the plan without attached subtrees (the step runs the same units, so
    # that its routing sees identical inputs).
    in_step, statistics_pass = None, False
    if routing_statistics is None and needs_routing_statistics(model, ops, found):
        if routed_before_backward(ops):
            routing_statistics = in_step = RoutingStatistics(tree, in_step=True)
        else:
            ops = plan_replay(tree, max_chunk_tokens, group_ids) if attach else ops
            statistics_pass = True
    # every EP rank must run the same units (the statistics pass included)
    check_expert_parallel_plan(model, ops, recompute_stem=recompute_stem, prefix_grad=prefix_grad, found=found)
    check_fp8_plan(model, ops, recompute_stem=recompute_stem)  # and every rank of FP8's amax reduction
    if statistics_pass:
        routing_statistics, _ = collect_routing_statistics(model, tree, max_chunk_tokens=max_chunk_tokens,
                                                           group_ids=group_ids, cp_comm_type=cp_comm_type,
                                                           routing=replayed)
    owners: Dict[int, List[int]] = unit_of_rollouts(tree, ops)
    scored = None if score_mask is None else scored_tokens(tree, score_mask)
    # each CP rank caches only its share of every stem
    capacity = path_capacity(ops, lambda op: local_unit_rows(model, tree, op.start, op.end, op.cached_end))
    run = Replayer(model, tree, loss_fn, exact, recompute_stem, cp_comm_type, capacity, scored, temps, replayed)
    if in_step is not None:
        run.after_last_forward = lambda: in_step.finish(found)
    meter = PeakMemory(run.device) if measure_memory else contextlib.nullcontext()
    collect = collecting_statistics(model, in_step, found) if in_step is not None else contextlib.nullcontext()
    with meter, bound_statistics(model, routing_statistics, found), collect:
        run.run(ops, owners)
    return ReplayStats(
        loss=run.total,
        num_chunks=sum(op.kind == "chunk" for op in ops),
        num_stems=sum(op.kind == "stem" for op in ops),
        unique_positions=tree.unique_positions,
        naive_positions=tree.naive_positions,
        positions_forwarded=run.forwarded,
        positions_recomputed=run.recomputed,
        peak_cache_bytes=run.cache.peak_bytes,
        peak_memory_bytes=meter.peak_bytes if measure_memory else None,
        prefix_grad=prefix_grad,
        num_tokens=run.count,
    )


def replay_logprobs(
    model, tree: BranchTree, *, max_chunk_tokens: Optional[int] = None, score_mask: Optional[Tensor] = None,
    cp_comm_type: str = "allgather", group_ids: Optional[Sequence[int]] = None,
    temperature: Optional[Temperature] = None, routing: Optional[Routing] = None,
) -> Tensor:
    """Forward-only ``[R, max_len - 1]`` log-probs with the same chunking (old/ref policy).

    Runs under ``torch.no_grad()``; memory is bounded like :func:`replay_step`'s.
    ``score_mask``, ``group_ids``, ``temperature`` and ``routing`` as for
    :func:`replay_step` (the same plan as a step with those ``group_ids``; the log-probs
    do not depend on it).
    """
    model = single_chunk(model, "replay_logprobs")
    out = torch.zeros(tree.num_rollouts, max(tree.max_len - 1, 0), dtype=torch.float32, device=model_device(model))

    def collect(lp: Tensor, ids: Tensor) -> Tensor:
        out[ids.to(out.device)] = lp.detach().float()
        return lp.new_zeros(())

    with torch.no_grad():
        replay_step(model, tree, collect, max_chunk_tokens=max_chunk_tokens, score_mask=score_mask,
                    cp_comm_type=cp_comm_type, group_ids=group_ids, temperature=temperature, routing=routing)
    return out


def collect_routing_statistics(model, tree: BranchTree, *, max_chunk_tokens: Optional[int] = None,
                               group_ids: Optional[Sequence[int]] = None,
                               cp_comm_type: str = "allgather",
                               routing: Optional[Routing] = None) -> Tuple[RoutingStatistics, Tensor]:
    """One forward-only pass over ``tree`` that records every MoE layer's router counts.

    Runs :func:`replay_logprobs` (memory-bounded like the step) and sums the counts over
    TP x CP (and DP for the global aux loss): a collective, so every rank of those groups
    calls it. Use the same ``max_chunk_tokens`` and ``group_ids`` as the step (the
    routing then sees bit-identical inputs) and ``routing`` (rollout routing replay: the
    deeper layers' router inputs depend on the replayed experts); :func:`replay_step` does
    this itself.

    Returns:
        ``(statistics, logprobs [R, max_len - 1])``: the log-probs are
        ``replay_logprobs``' (old-policy log-probs when the weights are those of the rollouts).
    """
    stats = RoutingStatistics(tree)
    with collecting_statistics(model, stats) as found:
        lp = replay_logprobs(model, tree, max_chunk_tokens=max_chunk_tokens, group_ids=group_ids,
                             cp_comm_type=cp_comm_type, routing=routing)
    stats.finish(found)
    return stats, lp
