"""Router statistics of the naive batch, computed from the tree's unique tokens.

Our own code (Megatron counts the tokens it is given). Each statistic is a sum over the
naive batch's tokens, or over each rollout's tokens; a unique tree token stands for all
its copies, so it is weighted by its multiplicity, and per-rollout sums are prefix sums
over the DFS preorder (:class:`TreeSums`). :class:`TreeTokens` is what one router sees in
one forward; :class:`RoutingStatistics` holds a whole step's counts for streaming replay,
whose forwards each hold only part of the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from megatron_branch._megatron import compute_routing_scores_for_aux_loss
from megatron_branch.model import HOST
from megatron_branch.spec.packed_seq import BranchPackedSeqParams
from megatron_branch.tree import BranchTree

if TYPE_CHECKING:
    from megatron_branch.spec.moe.routing_replay import TreeRouting

AUX_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


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
        routing: the tree's replayed experts (:class:`~.routing_replay.TreeRouting`), or None.
    """

    tree: BranchTree
    weights: Tensor
    index: Tensor
    complete: bool
    _sums: Optional[TreeSums] = field(default=None, repr=False)
    routing: Optional["TreeRouting"] = field(default=None, repr=False)
    _experts: Optional[Tensor] = field(default=None, repr=False)

    def replayed_experts(self, layer_number: int) -> Optional[Tensor]:
        """``[n, topk]`` int64 experts the router of decoder layer ``layer_number`` replays
        for these tokens (on the device of ``weights``), or None without routing replay."""
        if self.routing is None:
            return None
        if self._experts is None:  # [n, moe_layers, topk], gathered once per forward for all layers
            self._experts = self.routing.rows(self.index, self.weights.device)
        return self._experts[:, self.routing.column(layer_number)]

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
        index = params.start + lo + off + torch.arange(num_tokens, device=HOST)  # host, like the tree
        index[index >= params.start + params.num_real] = -1
        tree = params.tree
        complete = params.start == 0 and params.num_real == tree.unique_positions
        return cls(tree, weights, index, complete, routing=params.routing)


@dataclass
class LayerCounts:
    """One MoE layer's aux top-k counts over the naive batch."""

    experts: Tensor  # [E] aux top-k counts, weighted, summed over TP x CP
    rollouts: Optional[Tensor]  # [R, E] the same per rollout (None: no seq aux loss reads them)
    experts_dp: Optional[Tensor] = None  # [E] also summed over DP (global aux loss)


class LateCounts(torch.autograd.Function):
    """``sum(x * w)`` where the weights ``w`` (the whole tree's counts, scaled) are known only
    once every unit of the step has been routed: the forward returns 0 and the backward
    reads ``w``. The value itself is logged when the counts are complete
    (:meth:`RoutingStatistics.finish`); Megatron's ``MoEAuxLossAutoScaler`` only needs the
    aux loss's gradient from it."""

    @staticmethod
    def forward(ctx, x: Tensor, weights: Callable[[], Tensor]) -> Tensor:  # noqa: D102
        ctx.weights = weights
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: D102
        return grad * ctx.weights().to(grad.dtype), None


