"""Mixture of Experts: exact branch replay through Megatron's MoE layers.

Routing itself is per token, so the tree forward routes every unique position exactly as
the naive batch routes each of its copies. What is *not* per token are the router's batch
statistics: Megatron computes them over the tokens of the micro-batch it is given, and
the tree holds each shared token once where the naive batch holds it once per rollout.
Here every such statistic weights a unique position by its **multiplicity** (the number
of rollouts that contain it, ``BranchTree.multiplicity``), so values, gradients and logs
equal those of the naive batch.

**The naive batch.** All ``R`` rollouts of the tree as one micro-batch through Megatron's
stock spec, each rollout its own sequence, right-padded with Megatron's MoE
``padding_mask`` so padding is not counted (no padding at all when lengths are equal);
``T = sum(len(rollout))`` tokens. Per statistic:

* ``aux_loss`` (switch load balancing, per micro-batch):
  ``c E / (k T^2) sum_e P_e F_e`` with ``P_e = sum_x score(x, e)`` and ``F_e`` the tokens
  whose top-k (of the aux scores) holds ``e``, both over the ``T`` tokens;
* ``seq_aux_loss`` (per sequence = per rollout): Megatron's per-sample loss with
  ``P_e, F_e`` over each rollout's own tokens, averaged over the ``R`` rollouts and
  normalised, as Megatron does with a padding mask, by the mean length ``T / R``:
  ``c E R / (k T^2) sum_r sum_e P_re F_re``;
* ``global_aux_loss``: ``F`` summed over the data-parallel ranks and accumulated into the
  router's running ``global_tokens_per_expert`` once per micro-batch (one tree = one
  micro-batch, however many forwards streaming replay makes);
* ``z_loss``: ``c / T sum_x logsumexp(logits_x)^2``;
* expert-bias token counts (``local_tokens_per_expert``, aux-loss-free balancing) and
  the logged per-expert counts (:func:`tokens_per_expert`): tokens routed to each expert,
  counted in forwards with gradients enabled, as Megatron does;
* Megatron's per-layer loss logging (``load_balancing_loss``, ``seq_load_balancing_loss``,
  ``global_load_balancing_loss``, ``z_loss``) and, under ``calculate_per_token_loss``, its
  token-count scaling of these losses (reproduced for the installed release).

Each is linear in the per-token scores once the (non-differentiable) counts ``F`` are
known, so a forward of any part of the tree contributes its tokens' share and the shares
add up to the naive value. One packed pass (``rollout_logprobs``, ``replay_step`` without
a budget, pipeline micro-batches) computes the counts itself (all-reduced over TP x CP as
Megatron does). Streaming replay forwards and backwards part of the tree before the rest
has been routed, so the aux losses then need the step's counts first:
:func:`replay_step` collects them with one forward-only pass
(:func:`collect_routing_statistics`, which also returns the log-probs, e.g. the
old-policy ones when the weights have not changed) and binds them
(:func:`routing_statistics`). The z-loss and the token counts need no such pass.

Conditions: routing that depends on the whole batch cannot be exact and is refused
(``ValueError``): token dropping (an expert's capacity is a fraction of the micro-batch's
token count; opt in to ``moe_token_dropping="approximate"`` and measure with
:func:`token_dropping_bias`), Sinkhorn and quantile balancing, and the random input
jitter / forced balancing (like dropout). ``MoEAuxLossAutoScaler``'s scale is Megatron's
(1 unless a schedule sets it: branch replay applies the aux coefficient once per tree).

Pieces (spec slots, no patching): :class:`BranchTopKRouter` (the ``router`` slot),
:class:`BranchMoELayer` (the ``mlp`` slot) and :class:`BranchMoETransformerLayer` (the
layer, which hands ``packed_seq_params`` to its MoE layer); :func:`apply_branch_moe` puts
them in a spec, and ``get_branch_layer_spec(num_experts=...)`` does so itself.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from megatron_branch._megatron import (
    MOE_GLOBAL_AUX_LOG_FLAG,
    MOE_PER_TOKEN_SCALE_TIMES_TP_CP,
    MOE_SEQ_AUX_COUNTS_MICRO_BATCH,
    MOE_Z_LOSS_LOG_AVG,
    ModuleSpec,
    MoEAuxLossAutoScaler,
    MoELayer,
    TopKRouter,
    TransformerLayer,
    compute_routing_scores_for_aux_loss,
    record_moe_metric,
    tensor_parallel,
)
from megatron_branch.spec.packed_seq import BranchPackedSeqParams
from megatron_branch.tree import BranchTree

TOKEN_DROPPING = ("refuse", "approximate")
BATCH_ROUTING = ("sinkhorn", "quantile_balancing")
AUX_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


# --------------------------------------------------------------------------- tree sums
class TreeSums:
    """Sums between the tokens ``index`` of one forward and the tree's rollouts.

    Rollout ``r`` contains token ``u`` iff ``u <= end_r <= last[u]`` (DFS preorder), so
    both directions are prefix sums read at positions found by binary search, computed
    once per forward and shared by every layer: ``O((n + R) E)`` per sum, no per-rollout
    gather over the naive positions.

    Args:
        index: ``[n]`` packed indices of the tokens (ascending; ``-1`` = padding, ignored).
        tree: the packed tree.
    """

    def __init__(self, index: Tensor, tree: BranchTree):
        index = index.cpu()
        self.valid = index >= 0
        idx = index[self.valid]
        ends = tree.rows.gather(1, (tree.lengths - 1).clamp(min=0)[:, None])[:, 0]  # [R] last token
        # rollout sums: +values[u] at u, -values[u] at last[u] + 1, read at end_r
        minus = tree.last[idx] + 1
        self.minus_order = torch.argsort(minus)
        self.n_plus = torch.searchsorted(idx.contiguous(), ends, right=True)
        self.n_minus = torch.searchsorted(minus[self.minus_order].contiguous(), ends, right=True)
        # subtree sums: the rollouts ending in [u, last[u]] are a range of the sorted ends
        ends_sorted, self.end_order = torch.sort(ends)
        self.lo = torch.searchsorted(ends_sorted, idx)
        self.hi = torch.searchsorted(ends_sorted, tree.last[idx], right=True)
        self._on = {}

    def _index(self, name: str, device) -> Tensor:
        key = (name, str(device))
        if key not in self._on:
            self._on[key] = getattr(self, name).to(device)
        return self._on[key]

    def per_rollout(self, values: Tensor) -> Tensor:
        """``[R, E]``: each rollout's sum of ``values [n, E]`` over its tokens among ``index``."""
        dev = values.device
        vals = values[self._index("valid", dev)].double()
        zero = vals.new_zeros(1, vals.shape[1])
        plus = torch.cat([zero, vals.cumsum(0)])
        minus = torch.cat([zero, vals[self._index("minus_order", dev)].cumsum(0)])
        return plus[self._index("n_plus", dev)] - minus[self._index("n_minus", dev)]

    def per_token(self, per_rollout: Tensor) -> Tensor:
        """``[n, E]``: for each token, the sum of ``per_rollout [R, E]`` over the rollouts
        that contain it; 0 on padding."""
        dev = per_rollout.device
        cum = torch.cat([per_rollout.new_zeros(1, per_rollout.shape[1], dtype=torch.float64),
                         per_rollout[self._index("end_order", dev)].double().cumsum(0)])
        out = cum.new_zeros(self.valid.numel(), per_rollout.shape[1])
        out[self._index("valid", dev)] = cum[self._index("hi", dev)] - cum[self._index("lo", dev)]
        return out


