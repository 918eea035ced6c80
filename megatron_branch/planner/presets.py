"""Model and GPU presets for the capacity planner (public model cards / datasheets)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class ModelSpec:
    """The dimensions memory and FLOPs depend on (Llama/Qwen-style decoder)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    head_dim: Optional[int] = None
    tied_embeddings: bool = False

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def params_per_layer(self) -> int:
        h, d = self.hidden_size, self.kv_channels
        attn = h * self.num_attention_heads * d + 2 * h * self.num_kv_heads * d + self.num_attention_heads * d * h
        return attn + 3 * h * self.ffn_hidden_size + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def num_params(self) -> int:
        return self.num_layers * self.params_per_layer() + self.embedding_params() + self.hidden_size


@dataclass(frozen=True)
class GPUSpec:
    """Memory (GB, 1e9 bytes) and dense peak TFLOPs."""

    name: str
    memory_gb: float
    bf16_tflops: float
    fp8_tflops: float


MODELS: Dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256),
        ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064),
        ModelSpec("Qwen3-8B", 36, 4096, 32, 8, 12288, 151936, head_dim=128),
        ModelSpec("Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064),
        ModelSpec("Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064),
    )
}

GPUS: Dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("H20", 96.0, 148.0, 296.0),
        GPUSpec("H100", 80.0, 989.0, 1979.0),
        GPUSpec("H200", 141.0, 989.0, 1979.0),
    )
}


def model_from_hf_config(path: str) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face ``config.json``.

    Raises:
        ValueError: a required field is missing.
    """
    with open(path) as f:
        cfg = json.load(f)
    need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"{path}: config.json lacks {', '.join(missing)}")
    return ModelSpec(
        name=cfg.get("_name_or_path") or cfg.get("model_type", "hf-model"),
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        ffn_hidden_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        head_dim=cfg.get("head_dim"), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
