"""Walking a Megatron layer or block spec: the shared step of every ``apply_*`` function."""

from __future__ import annotations

import copy
from typing import Callable

from megatron_branch._megatron import ModuleSpec, TransformerBlock, TransformerBlockSubmodules


def map_layers(spec, fn: Callable[[ModuleSpec], ModuleSpec]):
    """A copy of ``spec`` with ``fn`` applied to each layer ``ModuleSpec``.

    Accepts what GPTModel accepts as ``transformer_layer_spec``: a layer ``ModuleSpec``,
    a ``TransformerBlockSubmodules`` (per-layer specs, e.g. MoE layer patterns) or a
    ``ModuleSpec`` of a ``TransformerBlock``. Only the containers on the way are copied.

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
    if isinstance(spec, ModuleSpec):
        return fn(spec)
    raise ValueError(f"spec: expected a layer or block spec, got {type(spec).__name__}")