def rollout_sums(values: Tensor, index: Tensor, tree: BranchTree) -> Tensor:
    """``[R, E]``: for every rollout, the sum of ``values [n, E]`` over its tokens among
    ``index [n]`` (:class:`TreeSums`)."""
    return TreeSums(index, tree).per_rollout(values)


def subtree_rollout_sums(per_rollout: Tensor, index: Tensor, tree: BranchTree) -> Tensor:
    """``[n, E]``: for every token of ``index``, the sum of ``per_rollout [R, E]`` over the
    rollouts that contain it (those ending inside its subtree); 0 on padding."""
    return TreeSums(index, tree).per_token(per_rollout)


# --------------------------------------------------------------------------- per-forward data
@dataclass
class TreeTokens:
    """The tokens one router sees in one forward of a packed unit.

    Attributes:
        tree: the packed tree.
        weights: ``[n]`` multiplicity of each token (rollouts containing it; 0 on padding).
        index: ``[n]`` packed index of each token in ``tree`` (``-1`` on padding).
        complete: the forward holds the whole tree (across the TP x CP ranks): batch
            counts can be computed from it; otherwise they come from a
            :class:`RoutingStatistics`.
    """

    tree: BranchTree
    weights: Tensor
    index: Tensor
    complete: bool
    _sums: Optional[TreeSums] = field(default=None, repr=False)

    @property
    def sums(self) -> TreeSums:
        """Token <-> rollout sums of these tokens (built on first use, shared by all layers)."""
        if self._sums is None:
            self._sums = TreeSums(self.index, self.tree)
        return self._sums

    @property
    def total(self) -> float:
        """``T``: tokens of the naive batch."""
        return float(self.tree.naive_positions)

    @classmethod
    def from_params(cls, params: BranchPackedSeqParams, num_tokens: int, sp_rank: int, sp_size: int,
                    device) -> "TreeTokens":
        """The ``num_tokens`` tokens a router sees on this rank: the rank's part of the unit
        (``params.local``), split again over the TP ranks under sequence parallelism."""
        lo, hi = params.local
        if (hi - lo) != num_tokens * sp_size:
            raise ValueError(f"packed_seq_params: the MoE layer sees {num_tokens} tokens, the unit has "
                             f"{hi - lo} on this rank ({sp_size} sequence-parallel parts)")
        off = sp_rank * num_tokens
        weights = params.multiplicity[off:off + num_tokens].to(device=device, dtype=torch.float32)
        index = params.start + lo + off + torch.arange(num_tokens)
        index[index >= params.start + params.num_real] = -1
        tree = params.tree
        complete = params.start == 0 and params.num_real == tree.unique_positions
        return cls(tree, weights, index, complete)


@dataclass
class _LayerCounts:
    experts: Tensor  # [E] aux top-k counts, weighted, summed over TP x CP
    rollouts: Tensor  # [R, E] the same per rollout
    experts_dp: Optional[Tensor] = None  # [E] also summed over DP (global aux loss)


