"""``BranchMoELayer`` (the ``mlp`` slot) and the layer class that hands it the tree data.

Megatron's ``MoELayer`` and ``TransformerLayer``, unchanged but for one step: the layer
passes the forward's ``packed_seq_params`` to its MoE layer, which binds the tree tokens
of that forward to its router (:class:`~megatron_branch.spec.moe.router.BranchTopKRouter`)
for the duration of the call.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from typing import Optional

from torch import Tensor

from megatron_branch._megatron import ModuleSpec, MoELayer, TransformerLayer, tensor_parallel
from megatron_branch.spec.moe.router import BranchTopKRouter
from megatron_branch.spec.moe.statistics import TreeTokens
from megatron_branch.spec.packed_seq import BranchPackedSeqParams

TOKEN_DROPPING = ("refuse", "approximate")


class BranchMoELayer(MoELayer):
    """Megatron's ``MoELayer`` that hands its router the tree tokens of each forward.

    The tree data come from the enclosing :class:`BranchMoETransformerLayer`
    (``packed_seq_params``); they are bound to this call, so Megatron's MoE recompute
    (``recompute_modules=["moe"]``) replays the same statistics in the backward.

    Args:
        token_dropping: ``"refuse"`` (default): a ``moe_expert_capacity_factor`` raises
            ``ValueError``; ``"approximate"``: drop tokens over the capacity of the unique
            tokens of each forward (not the naive batch's; measure the effect with
            :func:`megatron_branch.reference.bias.token_dropping_bias`).
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
                "megatron_branch.reference.bias.token_dropping_bias")
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
        # one TreeTokens per forward, shared by every MoE layer (and its recompute)
        return params.memo(("moe_tokens", num), lambda: TreeTokens.from_params(
            params, num, self.attn_tp_group.rank() if sp else 0, tp if sp else 1, hidden_states.device))

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
        # a router other than BranchTopKRouter (only by editing a spec by hand) keeps
        # Megatron's own statistics; tests use that as the guard that weighting matters
        bind = (self.router.tree_forward(tokens) if isinstance(self.router, BranchTopKRouter)
                else contextlib.nullcontext())
        try:
            with bind:
                return super().forward(hidden_states, intermediate_tensors, padding_mask)
        finally:
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


def branch_moe_layer_class(base: type) -> type:
    """``base`` (a ``TransformerLayer`` class) with the step that hands tree data to its MoE layer."""
    if issubclass(base, _TreeToMoE):
        return base
    if base not in _LAYER_CLASSES:
        _LAYER_CLASSES[base] = type(f"BranchMoE{base.__name__}", (_TreeToMoE, base), {"__doc__": base.__doc__})
    return _LAYER_CLASSES[base]
