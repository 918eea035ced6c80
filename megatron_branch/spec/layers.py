"""Walking a Megatron layer or block spec: the shared step of every ``apply_*`` function."""

from __future__ import annotations

import copy
from typing import Callable

from megatron_branch._megatron import HybridStack, ModuleSpec, TransformerBlock, TransformerBlockSubmodules

# The layer kinds of Megatron's HybridStack the apply_* steps rewrite. Left as they are:
# mamba_layer (no tree path: refused when a model uses it) and dsa_layer (sparse attention
# variant: refused likewise), since stock hybrid specs fill every slot whatever the pattern.
HYBRID_LAYER_SLOTS = ("gdn_layer", "attention_layer", "mla_layer", "mlp_layer", "moe_layer")


def map_layers(spec, fn: Callable[[ModuleSpec], ModuleSpec]):
    """A copy of ``spec`` with ``fn`` applied to each layer ``ModuleSpec``.

    Accepts what GPTModel accepts as ``transformer_layer_spec``: a layer ``ModuleSpec``,
    a ``TransformerBlockSubmodules`` (per-layer specs, e.g. MoE layer patterns) or a
    ``ModuleSpec`` of a ``TransformerBlock``; and HybridModel's ``hybrid_stack_spec`` (a
    ``ModuleSpec`` of a ``HybridStack``: each layer kind of :data:`HYBRID_LAYER_SLOTS`).
    Only the containers on the way are copied.

    Raises:
        ValueError: ``spec`` is none of these.
    """
    if isinstance(spec, TransformerBlockSubmodules):
        out = copy.copy(spec)
        out.layer_specs = [fn(layer) for layer in spec.layer_specs]
        return out
    if isinstance(spec, ModuleSpec) and isinstance(spec.module, type) and issubclass(spec.module, TransformerBlock):
        out = copy.copy(spec)
        out.submodules = map_layers(spec.submodules, fn)
        return out
    if HybridStack is not None and isinstance(spec, ModuleSpec) and isinstance(spec.module, type) \
            and issubclass(spec.module, HybridStack):
        out = copy.copy(spec)
        out.submodules = copy.copy(spec.submodules)
        for name in HYBRID_LAYER_SLOTS:
            layer = getattr(spec.submodules, name, None)
            if isinstance(layer, ModuleSpec):
                setattr(out.submodules, name, fn(layer))
        return out
    if isinstance(spec, ModuleSpec):
        return fn(spec)
    raise ValueError(f"spec: expected a layer or block spec, got {type(spec).__name__}")