@dataclass
class RoutingStatistics:
    """One step's router counts per MoE layer, for streaming replay's aux losses.

    Made by :func:`collect_routing_statistics`; bound with :func:`routing_statistics`.
    Valid for the tree and weights it was collected with.
    """

    tree: BranchTree
    layers: Dict[int, _LayerCounts] = field(default_factory=dict)
    _global_added: Set[int] = field(default_factory=set)
    _finished: bool = False

    def add(self, router: "BranchTopKRouter", tokens: TreeTokens, logits: Tensor) -> None:
        with torch.no_grad():
            rmap, _ = compute_routing_scores_for_aux_loss(
                logits.reshape(-1, router.config.num_moe_experts).detach(), router.topk, router.score_function)
            rmap = rmap.double()
            entry = self.layers.get(id(router))
            if entry is None:
                num = router.config.num_moe_experts
                entry = self.layers[id(router)] = _LayerCounts(
                    rmap.new_zeros(num), rmap.new_zeros(self.tree.num_rollouts, num))
            entry.experts += (rmap * tokens.weights.double()[:, None]).sum(0)
            entry.rollouts += tokens.sums.per_rollout(rmap).to(entry.rollouts.device)

    def finish(self, routers: Sequence["BranchTopKRouter"]) -> None:
        """Sum the counts over each router's TP x CP group (and DP for the global aux loss)."""
        for router in routers:
            entry = self.layers.get(id(router))
            if entry is None:
                raise ValueError("collect_routing_statistics: an MoE layer saw no tree tokens")
            if router.get_aux_loss_coeff("global_aux_loss") > 0:
                entry.experts_dp = _all_reduce(entry.experts.clone(), router.tp_dp_cp_group)
            _all_reduce(entry.experts, router.tp_cp_group)
            _all_reduce(entry.rollouts, router.tp_cp_group)
        self._finished = True

    def counts(self, router: "BranchTopKRouter") -> _LayerCounts:
        if not self._finished or id(router) not in self.layers:
            raise ValueError("routing statistics: not collected for this model "
                             "(use megatron_branch.spec.moe.collect_routing_statistics)")
        return self.layers[id(router)]


def _all_reduce(x: Tensor, group) -> Tensor:
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(x, group=group)
    return x


