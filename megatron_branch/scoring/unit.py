"""One model forward over a packed unit of the tree, on every parallel layout.

Shared by :func:`megatron_branch.rollout_logprobs` (the whole tree is one unit) and by
streaming replay (stems and chunks). Handles sequence-parallel padding, the
context-parallel split and the gathering of per-token log-probs across CP ranks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from megatron_branch.attention.context_parallel import CP_COMM_TYPES, singleton_group, sum_across
from megatron_branch.flops import ModelShape
from megatron_branch.layout import ParallelLayout
from megatron_branch.model import model_device, unwrap
from megatron_branch.scoring.output_rows import select_output_rows
from megatron_branch.scoring.vocab import child_logprobs
from megatron_branch.spec.packed_seq import BranchPackedSeqParams
from megatron_branch.tree import BranchTree


def _cp_group():
    return ParallelLayout.current().group("cp")


FP8_TOKEN_MULTIPLE = 16  # Transformer Engine's FP8 GEMMs need token counts divisible by 16


def unit_multiple(config) -> int:
    """Every packed unit (and every CP shard of it) is padded to a multiple of this.

    Sequence parallelism splits each rank's tokens over the TP ranks; FP8 GEMMs in
    Transformer Engine need each GEMM's token count divisible by 16 — per TP rank under
    sequence parallelism. The padding is a chain of its own that no real token sees and
    that is never scored.
    """
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return tp * FP8_TOKEN_MULTIPLE if getattr(config, "fp8", None) else tp


def linear_weight(config) -> float:
    """Per-token linear work of a layer in units of one attention (query, key) pair."""
    return shape_linear_weight(ModelShape.from_config(config, 0))


def shape_linear_weight(shape: ModelShape) -> float:
    """:func:`linear_weight` of a :class:`~megatron_branch.flops.ModelShape` (the CP balance)."""
    return 2.0 * shape.linear_params_per_layer() / (4.0 * shape.head_dim * shape.num_attention_heads)


def local_unit_rows(model, tree: BranchTree, start: int, end: int, cached_end: Optional[int] = None) -> int:
    """This rank's real tokens of the unit ``[start, end)`` before ``cached_end`` (default
    ``end``; a stem's chain): their context-parallel share."""
    cached_end = end if cached_end is None else cached_end
    cp_group = _cp_group()
    if cp_group is None:
        return cached_end - start
    config = unwrap(model).config
    params = BranchPackedSeqParams.for_unit(tree, start, end, multiple=unit_multiple(config), cp_group=cp_group,
                                            cp_linear_weight=linear_weight(config))
    lo, hi = params.local
    return max(0, min(hi, cached_end - start) - lo)


class ChildIndex:
    """Packed indices of the children of any packed range, by binary search."""

    def __init__(self, tree: BranchTree):
        parents = tree.parents.numpy()
        self._order = np.argsort(parents, kind="stable")
        self._sorted = parents[self._order]

    def __call__(self, start: int, end: int) -> Tensor:
        lo, hi = np.searchsorted(self._sorted, [start, end])
        return torch.from_numpy(np.sort(self._order[lo:hi]))


def prepare_unit(
    model,
    tree: BranchTree,
    start: int,
    end: int,
    *,
    cp_comm_type: str = "allgather",
    cp_linear_weight: Optional[float] = None,
    **cache,
) -> Tuple[BranchPackedSeqParams, Tensor]:
    """Tree data and input ids of the unit ``[start, end)`` for this rank.

    Returns:
        ``(params, ids [n_local])``: the :class:`BranchPackedSeqParams` (SP padding and the
        CP split applied) and the token ids this rank feeds the model.
    """
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type: {cp_comm_type!r} is not one of {CP_COMM_TYPES}")
    device = model_device(model)
    config = unwrap(model).config
    multiple = unit_multiple(config)
    cp_group = _cp_group()
    if cp_group is not None and cp_linear_weight is None:
        cp_linear_weight = linear_weight(config)
    params = BranchPackedSeqParams.for_unit(
        tree, start, end, device, multiple=multiple, cp_group=cp_group, cp_comm_type=cp_comm_type,
        cp_linear_weight=cp_linear_weight or 0.0,
        rope_group=singleton_group() if cp_group is not None else None, **cache,
    )
    lo, hi = params.local
    n_pad = params.total - params.num_real
    ids = torch.cat([tree.tokens[start:end], torch.zeros(n_pad, dtype=torch.long, device=tree.tokens.device)])[lo:hi]
    return params, ids.to(device)


