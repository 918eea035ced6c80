"""Hugging Face checkpoints: the mapping, safetensors I/O and the conversion, on CPU.

``model, config = mb.hf.load_gpt_from_hf(hf_dir)`` builds the Megatron GPTModel (branch
spec), loads the weights and returns the model with its ``TransformerConfig``;
``mb.hf.export_hf_state(model, hf_config)`` returns a live model's full
weights under HF names (:mod:`.model`). Mapping rules: :mod:`.mapping` (Mixture-of-Experts
layers, routers and shared experts: :mod:`.moe`; DeepSeek-V3's multi-latent attention:
:mod:`.deepseek`; Qwen3-Next's Gated DeltaNet hybrid: :mod:`.qwen3_next`; Qwen3.5's:
:mod:`.qwen3_5`; GLM-4.5's attention: :mod:`.glm4_moe`); reading and atomic writing: :mod:`.io`; the
dist-checkpoint converter behind ``tools/convert_checkpoint.py``: :mod:`.convert`.
"""

import importlib
from typing import Any

# Public name -> submodule. Imported on first use: the converter checks its inputs with
# .io and .mapping (no megatron-core) before anything imports megatron-core.
_EXPORTS = {
    "build_from_hf_config": "model",
    "export_hf_state": "model",
    "hf_to_megatron": "mapping",
    "load_gpt_from_hf": "model",
    "load_state": "model",
    "megatron_to_hf": "mapping",
    "model_state": "model",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_branch.hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"megatron_branch.hf.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