# --------------------------------------------------------------------------- router
class BranchTopKRouter(TopKRouter):
    """Megatron's ``TopKRouter`` whose batch statistics weight tree tokens by multiplicity.

    Routing is the stock code path (``TopKRouter.routing``); in a tree forward the hooks
    it calls for the z-loss, the three aux losses and the expert-bias counts are replaced
    by weighted versions (see the module docstring for each definition). Without tree
    data (ordinary batches) every hook is Megatron's own.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        routing = self.routing_type if isinstance(self.routing_type, list) else [self.routing_type]
        bad = [r for r in routing if r in BATCH_ROUTING]
        if bad:
            raise ValueError(f"moe_router_load_balancing_type={bad[0]!r}: routes each token by a balancing over "
                             "the whole micro-batch, so a tree (unique tokens) routes differently from the naive "
                             "batch; use 'aux_loss', 'seq_aux_loss', 'global_aux_loss' or 'none'")
        if self.config.moe_input_jitter_eps is not None:
            raise ValueError("moe_input_jitter_eps: random router input noise differs between the tree's single "
                             "copy of a shared token and the naive batch's copies (like dropout); set it to None")
        if getattr(self.config, "moe_router_force_load_balancing", False):
            raise ValueError("moe_router_force_load_balancing: random routing (a benchmark mode) cannot be exact")
        self._tree: Optional[TreeTokens] = None
        self._stats: Optional[RoutingStatistics] = None
        self._collect: Optional[RoutingStatistics] = None
        self.tokens_per_expert: Optional[Tensor] = None  # [E] float64, see tokens_per_expert()

    # -- helpers
    def _num_layers(self) -> int:
        return self.config.num_layers + (self.config.mtp_num_layers or 0)

    def _per_token(self, tokens: TreeTokens, tp_cp: int) -> float:
        """Megatron's ``calculate_per_token_loss`` factor of the z-loss: the naive
        micro-batch's token count on this rank (an even split over TP x CP), as the
        installed release scales it."""
        if not self.config.calculate_per_token_loss:
            return 1.0
        return tokens.total / tp_cp * (tp_cp if MOE_PER_TOKEN_SCALE_TIMES_TP_CP else 1)

    def _statistics(self, tokens: TreeTokens) -> _LayerCounts:
        stats = self._stats
        if stats is None:
            raise ValueError(
                "moe aux loss: this forward holds part of the tree (streaming replay), and the aux loss needs "
                "the whole tree's expert counts; use megatron_branch.spec.moe.replay_step (one extra forward-only "
                "pass), or collect_routing_statistics + routing_statistics")
        if stats.tree is not tokens.tree:
            raise ValueError("routing statistics: collected for another tree")
        return stats.counts(self)

    def _weighted(self, x: Tensor, tokens: TreeTokens) -> Tensor:
        return x * tokens.weights.to(x.dtype)[:, None]

    def _expert_counts(self, tokens: TreeTokens, routing_map: Tensor, dp: bool = False) -> Tensor:
        if not tokens.complete:
            counts = self._statistics(tokens)
            return counts.experts_dp if dp else counts.experts
        local = self._weighted(routing_map.double(), tokens).sum(0)
        return _all_reduce(local, self.tp_dp_cp_group if dp else self.tp_cp_group)

    def _rollout_counts(self, tokens: TreeTokens, routing_map: Tensor) -> Tensor:
        if not tokens.complete:
            return self._statistics(tokens).rollouts
        return _all_reduce(tokens.sums.per_rollout(routing_map.double()), self.tp_cp_group)

    # -- the hooks TopKRouter.routing calls
    def routing(self, logits: Tensor, padding_mask: Optional[Tensor] = None):
        tokens = self._tree
        if tokens is not None:
            if padding_mask is not None:
                raise ValueError("padding_mask: tree forwards have no padding mask (padding has multiplicity 0)")
            if self._collect is not None:
                self._collect.add(self, tokens, logits)
        return super().routing(logits, padding_mask)

    def apply_z_loss(self, logits: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        tokens = self._tree
        if tokens is None:
            return super().apply_z_loss(logits, padding_mask)
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not self.training or not torch.is_grad_enabled():
            return logits
        tp_cp = self.tp_cp_group.size()
        # [n, E] -> [n]: z_x = logsumexp(logits_x)^2, weighted; this forward's share of c / T sum_x z_x
        z = torch.logsumexp(logits, dim=-1).square()
        z_loss = (z * tokens.weights.to(z.dtype)).sum() * (coeff / tokens.total)
        logits = MoEAuxLossAutoScaler.apply(logits, z_loss * self._per_token(tokens, tp_cp))
        record_moe_metric("z_loss", z_loss / (coeff / tp_cp), self.layer_number, self._num_layers(),
                          avg_group=self.tp_dp_cp_group if MOE_Z_LOSS_LOG_AVG else None)
        return logits

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        tokens = self._tree
        if tokens is None:
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask)
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        num, total = self.config.num_moe_experts, tokens.total
        counts = self._expert_counts(tokens, routing_map)  # [E], the whole naive batch
        share = self._weighted(scores_for_aux_loss, tokens).sum(0)  # [E], this forward's tokens
        aux = (share * counts.to(share.dtype)).sum() * (num * coeff / (self.topk * total * total))
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux, "load_balancing_loss", self.tp_cp_group,
            valid_token_count=self._valid(tokens))

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                            with_padding_mask=False):
        tokens = self._tree
        if tokens is None:
            return super()._apply_seq_aux_loss(probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                                               with_padding_mask)
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        num, total, rollouts = self.config.num_moe_experts, tokens.total, tokens.tree.num_rollouts
        per_rollout = self._rollout_counts(tokens, routing_map)  # [R, E]
        # [n, E]: sum of F_re over the rollouts r containing each token
        weight = tokens.sums.per_token(per_rollout.to(scores_for_aux_loss.device)).to(scores_for_aux_loss.dtype)
        aux = (scores_for_aux_loss * weight).sum() * (num * coeff * rollouts / (self.topk * total * total))
        tp_cp = self.tp_cp_group.size()
        valid = total / tp_cp if MOE_SEQ_AUX_COUNTS_MICRO_BATCH else total / (tp_cp * rollouts)
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux, "seq_load_balancing_loss", self.tp_cp_group, valid_token_count=valid)

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        tokens = self._tree
        if tokens is None:
            return super()._apply_global_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask)
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if coeff == 0:
            return probs
        counts = self._expert_counts(tokens, routing_map, dp=True)  # [E] over TP x CP x DP
        if self._first_global_forward(tokens):
            self.global_tokens_per_expert += counts.to(self.global_tokens_per_expert.dtype)
            self.ga_steps += 1
        average = self.global_tokens_per_expert / self.ga_steps
        total = float(counts.sum()) / self.topk
        share = self._weighted(scores_for_aux_loss, tokens).sum(0)
        aux = (share * average.to(share.dtype)).sum() * (
            self.config.num_moe_experts * coeff / (self.topk * total * total))
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux, "global_load_balancing_loss", self.tp_dp_cp_group,
            valid_token_count=self._valid(tokens), **MOE_GLOBAL_AUX_LOG_FLAG)

    def _valid(self, tokens: TreeTokens) -> float:
        # attach_and_log_load_balancing_loss applies the release's own per-token scaling to it
        return tokens.total / self.tp_cp_group.size()

    def _first_global_forward(self, tokens: TreeTokens) -> bool:
        if tokens.complete:
            return True  # one forward = one micro-batch
        stats = self._stats
        if id(self) in stats._global_added:
            return False
        stats._global_added.add(id(self))
        return True

    def _apply_expert_bias(self, routing_map: Tensor, padding_mask: Optional[Tensor] = None):
        tokens = self._tree
        if not torch.is_grad_enabled():  # eval, and the first pass of activation recompute
            return
        with torch.no_grad():
            if tokens is not None:
                counts = self._weighted(routing_map.float(), tokens).sum(0)
            else:
                kept = routing_map if padding_mask is None else routing_map & ~padding_mask[:, None]
                counts = kept.float().sum(0)
            if self.tokens_per_expert is None:
                self.tokens_per_expert = torch.zeros_like(counts, dtype=torch.float64)
            self.tokens_per_expert += counts.double()
            if self.enable_expert_bias:
                self.local_tokens_per_expert += counts.to(self.local_tokens_per_expert.dtype)


# --------------------------------------------------------------------------- MoE layer + layer
class BranchMoELayer(MoELayer):
    """Megatron's ``MoELayer`` that hands its router the tree tokens of each forward.

    The tree data come from the enclosing :class:`BranchMoETransformerLayer`
    (``packed_seq_params``); they are bound to this call, so Megatron's MoE recompute
    (``recompute_modules=["moe"]``) replays the same statistics in the backward.

    Args:
        token_dropping: ``"refuse"`` (default): a ``moe_expert_capacity_factor`` raises
            ``ValueError``; ``"approximate"``: drop tokens over the capacity of the unique
            tokens of each forward (not the naive batch's; measure the effect with
            :func:`token_dropping_bias`).
    """

    def __init__(self, *args, token_dropping: str = "refuse", **kwargs):
        if token_dropping not in TOKEN_DROPPING:
            raise ValueError(f"moe_token_dropping: {token_dropping!r} is not one of {TOKEN_DROPPING}")
        config = kwargs.get("config", args[0] if args else None)
        capacity = getattr(config, "moe_expert_capacity_factor", None)
        if capacity is not None and token_dropping == "refuse":
            raise ValueError(
                f"moe_expert_capacity_factor={capacity}: token dropping cannot be "
                "exact under branch replay. An expert keeps at most capacity = factor x tokens x top-k / experts "
                "tokens of the micro-batch and which ones it drops depends on all the others; the tree holds "
                "the unique tokens (fewer, each shared one once), so capacity and dropped set differ from the "
                "naive batch. Use dropless routing (moe_expert_capacity_factor=None), or opt in with "
                "get_branch_layer_spec(..., moe_token_dropping='approximate') and measure the bias with "
                "megatron_branch.spec.moe.token_dropping_bias")
        super().__init__(*args, **kwargs)
        self.token_dropping = token_dropping
        self._params: Optional[BranchPackedSeqParams] = None

    def set_tree_params(self, params) -> None:
        """The next forward's ``packed_seq_params`` (tree data only; anything else = none)."""
        ok = isinstance(params, BranchPackedSeqParams) and params.tree is not None and params.multiplicity is not None
        self._params = params if ok else None

    def _tree_tokens(self, hidden_states: Tensor) -> Optional[TreeTokens]:
        params = self._params
        if params is None:
            return None
        tp = self.attn_tp_group.size() if self.attn_tp_group is not None else 1
        sp = self.config.sequence_parallel and tp > 1
        num = hidden_states.shape[0] * hidden_states.shape[1]  # [s, b, h], b = 1
        key = ("moe_tokens", num)
        if key not in params._moe:
            params._moe[key] = TreeTokens.from_params(
                params, num, self.attn_tp_group.rank() if sp else 0, tp if sp else 1, hidden_states.device)
        return params._moe[key]

    def forward(self, hidden_states: Tensor, intermediate_tensors=None, padding_mask: Optional[Tensor] = None):
        tokens = self._tree_tokens(hidden_states) if hidden_states is not None else None
        if tokens is None:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        run = functools.partial(self._forward_tree, tokens)
        if self.moe_layer_recompute and self.training:
            # Megatron's MoE recompute, with this call's tree data bound to the recompute
            return tensor_parallel.checkpoint(run, False, hidden_states, intermediate_tensors, padding_mask)
        return run(hidden_states, intermediate_tensors, padding_mask)

    def _forward_tree(self, tokens: TreeTokens, hidden_states, intermediate_tensors=None, padding_mask=None):
        recompute, self.moe_layer_recompute = self.moe_layer_recompute, False
        self.router._tree = tokens
        try:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        finally:
            self.router._tree = None
            self.moe_layer_recompute = recompute