@dataclass
class RoutingStatistics:
    """One step's router counts per MoE layer, for streaming replay's aux losses.

    Either collected before the step by a forward-only pass
    (:func:`~megatron_branch.replay.step.collect_routing_statistics`), or, with
    ``in_step``, by the step's own forwards where every model backward of its plan runs
    after its last forward: the aux losses then enter the graph as :class:`LateCounts`
    (gradient read at the backward) and are logged at :meth:`finish`. Bound with
    :func:`~megatron_branch.spec.moe.routers.routing_statistics`; valid for the tree and
    weights it was collected with.
    """

    tree: BranchTree
    in_step: bool = False
    layers: Dict[int, LayerCounts] = field(default_factory=dict)
    _global_added: Set[int] = field(default_factory=set)
    _finished: bool = False
    # in_step: per (router, aux loss) the deferred values of the forwards so far, logged at finish
    _deferred: Dict[tuple, list] = field(default_factory=dict)

    @property
    def pending(self) -> bool:
        """Collected in the step and not complete yet (its aux losses are deferred)."""
        return self.in_step and not self._finished

    def add(self, router, tokens: TreeTokens, logits: Tensor) -> None:
        """Record one forward's routing of ``tokens`` by ``router`` (a ``BranchTopKRouter``)."""
        if self._finished:
            # in_step: a recompute in the backward (Megatron's activation recompute, a
            # recomputed stem) routes tokens already counted
            return
        with torch.no_grad():
            rmap, _ = compute_routing_scores_for_aux_loss(
                logits.reshape(-1, router.config.num_moe_experts).detach(), router.topk, router.score_function)
            rmap = rmap.double()
            entry = self.layers.get(id(router))
            if entry is None:
                num = router.config.num_moe_experts
                per_rollout = router.get_aux_loss_coeff("seq_aux_loss") > 0
                entry = self.layers[id(router)] = LayerCounts(
                    rmap.new_zeros(num), rmap.new_zeros(self.tree.num_rollouts, num) if per_rollout else None)
            entry.experts += (rmap * tokens.weights.double()[:, None]).sum(0)
            if entry.rollouts is not None:
                entry.rollouts += tokens.sums.per_rollout(rmap).to(entry.rollouts.device)

    def later(self, router, kind: str, x: Tensor, weights_of: Callable[[LayerCounts], Tensor],
              logged: Optional[Tuple[Tensor, Callable[[LayerCounts], Tensor]]] = None) -> Tensor:
        """``sum(x * weights_of(counts))`` of ``router``'s layer, deferred (``in_step``):
        differentiable in ``x``; its value is logged as ``kind`` at :meth:`finish`, computed
        from ``logged = (y, w)`` as ``sum(y * w(counts))`` where given (a smaller equal form)."""
        self._deferred.setdefault((router, kind), []).append(logged or (x.detach(), weights_of))
        return LateCounts.apply(x, lambda: weights_of(self.counts(router)))

    def finish(self, routers: Sequence) -> None:
        """Sum the counts over each router's TP x CP group (and DP for the global aux loss).

        ``in_step``: also adds them to the global aux loss's running counts (once per
        router, as one micro-batch) and logs the deferred aux losses through each router's
        own logging. A collective over those groups.
        """
        for router in routers:
            entry = self.layers.get(id(router))
            if entry is None:
                raise ValueError("collect_routing_statistics: an MoE layer saw no tree tokens")
            if router.get_aux_loss_coeff("global_aux_loss") > 0:
                entry.experts_dp = all_reduce(entry.experts.clone(), router.tp_dp_cp_group)
            all_reduce(entry.experts, router.tp_cp_group)
            if entry.rollouts is not None:
                all_reduce(entry.rollouts, router.tp_cp_group)
        self._finished = True
        if not self.in_step:
            return
        for router in routers:
            if router.get_aux_loss_coeff("global_aux_loss") > 0 and self.first_global_forward(router):
                router.add_global_counts(self.layers[id(router)].experts_dp)
        for (router, kind), parts in self._deferred.items():
            counts = self.layers[id(router)]
            router.log_deferred(kind, sum((x * w(counts).to(x.dtype)).sum() for x, w in parts))
        self._deferred.clear()

    def counts(self, router) -> LayerCounts:
        """The whole tree's counts of ``router``'s layer."""
        if not self._finished or id(router) not in self.layers:
            raise ValueError("routing statistics: not collected for this model "
                             "(use megatron_branch.replay.routing.collect_routing_statistics)")
        return self.layers[id(router)]

    def first_global_forward(self, router) -> bool:
        """True once per router: the global aux loss accumulates one micro-batch's counts
        once, however many forwards streaming replay makes of the tree."""
        if id(router) in self._global_added:
            return False
        self._global_added.add(id(router))
        return True


def all_reduce(x: Tensor, group) -> Tensor:
    """In-place sum of ``x`` over ``group`` (nothing on a one-rank or absent group)."""
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(x, group=group)
    return x
