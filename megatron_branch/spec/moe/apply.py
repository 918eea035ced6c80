"""``apply_branch_moe``: naive-batch router statistics in the MoE layers of any spec."""

from __future__ import annotations

import copy
import functools

from megatron_branch._megatron import ModuleSpec, MoELayer, TopKRouter
from megatron_branch.spec.layers import map_layers
from megatron_branch.spec.moe.layer import TOKEN_DROPPING, BranchMoELayer, branch_moe_layer_class
from megatron_branch.spec.moe.router import BranchTopKRouter


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
    left as they are. Apply after :func:`~megatron_branch.spec.attention.apply_branch_attention`
    for a custom block spec; ``get_branch_layer_spec(num_experts=...)`` does it itself.

    Args:
        spec: a layer ``ModuleSpec``, ``TransformerBlockSubmodules`` or block ``ModuleSpec``.
        token_dropping: see :class:`BranchMoELayer`.
    """
    if token_dropping not in TOKEN_DROPPING:
        raise ValueError(f"moe_token_dropping: {token_dropping!r} is not one of {TOKEN_DROPPING}")

    def convert(layer: ModuleSpec) -> ModuleSpec:
        mlp = layer.submodules.mlp
        if not _is_moe_slot(mlp):
            return layer
        sub = copy.copy(layer.submodules)
        sub.mlp = _branch_moe_slot(mlp, token_dropping)
        out = copy.copy(layer)
        out.module, out.submodules, out.params = branch_moe_layer_class(layer.module), sub, dict(layer.params)
        return out

    return map_layers(spec, convert)