class _QuietUnknownMlp(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unknown MLP type")


class _TreeToMoE:
    """Layer mixin: passes the forward's ``packed_seq_params`` to a :class:`BranchMoELayer`."""

    def __init__(self, *args, **kwargs):
        sub = kwargs.get("submodules")
        mlp = getattr(sub, "mlp", None)
        branch_moe = isinstance(mlp, ModuleSpec) and isinstance(mlp.module, type) and issubclass(
            mlp.module, BranchMoELayer)
        if not branch_moe:
            super().__init__(*args, **kwargs)
            return
        # megatron-core 0.16's TransformerLayer passes its process groups only to MLP classes
        # it knows by identity (MoELayer, not a subclass) and warns: hand them over here.
        if kwargs.get("pg_collection") is not None:
            sub, mlp = copy.copy(sub), copy.copy(mlp)
            mlp.params = {**mlp.params, "pg_collection": kwargs["pg_collection"]}
            sub.mlp = mlp
            kwargs["submodules"] = sub
        layer_logger = logging.getLogger(TransformerLayer.__module__)
        quiet = _QuietUnknownMlp()
        layer_logger.addFilter(quiet)
        try:
            super().__init__(*args, **kwargs)
        finally:
            layer_logger.removeFilter(quiet)

    def forward(self, *args, **kwargs):
        mlp = getattr(self, "mlp", None)
        if not isinstance(mlp, BranchMoELayer):
            return super().forward(*args, **kwargs)
        mlp.set_tree_params(kwargs.get("packed_seq_params"))
        try:
            return super().forward(*args, **kwargs)
        finally:
            mlp.set_tree_params(None)


class BranchMoETransformerLayer(_TreeToMoE, TransformerLayer):
    """Megatron's ``TransformerLayer`` that hands ``packed_seq_params`` to its MoE layer."""


_LAYER_CLASSES = {TransformerLayer: BranchMoETransformerLayer}


def _layer_class(base: type) -> type:
    if issubclass(base, _TreeToMoE):
        return base
    if base not in _LAYER_CLASSES:
        _LAYER_CLASSES[base] = type(f"BranchMoE{base.__name__}", (_TreeToMoE, base), {"__doc__": base.__doc__})
    return _LAYER_CLASSES[base]


# --------------------------------------------------------------------------- spec
def _is_moe_slot(mlp) -> bool:
    module = mlp.module if isinstance(mlp, ModuleSpec) else getattr(mlp, "func", None)
    return isinstance(module, type) and issubclass(module, MoELayer)


def _branch_moe_slot(mlp, token_dropping: str):
    if isinstance(mlp, ModuleSpec):
        sub = copy.copy(mlp.submodules)
        out = copy.copy(mlp)
        out.module, out.params = BranchMoELayer, {**mlp.params, "token_dropping": token_dropping}
    else:  # megatron-core >= 0.17: functools.partial(MoELayer, submodules=...)
        sub = copy.copy(mlp.keywords["submodules"])
        out = functools.partial(BranchMoELayer, *mlp.args,
                                **{**mlp.keywords, "submodules": sub, "token_dropping": token_dropping})
    router = sub.router
    if router is TopKRouter or router is None:
        sub.router = BranchTopKRouter
    elif not (isinstance(router, type) and issubclass(router, BranchTopKRouter)):
        name = getattr(router, "__name__", type(router).__name__)
        raise ValueError(f"router: {name} is not Megatron's TopKRouter; the branch spec weights only its statistics")
    if isinstance(out, ModuleSpec):
        out.submodules = sub
    return out


def apply_branch_moe(spec, token_dropping: str = "refuse"):
    """A copy of a layer or block spec whose MoE layers keep naive-batch router statistics.

    In every layer whose ``mlp`` slot is Megatron's ``MoELayer``: the layer becomes
    :class:`BranchMoETransformerLayer` (same parameters), the slot
    :class:`BranchMoELayer` and its router :class:`BranchTopKRouter`. Dense layers are
    left as they are. Apply after :func:`~megatron_branch.spec.apply_branch_attention`
    for a custom block spec; ``get_branch_layer_spec(num_experts=...)`` does it itself.

    Args:
        spec: a layer ``ModuleSpec``, ``TransformerBlockSubmodules`` or block ``ModuleSpec``.
        token_dropping: see :class:`BranchMoELayer`.
    """
    from megatron_branch.spec import _map_layers

    if token_dropping not in TOKEN_DROPPING:
        raise ValueError(f"moe_token_dropping: {token_dropping!r} is not one of {TOKEN_DROPPING}")

    def convert(layer: ModuleSpec) -> ModuleSpec:
        mlp = layer.submodules.mlp
        if not _is_moe_slot(mlp):
            return layer
        sub = copy.copy(layer.submodules)
        sub.mlp = _branch_moe_slot(mlp, token_dropping)
        out = copy.copy(layer)
        out.module, out.submodules, out.params = _layer_class(layer.module), sub, dict(layer.params)
        return out

    return _map_layers(spec, convert)


# --------------------------------------------------------------------------- step API
def routers(model) -> List[BranchTopKRouter]:
    """The model's :class:`BranchTopKRouter` modules, in layer order."""
    return [m for m in model.modules() if isinstance(m, BranchTopKRouter)]


def collect_routing_statistics(model, tree: BranchTree, *, max_chunk_tokens: Optional[int] = None,
                               **replay_kwargs) -> Tuple[RoutingStatistics, Tensor]:
    """One forward-only pass over ``tree`` that records every MoE layer's router counts.

    Runs :func:`megatron_branch.replay_logprobs` (memory-bounded like the step) and sums
    the counts over TP x CP (and DP for the global aux loss): a collective, so every rank
    of those groups calls it. Use the same ``max_chunk_tokens`` (and ``group_ids``) as the
    step (the routing then sees bit-identical inputs).

    Returns:
        ``(statistics, logprobs [R, max_len - 1])``: the log-probs are
        ``replay_logprobs``' (old-policy log-probs when the weights are those of the rollouts).
    """
    from megatron_branch.replay import replay_logprobs

    found = routers(model)
    stats = RoutingStatistics(tree)
    for router in found:
        router._collect = stats
    try:
        lp = replay_logprobs(model, tree, max_chunk_tokens=max_chunk_tokens, **replay_kwargs)
    finally:
        for router in found:
            router._collect = None
    stats.finish(found)
    return stats, lp


@contextlib.contextmanager
def routing_statistics(model, statistics: Optional[RoutingStatistics]) -> Iterator[None]:
    """Inside, the model's routers take streaming units' aux-loss counts from ``statistics``."""
    found = routers(model)
    for router in found:
        router._stats = statistics
    try:
        yield
    finally:
        for router in found:
            router._stats = None


def needs_routing_statistics(model, tree: BranchTree, max_chunk_tokens: Optional[int], group_ids=None) -> bool:
    """Whether a replay step of ``tree`` at this budget needs :func:`collect_routing_statistics`:
    an aux loss is on, the model trains with gradients, and the step forwards the tree in parts."""
    from megatron_branch.replay.plan import plan_replay

    found = routers(model)
    if not found or not torch.is_grad_enabled() or not any(r.training for r in found):
        return False
    if not any(r.get_aux_loss_coeff(kind) > 0 for r in found for kind in AUX_LOSSES):
        return False
    return sum(op.kind in ("stem", "chunk") for op in plan_replay(tree, max_chunk_tokens, group_ids)) > 1


def check_expert_parallel_plan(tree: BranchTree, max_chunk_tokens: Optional[int], group_ids=None,
                               **step_kwargs) -> None:
    """Raise unless every rank of the expert-parallel group runs the same sequence of
    forwards and backwards (every MoE forward is an all-to-all over the EP group, so a
    rank with more or fewer units would hang the others). Collective over the EP group.

    Raises:
        ValueError: the ranks' replay plans differ (EP across data-parallel ranks whose
            trees split into different units): use one packed pass
            (``max_chunk_tokens=None``), or trees and budgets that give equal plans.
    """
    from megatron_branch.replay.plan import plan_replay

    ep_group, _ = _expert_groups()
    if ep_group is None or ep_group.size() == 1:
        return
    ops = plan_replay(tree, max_chunk_tokens, group_ids)
    mine = (tuple(op.kind for op in ops), bool(step_kwargs.get("recompute_stem", False)),
            step_kwargs.get("prefix_grad", "exact"))
    plans = [None] * ep_group.size()
    torch.distributed.all_gather_object(plans, mine, group=ep_group)
    if any(plan != mine for plan in plans):
        counts = [f"{sum(k != 'pop' for k in plan[0])} units" for plan in plans]
        raise ValueError(
            f"expert parallelism: the ranks of the EP group would run different replay plans ({', '.join(counts)}); "
            "each MoE forward is an all-to-all over the group, so every rank must run the same sequence of "
            "forwards and backwards. Use max_chunk_tokens=None (one packed pass per tree) or trees and budgets "
            "with equal plans on every rank of the group")


def replay_step(model, tree: BranchTree, loss_fn, *, statistics: Optional[RoutingStatistics] = None,
                max_chunk_tokens: Optional[int] = None, group_ids=None, **kwargs):
    """:func:`megatron_branch.replay_step` with naive-batch MoE aux losses at any budget.

    When the step forwards the tree in parts and an aux loss is on, the routers' counts
    are collected first (``statistics``, or one forward-only pass), then the step runs
    with them bound. Under expert parallelism the ranks' plans are checked to match first
    (:func:`check_expert_parallel_plan`). Takes and returns what
    ``megatron_branch.replay_step`` does.
    """
    from megatron_branch.replay import replay_step as _replay_step

    check_expert_parallel_plan(tree, max_chunk_tokens, group_ids, **kwargs)
    if statistics is None and needs_routing_statistics(model, tree, max_chunk_tokens, group_ids):
        cp_comm = {k: kwargs[k] for k in ("cp_comm_type",) if k in kwargs}
        statistics, _ = collect_routing_statistics(model, tree, max_chunk_tokens=max_chunk_tokens,
                                                   group_ids=group_ids, **cp_comm)
    with routing_statistics(model, statistics):
        return _replay_step(model, tree, loss_fn, max_chunk_tokens=max_chunk_tokens, group_ids=group_ids, **kwargs)


def tokens_per_expert(model, reset: bool = False) -> Tensor:
    """``[moe_layers, E]`` tokens routed to each expert since the last reset, counted like
    Megatron's expert-bias counts (forwards with gradients; this rank's tokens, each tree
    token times its multiplicity). Sum over TP x CP (x DP) for the global figure."""
    found = routers(model)
    rows = [r.tokens_per_expert if r.tokens_per_expert is not None
            else torch.zeros(r.config.num_moe_experts, dtype=torch.float64) for r in found]
    if reset:
        for r in found:
            r.tokens_per_expert = None
    return torch.stack([row.cpu() for row in rows]) if rows else torch.zeros(0)


# --------------------------------------------------------------------------- naive reference
def naive_moe_logprobs(model, sequences: Sequence) -> Tensor:
    """``[R, max_len - 1]`` log-probs of the naive MoE batch: every rollout one sequence of a
    right-padded batch with Megatron's MoE ``padding_mask`` (True = padding), so the router
    statistics count exactly the rollouts' tokens. Use a stock-spec model."""
    from megatron_branch.reference.naive import _token_logprobs

    seqs = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    device = next(model.parameters()).device
    lengths = torch.tensor([s.numel() for s in seqs], device=device)
    width = int(lengths.max())
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, : s.numel()] = s.to(device)
    pos = torch.arange(width, device=device)
    padding = pos[None, :] >= lengths[:, None]  # [b, s]
    mask = torch.ones(width, width, dtype=torch.bool, device=device).triu(1)[None, None]
    kwargs = {"padding_mask": padding} if bool(padding.any()) else {}
    logits = model(ids, pos[None].expand(len(seqs), -1), attention_mask=mask, **kwargs)
    lp = _token_logprobs(logits[:, :-1], ids[:, 1:])
    valid = pos[None, 1:] < lengths[:, None]
    return torch.where(valid, lp, torch.zeros((), device=device))


