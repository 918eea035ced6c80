"""FLOP estimates of a forward+backward step (matmul work only).

Per layer and token: QKV, output projection and MLP GEMMs; per visible (query, key)
pair and layer: ``QK^T`` and ``PV``; plus the output layer per position. Backward is
counted as twice the forward (3x in all), as in the usual ``6 N`` rule. Hybrid models
(Gated DeltaNet layers) count their layers' projections per token and attention pairs
in the attention layers only; the delta-rule recurrence (``O(heads * d_k * d_v)`` per
token, linear in the length) is left out, like the norms.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The dimensions FLOPs depend on."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    gated: bool = True
    # hybrid models: layers with attention (pairs count there only; None = all) and the
    # matmul parameters of all decoder layers (None = num_layers x the attention layer's)
    attention_layers: "int | None" = None
    decoder_linear_params: "int | None" = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def linear_params_per_layer(self) -> int:
        h, kv = self.hidden_size, self.num_query_groups * self.head_dim
        qkv = h * (h + 2 * kv)
        proj = h * h
        mlp = h * self.ffn_hidden_size * (3 if self.gated else 2)
        return qkv + proj + mlp

    @classmethod
    def from_config(cls, config, vocab_size: int) -> "ModelShape":
        return cls(
            config.num_layers, config.hidden_size, config.num_attention_heads,
            config.num_query_groups or config.num_attention_heads, config.ffn_hidden_size,
            vocab_size, bool(config.gated_linear_unit),
        )


def step_flops(shape: ModelShape, positions: float, attention_pairs: float) -> dict:
    """``{"linear", "attention", "total"}`` FLOPs of forward+backward.

    Args:
        shape: the model.
        positions: token positions run through the model.
        attention_pairs: (query, key) pairs scored, summed over the batch.
    """
    decoder = (shape.decoder_linear_params if shape.decoder_linear_params is not None
               else shape.num_layers * shape.linear_params_per_layer())
    linear = 3 * 2 * positions * (decoder + shape.hidden_size * shape.vocab_size)
    layers = shape.attention_layers if shape.attention_layers is not None else shape.num_layers
    attention = 3 * 4 * attention_pairs * shape.head_dim * shape.num_attention_heads * layers
    return {"linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def causal_pairs(length: int) -> int:
    """Visible pairs of a causal sequence."""
    return length * (length + 1) // 2