class UnitRows:
    """Which tokens a unit scores on this rank and which logits rows that takes.

    Attributes:
        mine: ``[m]`` packed indices of the scored tokens whose parent this rank runs.
        rows: ``[m]`` local position of each of those parents, sorted: the rows the
            output layer produces. A branch point's row comes once per scored child, so
            every child has its own logits row and the cross-entropy runs on the logits
            as they stand; gathering the shared rows instead would copy the whole
            ``[m, V / tp]`` logits (and scatter-add their gradient) for the few extra
            output-layer rows this costs.
        inverse: ``[m]`` row in ``rows`` of each scored token (a permutation).
        order: ``[m]`` the scored token of each row in ``rows`` (the inverse permutation).
        targets: ``[m]`` token ids of the scored tokens.
    """

    def __init__(self, tree: BranchTree, start: int, end: int, params: BranchPackedSeqParams,
                 children: ChildIndex, scored: Optional[Tensor] = None):
        lo, hi = params.local
        real_hi = min(hi, params.num_real)
        mine = children(start + lo, start + real_hi) if real_hi > lo else torch.zeros(0, dtype=torch.long)
        if scored is not None:
            mine = mine[scored[mine]]
        self.mine = mine
        self.rows, self.order = torch.sort(tree.parents[mine] - start - lo, stable=True)
        self.inverse = torch.empty_like(self.order)
        self.inverse[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        self.targets = tree.tokens[mine]


def score_unit(
    logits: Tensor,
    tree: BranchTree,
    start: int,
    end: int,
    params: BranchPackedSeqParams,
    children: ChildIndex,
    entropy: bool = False,
    unit_rows: Optional[UnitRows] = None,
    scored: Optional[Tensor] = None,
    temperatures: Optional[Tensor] = None,
    consume_logits: bool = False,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Log-probs ``[m, k]`` (one column per temperature) of the scored tokens whose parent
    lies in ``[start, end)``; all-reduced over CP (identity backward), so every rank
    returns the same differentiable values.

    Args:
        logits: this rank's logits: ``[n_local, V / tp]`` for every position, or
            ``[m, V / tp]`` for ``unit_rows.rows`` only (:func:`megatron_branch.scoring.output_rows.output_rows`).
        unit_rows: given when ``logits`` holds only the selected rows.
        scored: ``[U]`` bool, the tokens to score (``None``: all).
        temperatures: ``[k]`` distinct sampling temperatures (``None``: 1.0).
        consume_logits: ``logits`` are the model's output, read nowhere else: the
            cross-entropy may overwrite them (:func:`child_logprobs`).
    """
    sel = unit_rows or UnitRows(tree, start, end, params, children, scored)
    picked = sel.inverse if unit_rows is not None else sel.rows[sel.inverse]
    # logits of the selected rows hold one row per scored token
    row_children = sel.order.to(logits.device) if unit_rows is not None else None
    lp, ent = child_logprobs(logits, picked.to(logits.device), sel.targets.to(logits.device), entropy, temperatures,
                             consume=consume_logits, row_children=row_children)
    mine = sel.mine
    if params.cp is None:
        return mine, lp, ent
    group = params.cp.group
    idx = children(start, end)
    if scored is not None:
        idx = idx[scored[idx]]
    where = torch.searchsorted(idx, mine).to(logits.device)
    full = lp.new_zeros(idx.numel(), lp.shape[1]).index_put((where,), lp)
    full_ent = None if ent is None else ent.new_zeros(idx.numel(), ent.shape[1]).index_put((where,), ent)
    return idx, sum_across(full, group), (None if ent is None else sum_across(full_ent, group))


def forward_unit(
    model,
    tree: BranchTree,
    start: int,
    end: int,
    children: Optional[ChildIndex] = None,
    *,
    cp_comm_type: str = "allgather",
    cp_linear_weight: Optional[float] = None,
    entropy: bool = False,
    scored: Optional[Tensor] = None,
    temperatures: Optional[Tensor] = None,
    **cache,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Forward ``[start, end)`` and score the tokens whose parent lies in it.

    The output layer runs only on the parents of scored tokens
    (:func:`megatron_branch.scoring.output_rows.output_rows`).

    Args:
        model: GPTModel built with the branch spec (``post_process=True``), possibly wrapped.
        tree: the packed tree.
        start, end: the unit (see :meth:`BranchPackedSeqParams.for_unit`).
        children: a :class:`ChildIndex` of ``tree`` (built if None).
        cp_comm_type: context-parallel attention communication.
        cp_linear_weight: balancing weight (default from the model config).
        entropy: also return entropies.
        scored: ``[U]`` bool, the tokens a loss reads (``None``: every token with a parent).
        temperatures: ``[k]`` distinct sampling temperatures (``None``: 1.0).
        **cache: ``cache``, ``stem_id``, ``inject`` for streaming replay.

    Returns:
        ``(idx [m], lp [m, k], ent [m, k] or None)``: packed indices of the scored tokens
        and their log-probs at each temperature, the same on every CP and TP rank,
        differentiable.
    """
    children = children or ChildIndex(tree)
    params, ids = prepare_unit(model, tree, start, end, cp_comm_type=cp_comm_type,
                               cp_linear_weight=cp_linear_weight, **cache)
    sel = UnitRows(tree, start, end, params, children, scored)
    with select_output_rows(model, sel.rows):
        logits = model(ids.unsqueeze(0), params.positions.unsqueeze(0), attention_mask=None,
                       packed_seq_params=params).squeeze(0)  # [m, V/tp] (a view: its backward copies nothing)
    return score_unit(logits, tree, start, end, params, children, entropy, unit_rows=sel, scored=scored,
                      temperatures=temperatures, consume_logits=True)