def token_dropping_bias(branch_model, stock_model, sequences: Sequence, loss_fn) -> Dict[str, float]:
    """How far ``moe_token_dropping="approximate"`` is from naive training with token dropping.

    Runs ``loss_fn(lp)`` once on the tree (``branch_model``) and once on the naive batch
    (``stock_model``, same weights and capacity factor; :func:`naive_moe_logprobs`) and
    compares. Gradients are left as after the two backwards (zero them before a step).

    Returns:
        ``max_abs_logprob_diff``, ``loss_rel_diff``, ``grad_cosine``, ``grad_rel_error``
        (``|g_tree - g_naive| / |g_naive|``) and ``dropped_tree`` / ``dropped_naive``: the
        fraction of the naive batch's token-to-expert assignments dropped (tree tokens
        weighted by multiplicity).
    """
    from megatron_branch.scoring.logprobs import rollout_logprobs
    from megatron_branch.reference.agreement import grads

    tree = BranchTree.from_sequences(sequences)
    found = routers(branch_model)
    for m in (branch_model, stock_model):
        m.zero_grad(set_to_none=True)
    tokens_per_expert(branch_model, reset=True)
    lp_tree = rollout_logprobs(branch_model, tree)
    loss_tree = loss_fn(lp_tree)
    loss_tree.backward()
    kept_tree = float(tokens_per_expert(branch_model, reset=True).sum())

    kept = []
    hooks = [m.register_forward_hook(lambda mod, args, out: kept.append(out[1])) for m in stock_model.modules()
             if isinstance(m, TopKRouter)]
    try:
        lp_naive = naive_moe_logprobs(stock_model, sequences)
    finally:
        for h in hooks:
            h.remove()
    loss_naive = loss_fn(lp_naive)
    loss_naive.backward()
    lengths = torch.tensor([len(s) for s in sequences])
    valid = (torch.arange(int(lengths.max()))[:, None] < lengths[None, :]).reshape(-1)  # [s * b], s-major
    kept_naive = float(sum(int(rmap[valid.to(rmap.device)].sum()) for rmap in kept))
    assigned = tree.naive_positions * found[0].topk * len(found) if found else 1.0
    g_tree, g_naive = grads(branch_model), grads(stock_model)
    flat_t = torch.cat([g_tree[n].float().reshape(-1) for n in g_naive])
    flat_n = torch.cat([g_naive[n].float().reshape(-1) for n in g_naive])
    norm = flat_n.norm().clamp(min=1e-30)
    return {
        "max_abs_logprob_diff": float((lp_tree.detach() - lp_naive.detach()).abs().max()),
        "loss_rel_diff": abs(float(loss_tree) - float(loss_naive)) / max(abs(float(loss_naive)), 1e-30),
        "grad_cosine": float(torch.nn.functional.cosine_similarity(flat_t, flat_n, dim=0)),
        "grad_rel_error": float((flat_t - flat_n).norm() / norm),
        "dropped_tree": 1.0 - kept_tree / assigned,
        "dropped_naive": 1.0 - kept_naive / assigned,
    }


