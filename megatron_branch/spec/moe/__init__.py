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
has been routed. Where every backward of its plan follows its last forward (stems, then
one chunk), :func:`megatron_branch.replay_step` counts the tree in those forwards and the
aux losses enter the graph as :class:`~.statistics.LateCounts`, whose backward reads the
completed counts (their values are logged once the counts are complete). Otherwise it
collects the counts first with one forward-only pass
(:func:`megatron_branch.replay.routing.collect_routing_statistics`, which also returns
the log-probs, e.g. the old-policy ones when the weights have not changed) and binds them
(:func:`routing_statistics`). The z-loss and the token counts need neither.

Conditions: routing that depends on the whole batch cannot be exact and is refused
(``ValueError``): token dropping (an expert's capacity is a fraction of the micro-batch's
token count; opt in to ``moe_token_dropping="approximate"`` and measure with
:func:`megatron_branch.reference.bias.token_dropping_bias`), Sinkhorn and quantile balancing, and the random input
jitter / forced balancing (like dropout). ``MoEAuxLossAutoScaler``'s scale is Megatron's
(1 unless a schedule sets it: branch replay applies the aux coefficient once per tree).

Files, split like Megatron's ``transformer/moe/``: :mod:`.statistics` (the counts),
:mod:`.router` (:class:`BranchTopKRouter`, the ``router`` slot), :mod:`.layer`
(:class:`BranchMoELayer`, the ``mlp`` slot, and the layer class that hands it
``packed_seq_params``), :mod:`.routing_replay` (rollout routing replay: the engine's
experts per unique token, replayed through Megatron's ``RouterReplay``), :mod:`.apply`
(:func:`apply_branch_moe` puts them in a spec; ``get_branch_layer_spec`` applies it) and
:mod:`.routers` (a model's routers). What runs a step lives above, in
:mod:`megatron_branch.replay`.
"""

from megatron_branch.spec.moe.apply import apply_branch_moe
from megatron_branch.spec.moe.layer import TOKEN_DROPPING, BranchMoELayer, BranchMoETransformerLayer
from megatron_branch.spec.moe.router import BATCH_ROUTING, BranchTopKRouter
from megatron_branch.spec.moe.routers import (
    check_moe_layers,
    collecting_statistics,
    routers,
    routing_statistics,
    tokens_per_expert,
)
from megatron_branch.spec.moe.routing_replay import TreeRouting, moe_layer_columns, tree_routing
from megatron_branch.spec.moe.statistics import (
    AUX_LOSSES,
    RoutingStatistics,
    TreeSums,
    TreeTokens,
    rollout_sums,
    subtree_rollout_sums,
)

__all__ = [
    "AUX_LOSSES",
    "BATCH_ROUTING",
    "BranchMoELayer",
    "BranchMoETransformerLayer",
    "BranchTopKRouter",
    "RoutingStatistics",
    "TOKEN_DROPPING",
    "TreeRouting",
    "TreeSums",
    "TreeTokens",
    "apply_branch_moe",
    "check_moe_layers",
    "collecting_statistics",
    "moe_layer_columns",
    "rollout_sums",
    "routers",
    "routing_statistics",
    "subtree_rollout_sums",
    "tokens_per_expert",
    "tree_routing",
]
