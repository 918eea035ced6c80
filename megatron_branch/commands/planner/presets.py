"""Model and GPU presets for the capacity planner (public model cards / datasheets)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class ModelSpec:
    """The dimensions memory and FLOPs depend on (Llama/Qwen-style decoder, dense or MoE).

    Attributes:
        ffn_hidden_size: the SwiGLU width one token runs through: the dense MLP's, or for
            a Mixture of Experts ``experts_per_token x moe_ffn_hidden_size`` (what sets a
            token's activations and FLOPs).
        num_experts: routed experts per layer (0: dense).
        experts_per_token: top-k.
        moe_ffn_hidden_size: one expert's SwiGLU width.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    head_dim: Optional[int] = None
    tied_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden_size: int = 0

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size",
                     "vocab_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{self.name}: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{self.name}: hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}; give head_dim")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"{self.name}: experts_per_token {self.experts_per_token} must be in "
                             f"[1, num_experts {self.num_experts}]")
        if self.num_experts and self.ffn_hidden_size != self.experts_per_token * self.moe_ffn_hidden_size:
            raise ValueError(f"{self.name}: ffn_hidden_size of a MoE is experts_per_token x moe_ffn_hidden_size "
                             f"({self.experts_per_token * self.moe_ffn_hidden_size}), got {self.ffn_hidden_size}")

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def _attention_params(self) -> int:
        h, d = self.hidden_size, self.kv_channels
        return h * self.num_attention_heads * d + 2 * h * self.num_kv_heads * d + self.num_attention_heads * d * h

    def active_params_per_layer(self) -> int:
        """Parameters one token runs through (a MoE's router and its top-k experts)."""
        h = self.hidden_size
        router = self.num_experts * h
        return self._attention_params() + router + 3 * h * self.ffn_hidden_size + 2 * h

    def expert_params_per_layer(self) -> int:
        """Routed experts' parameters (sharded over expert parallelism); 0 for a dense model."""
        return self.num_experts * 3 * self.hidden_size * self.moe_ffn_hidden_size

    def dense_params_per_layer(self) -> int:
        """Everything but the routed experts (sharded over tensor parallelism)."""
        if not self.is_moe:
            return self.params_per_layer()
        return self.active_params_per_layer() - 3 * self.hidden_size * self.ffn_hidden_size

    def params_per_layer(self) -> int:
        if self.is_moe:
            return self.dense_params_per_layer() + self.expert_params_per_layer()
        return self.active_params_per_layer()

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def num_params(self) -> int:
        return self.num_layers * self.params_per_layer() + self.embedding_params() + self.hidden_size

    def active_params(self) -> int:
        """Parameters per token (equals :meth:`num_params` for a dense model)."""
        return self.num_layers * self.active_params_per_layer() + self.embedding_params() + self.hidden_size


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
        # Qwen3-30B-A3B: 128 experts of width 768, top-8 (30.5B total, 3.3B active)
        ModelSpec("Qwen3-30B-A3B", 48, 2048, 32, 4, 8 * 768, 151936, head_dim=128, num_experts=128,
                  experts_per_token=8, moe_ffn_hidden_size=768),
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
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    moe = {}
    if experts:  # Qwen3-MoE (moe_intermediate_size) or Mixtral (intermediate_size per expert)
        width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        topk = cfg["num_experts_per_tok"]
        moe = dict(num_experts=experts, experts_per_token=topk, moe_ffn_hidden_size=width)
    return ModelSpec(
        name=cfg.get("_name_or_path") or cfg.get("model_type", "hf-model"),
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        ffn_hidden_size=moe["experts_per_token"] * moe["moe_ffn_hidden_size"] if moe else cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"], head_dim=cfg.get("head_dim"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), **moe,
    )