# --------------------------------------------------------------------------- EP-aware weights
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _expert_groups():
    from megatron_branch._megatron import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, None
    return (parallel_state.get_expert_model_parallel_group(),
            parallel_state.get_expert_tensor_parallel_group())


def _global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    m = _LOCAL_EXPERT.match(name)
    return f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3)}"


def _num_local_experts(model) -> int:
    from megatron_branch.scoring.vocab import unwrap

    config = unwrap(model).config
    ep_group, _ = _expert_groups()
    return config.num_moe_experts // (ep_group.size() if ep_group is not None else 1)


def full_state(model, which: str = "grad") -> Dict[str, Tensor]:
    """:func:`megatron_branch.full_state.full_state` for MoE models under expert parallelism:
    every parameter or gradient unsharded under stock names, experts numbered globally
    (``local_experts.{ep_rank * local + i}``) and joined over expert TP. Collective over
    TP, PP, EP and expert-TP. Sequential experts (``moe_grouped_gemm=False``) only."""
    from megatron_branch._megatron import parallel_state
    from megatron_branch.full_state import _global_name, _join_tp, _size, _tied_copy
    from megatron_branch.scoring.vocab import unwrap
    from megatron_branch.training.ddp import param_grad

    gpt = unwrap(model)
    config = gpt.config
    ep_group, etp_group = _expert_groups()
    ep_rank = ep_group.rank() if ep_group is not None else 0
    num_local = _num_local_experts(model)
    tp_group = parallel_state.get_tensor_model_parallel_group() if ep_group is not None else None
    plain: Dict[str, Tensor] = {}
    experts: Dict[str, Tensor] = {}
    for name, p in gpt.named_parameters():
        if _tied_copy(name, p):
            continue
        value = p.data if which == "param" else (param_grad(p) if param_grad(p) is not None else torch.zeros_like(p))
        value = value.detach()
        if _LOCAL_EXPERT.match(name):
            if re.search(r"\.(weight|bias)\d+$", name):
                raise ValueError(f"{name}: grouped expert weights are not supported (use moe_grouped_gemm=False)")
            value = _join_tp(name, value, p, config, etp_group)
            experts[_global_expert_name(_global_name(model, name), ep_rank, num_local)] = value.to(
                "cpu", torch.float32, copy=True)
        else:
            plain[_global_name(model, name)] = _join_tp(name, value, p, config, tp_group).to(
                "cpu", torch.float32, copy=True)
    if ep_group is not None and _size(ep_group) > 1:
        parts = [None] * _size(ep_group)
        torch.distributed.all_gather_object(parts, experts, group=ep_group)
        for part in parts:
            experts.update(part)
    plain.update(experts)
    pp_group = parallel_state.get_pipeline_model_parallel_group() if ep_group is not None else None
    if pp_group is not None and _size(pp_group) > 1:
        stages = [None] * _size(pp_group)
        torch.distributed.all_gather_object(stages, plain, group=pp_group)
        for stage in stages:
            plain.update(stage)
    return plain


