"""``BranchTopKRouter``: Megatron's top-k router with the naive batch's statistics.

The ``router`` slot of Megatron's ``MoESubmodules``. See :mod:`megatron_branch.spec.moe`
for the statistics it reproduces and :mod:`.statistics` for how they are counted.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor

from megatron_branch._megatron import (
    MoEAuxLossAutoScaler,
    TopKRouter,
    moe_router_behaviour,
    record_moe_metric,
    replaying_topk,
)
from megatron_branch.spec.moe.statistics import LayerCounts, RoutingStatistics, TreeTokens, all_reduce

BATCH_ROUTING = ("sinkhorn", "quantile_balancing")


class BranchTopKRouter(TopKRouter):
    """Megatron's ``TopKRouter`` whose batch statistics weight tree tokens by multiplicity.

    Routing is the stock code path (``TopKRouter.routing``); in a tree forward the hooks
    it calls for the z-loss, the three aux losses and the expert-bias counts are replaced
    by weighted versions (see the module docstring for each definition). Without tree
    data (ordinary batches) every hook is Megatron's own. Tree data with replayed experts
    (rollout routing replay, :mod:`.routing_replay`) hands this layer's column to
    Megatron's ``RouterReplay`` for the forward.
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
        self.tokens_per_expert: Optional[Tensor] = None  # [E] float64, see routers.tokens_per_expert()
        # the installed release's loss scaling and logging (ValueError for an unknown release)
        self.behaviour = moe_router_behaviour()

    # -- what the router is told per forward and per step
    @contextlib.contextmanager
    def tree_forward(self, tokens: TreeTokens) -> Iterator[None]:
        """Inside, this router's statistics weight ``tokens`` by multiplicity (one forward)."""
        self._tree = tokens
        try:
            yield
        finally:
            self._tree = None

    def use_statistics(self, statistics: Optional[RoutingStatistics]) -> None:
        """The step's whole-tree counts for forwards that hold part of the tree (``None``: none)."""
        self._stats = statistics

    def collect_into(self, statistics: Optional[RoutingStatistics]) -> None:
        """Record every tree forward's routing into ``statistics`` (``None``: stop)."""
        self._collect = statistics

    # -- helpers
    def _num_layers(self) -> int:
        return self.config.num_layers + (self.config.mtp_num_layers or 0)

    def _per_token(self, tokens: TreeTokens, tp_cp: int) -> float:
        """Megatron's ``calculate_per_token_loss`` factor of the z-loss: the naive
        micro-batch's token count on this rank (an even split over TP x CP), as the
        installed release scales it."""
        if not self.config.calculate_per_token_loss:
            return 1.0
        return tokens.total / tp_cp * (tp_cp if self.behaviour.per_token_scale_times_tp_cp else 1)

    def _statistics(self, tokens: TreeTokens) -> LayerCounts:
        stats = self._stats
        if stats is None:
            raise ValueError(
                "moe aux loss: this forward holds part of the tree (streaming replay), and the aux loss needs "
                "the whole tree's expert counts; use megatron_branch.replay_step (it collects them with one "
                "forward-only pass), or collect_routing_statistics + routing_statistics")
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
        return all_reduce(local, self.tp_dp_cp_group if dp else self.tp_cp_group)

    def _rollout_counts(self, tokens: TreeTokens, routing_map: Tensor) -> Tensor:
        if not tokens.complete:
            return self._statistics(tokens).rollouts
        return all_reduce(tokens.sums.per_rollout(routing_map.double()), self.tp_cp_group)

    # -- the hooks TopKRouter.routing calls
    def routing(self, logits: Tensor, padding_mask: Optional[Tensor] = None):
        tokens = self._tree
        if tokens is not None:
            if padding_mask is not None:
                raise ValueError("padding_mask: tree forwards have no padding mask (padding has multiplicity 0)")
            if self._collect is not None:
                self._collect.add(self, tokens, logits)
            experts = tokens.replayed_experts(self.layer_number)  # rollout routing replay, [n, topk]
            if experts is not None:
                with replaying_topk(self, experts):
                    return super().routing(logits, padding_mask)
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
                          avg_group=self.tp_dp_cp_group if self.behaviour.z_loss_log_avg else None)
        return logits

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        tokens = self._tree
        if tokens is None:
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask)
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        num, total = self.config.num_moe_experts, tokens.total
        scale = num * coeff / (self.topk * total * total)
        share = self._weighted(scores_for_aux_loss, tokens).sum(0)  # [E], this forward's tokens
        if self._pending(tokens):
            aux = self._stats.later(self, "aux_loss", share, lambda c: c.experts * scale)
        else:
            counts = self._expert_counts(tokens, routing_map)  # [E], the whole naive batch
            aux = (share * counts.to(share.dtype)).sum() * scale
        return self._attach(probs, "aux_loss", aux, self._valid(tokens))

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
        scale = num * coeff * rollouts / (self.topk * total * total)
        device = scores_for_aux_loss.device

        def weights(counts: LayerCounts) -> Tensor:  # [n, E]: sum of F_re over the rollouts r containing each token
            return tokens.sums.per_token(counts.rollouts.to(device)) * scale

        if self._pending(tokens):
            # logged at the finish from each rollout's share (sum_t x_t sum_{r ∋ t} F_r = sum_r F_r sum_{t ∈ r} x_t):
            # [R, E] kept per forward instead of the [n, E] scores
            logged = (tokens.sums.per_rollout(scores_for_aux_loss.detach()).to(scores_for_aux_loss.dtype),
                      lambda c: c.rollouts * scale)
            aux = self._stats.later(self, "seq_aux_loss", scores_for_aux_loss, weights, logged=logged)
        else:
            counts = LayerCounts(None, self._rollout_counts(tokens, routing_map))  # [R, E]
            aux = (scores_for_aux_loss * weights(counts).to(scores_for_aux_loss.dtype)).sum()
        tp_cp = self.tp_cp_group.size()
        valid = total / tp_cp if self.behaviour.seq_aux_counts_micro_batch else total / (tp_cp * rollouts)
        return self._attach(probs, "seq_aux_loss", aux, valid)

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        tokens = self._tree
        if tokens is None:
            return super()._apply_global_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask)
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if coeff == 0:
            return probs
        share = self._weighted(scores_for_aux_loss, tokens).sum(0)

        def weights(counts: Tensor) -> Tensor:  # [E]: the running average counts, scaled
            total = float(counts.sum()) / self.topk
            average = self.global_tokens_per_expert / self.ga_steps
            return average * (self.config.num_moe_experts * coeff / (self.topk * total * total))

        if self._pending(tokens):  # the running counts are added at the statistics' finish
            aux = self._stats.later(self, "global_aux_loss", share, lambda c: weights(c.experts_dp))
        else:
            counts = self._expert_counts(tokens, routing_map, dp=True)  # [E] over TP x CP x DP
            if self._first_global_forward(tokens):
                self.add_global_counts(counts)
            aux = (share * weights(counts).to(share.dtype)).sum()
        return self._attach(probs, "global_aux_loss", aux, self._valid(tokens))

    # the aux losses' logging names and reduction groups, as Megatron's router logs them
    def _attach(self, probs: Tensor, kind: str, aux: Tensor, valid: float) -> Tensor:
        """Megatron's ``attach_and_log_load_balancing_loss`` for the aux loss ``kind``."""
        coeff = self.get_aux_loss_coeff(kind)
        if kind == "global_aux_loss":
            return self.attach_and_log_load_balancing_loss(
                probs, coeff, aux, "global_load_balancing_loss", self.tp_dp_cp_group, valid_token_count=valid,
                **self.behaviour.global_aux_log_flag)
        name = "load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss"
        return self.attach_and_log_load_balancing_loss(probs, coeff, aux, name, self.tp_cp_group,
                                                       valid_token_count=valid)

    def add_global_counts(self, counts: Tensor) -> None:
        """Add one micro-batch's ``[E]`` counts (over TP x CP x DP) to the global aux loss's
        running average, as Megatron's router does once per forward."""
        self.global_tokens_per_expert += counts.to(self.global_tokens_per_expert.dtype)
        self.ga_steps += 1

    def log_deferred(self, kind: str, aux: Tensor) -> None:
        """Log the value of a deferred aux loss (:meth:`RoutingStatistics.later`) once its
        counts are complete, through the same logging as a forward (the loss attached to a
        throwaway tensor: its gradient went through :class:`LateCounts`)."""
        self._attach(aux.new_zeros(1), kind, aux.detach(), 1.0)

    def _pending(self, tokens: TreeTokens) -> bool:
        """This forward holds part of the tree and the step's counts are not complete yet."""
        return not tokens.complete and self._stats is not None and self._stats.pending

    def _valid(self, tokens: TreeTokens) -> float:
        # attach_and_log_load_balancing_loss applies the release's own per-token scaling to it
        return tokens.total / self.tp_cp_group.size()

    def _first_global_forward(self, tokens: TreeTokens) -> bool:
        if tokens.complete:
            return True  # one forward = one micro-batch
        return self._stats.first_global_forward(self)

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
