"""Dense and MoE layers in one block: Megatron's ``moe_layer_freq`` as per-layer specs.

``get_gpt_layer_local_spec(num_experts=...)`` gives one layer spec, which GPTModel repeats
for every layer. Released MoE models keep some layers dense (DeepSeek-V3's
``first_k_dense_replace``, Qwen3-MoE's ``mlp_only_layers``); Megatron describes that with
``TransformerConfig.moe_layer_freq`` and builds a block spec from it
(``get_gpt_decoder_block_spec``, Transformer Engine or local modules, no branch pieces).
:func:`mix_dense_and_moe` does the same for any pair of specs the branch builders made.
"""

from __future__ import annotations

from typing import List, Optional

from megatron_branch._megatron import (
    ModuleSpec,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
    get_transformer_layer_offset,
)


def moe_layer_pattern(config) -> Optional[List[int]]:
    """Megatron's reading of ``config.moe_layer_freq`` (1 = MoE layer, 0 = dense), or
    ``None`` when every layer is MoE (or the config has no experts).

    Raises:
        ValueError: a list of the wrong length or with entries other than 0 and 1.
    """
    if not getattr(config, "num_moe_experts", None):
        return None
    freq, layers = config.moe_layer_freq, config.num_layers
    if isinstance(freq, int):  # Megatron: one MoE layer every freq layers, starting with the first
        pattern = [int(i % freq == 0) for i in range(layers)]
    else:
        pattern = list(freq)
        if len(pattern) != layers or any(p not in (0, 1) for p in pattern):
            raise ValueError(f"moe_layer_freq: {freq!r} is not a list of {layers} zeros and ones")
    return None if all(pattern) else pattern


def _per_layer(spec, layers: int) -> List[ModuleSpec]:
    if isinstance(spec, TransformerBlockSubmodules):
        if len(spec.layer_specs) != layers:
            raise ValueError(f"spec: a block of {len(spec.layer_specs)} layers, expected {layers}")
        return list(spec.layer_specs)
    return [spec] * layers


def _final_norm(spec):
    if isinstance(spec, TransformerBlockSubmodules):
        return spec.layer_norm
    return spec.submodules.input_layernorm  # the local spec's norm class, as Megatron's block uses


def mix_dense_and_moe(config, dense, moe, pattern: List[int]) -> TransformerBlockSubmodules:
    """The block spec of this pipeline stage: layer ``i`` from ``moe`` where ``pattern[i]`` is 1,
    from ``dense`` where it is 0.

    Args:
        config: the ``TransformerConfig`` (its pipeline layout picks this stage's layers).
        dense, moe: each a layer ``ModuleSpec`` (every layer alike) or a full-depth
            ``TransformerBlockSubmodules`` (e.g. a GDN / attention hybrid pattern).
        pattern: :func:`moe_layer_pattern` of ``config``.
    """
    layers = config.num_layers
    dense_layers, moe_layers = _per_layer(dense, layers), _per_layer(moe, layers)
    specs = [moe_layers[i] if p else dense_layers[i] for i, p in enumerate(pattern)]
    if config.pipeline_model_parallel_size > 1:
        # GPTModel takes a block spec as given: keep only the layers this pipeline stage builds
        offset = get_transformer_layer_offset(config)
        specs = specs[offset:offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=_final_norm(dense))