def load_full_state(model, state: Dict[str, Tensor]) -> None:
    """:func:`megatron_branch.full_state.load_full_state` for MoE models under expert
    parallelism: each rank takes its own experts (and their expert-TP slice)."""
    from megatron_branch._megatron import parallel_state
    from megatron_branch.full_state import _EMBEDDING, _global_name, _split_tp, _tied_copy
    from megatron_branch.scoring.vocab import unwrap

    gpt = unwrap(model)
    config = gpt.config
    ep_group, etp_group = _expert_groups()
    ep_rank = ep_group.rank() if ep_group is not None else 0
    num_local = _num_local_experts(model)
    tp_group = parallel_state.get_tensor_model_parallel_group() if ep_group is not None else None
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            key = _EMBEDDING if _tied_copy(name, p) else _global_name(model, name)
            expert = _LOCAL_EXPERT.match(name) is not None
            if expert:
                key = _global_expert_name(key, ep_rank, num_local)
            if key not in state:
                raise ValueError(f"state: missing parameter {key!r}")
            local = _split_tp(name, state[key], p, config, etp_group if expert else tp_group)
            if local.shape != p.shape:
                raise ValueError(f"state: {key!r} has shape {tuple(local.shape)} on this rank, "
                                 f"expected {tuple(p.shape)}")
            p.copy_(local)
