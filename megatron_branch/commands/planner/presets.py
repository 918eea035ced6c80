"""Model and GPU presets for the capacity planner (public model cards / datasheets)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class ModelSpec:
    """The dimensions memory and FLOPs depend on (Llama/Qwen/DeepSeek-style decoder, dense or MoE).

    Attributes:
        ffn_hidden_size: the SwiGLU width one token runs through: the dense MLP's, or for
            a Mixture of Experts ``experts_per_token x moe_ffn_hidden_size`` plus
            ``shared_expert_ffn_hidden_size`` (what sets a token's activations and FLOPs).
        num_experts: routed experts per layer (0: dense).
        experts_per_token: top-k.
        moe_ffn_hidden_size: one expert's SwiGLU width.
        shared_expert_ffn_hidden_size: the always-active shared experts' SwiGLU width
            (DeepSeek: ``n_shared_experts x moe_intermediate_size``; split over TP like a dense MLP).
        first_dense_layers: MoE models whose first layers have a dense MLP instead
            (DeepSeek's ``first_k_dense_replace``), of width ``ffn_hidden_size``, so that a
            token's activations are the same in every layer (DeepSeek-V3: 18432 = (8 + 1) x 2048).
        kv_lora_rank: multi-latent attention (DeepSeek-V2/V3) when > 0: the K/V latent width.
            ``num_kv_heads`` must then equal ``num_attention_heads``: branch replay caches
            each head's uncompressed K and V, not the latent.
        q_lora_rank: MLA's query latent width (0: a full-rank query projection).
        qk_head_dim, qk_pos_emb_head_dim, v_head_dim: MLA's per-head widths (Megatron's
            names): the query/key head is ``qk_head_dim + qk_pos_emb_head_dim`` wide (the RoPE
            part of the key is one vector shared by all heads), the value head ``v_head_dim``.
        attention_output_gate: the attention's query projection also gives a per-head gate
            (Qwen3-Next, Qwen3.5: ``sigmoid(gate) * attention output``; Megatron's name): one
            more ``heads x head_dim`` columns of the query projection.
        linear_attention_pattern: hybrid Gated DeltaNet models (Qwen3-Next, Qwen3.5): one
            entry per layer, 1 for a Gated DeltaNet layer, 0 for an attention layer (Megatron's
            per-layer ``linear_attention_freq`` list; HF's ``layer_types``). Empty: every layer
            is attention. A Gated DeltaNet layer has no K/V; its recurrent state and its
            convolution window take their place (:mod:`.memory`).
        linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
            linear_conv_kernel_dim: the Gated DeltaNet layers' widths (HF's and Megatron's
            names): query/key heads of ``linear_key_head_dim``, value heads of
            ``linear_value_head_dim`` (the recurrent state is one ``d_k x d_v`` matrix per
            value head; queries and keys are repeated to the value heads), and a causal
            depthwise convolution of ``linear_conv_kernel_dim`` taps over the q, k, v channels.
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
    shared_expert_ffn_hidden_size: int = 0
    first_dense_layers: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    attention_output_gate: bool = False
    linear_attention_pattern: Tuple[int, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

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
        active = self.experts_per_token * self.moe_ffn_hidden_size + self.shared_expert_ffn_hidden_size
        if self.num_experts and self.ffn_hidden_size != active:
            shared = " + shared_expert_ffn_hidden_size" if self.shared_expert_ffn_hidden_size else ""
            raise ValueError(f"{self.name}: ffn_hidden_size of a MoE is experts_per_token x moe_ffn_hidden_size"
                             f"{shared} ({active}), got {self.ffn_hidden_size}")
        if not self.num_experts and (self.shared_expert_ffn_hidden_size or self.first_dense_layers):
            raise ValueError(f"{self.name}: shared_expert_ffn_hidden_size and first_dense_layers need num_experts")
        if not 0 <= self.first_dense_layers < self.num_layers:
            raise ValueError(f"{self.name}: first_dense_layers {self.first_dense_layers} must be in "
                             f"[0, num_layers {self.num_layers})")
        if self.is_mla:
            for name in ("qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{self.name}: multi-latent attention (kv_lora_rank > 0) needs {name} >= 1")
            if self.num_kv_heads != self.num_attention_heads:
                raise ValueError(f"{self.name}: multi-latent attention caches one K/V head per query head: "
                                 f"num_kv_heads {self.num_kv_heads} must equal num_attention_heads "
                                 f"{self.num_attention_heads}")
            if self.attention_output_gate:
                raise ValueError(f"{self.name}: attention_output_gate is not modelled with multi-latent attention")
        self._check_gated_delta_net()

    def _check_gated_delta_net(self) -> None:
        gdn = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim")
        pattern = self.linear_attention_pattern
        if not pattern:
            given = [name for name in gdn if getattr(self, name)]
            if given:
                raise ValueError(f"{self.name}: {', '.join(given)} need linear_attention_pattern (which layers are "
                                 "Gated DeltaNet)")
            return
        if len(pattern) != self.num_layers or any(p not in (0, 1) for p in pattern):
            raise ValueError(f"{self.name}: linear_attention_pattern must hold num_layers {self.num_layers} entries "
                             f"of 0 (attention) or 1 (Gated DeltaNet), got {len(pattern)}: {sorted(set(pattern))}")
        for name in gdn:
            if getattr(self, name) < 1:
                raise ValueError(f"{self.name}: Gated DeltaNet layers (linear_attention_pattern) need {name} >= 1")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"{self.name}: linear_num_value_heads {self.linear_num_value_heads} is not a multiple "
                             f"of linear_num_key_heads {self.linear_num_key_heads}")
        if self.is_mla:
            raise ValueError(f"{self.name}: Gated DeltaNet layers beside multi-latent attention are not modelled")

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_hybrid(self) -> bool:
        """Some layers are Gated DeltaNet (:attr:`linear_attention_pattern`)."""
        return any(self.linear_attention_pattern)

    @property
    def gdn_layers(self) -> int:
        """How many layers are Gated DeltaNet."""
        return sum(self.linear_attention_pattern)

    @property
    def attention_layers(self) -> int:
        """How many layers are attention (the only ones holding K/V)."""
        return self.num_layers - self.gdn_layers

    def is_gdn_layer(self, layer: int) -> bool:
        return bool(self.linear_attention_pattern) and self.linear_attention_pattern[layer] == 1

    def stage_mixers(self, pp: int) -> List[Tuple[int, int]]:
        """``(attention, Gated DeltaNet)`` layers of each pipeline stage (``ceil(layers / pp)``
        layers each, as the memory model splits them)."""
        per = -(-self.num_layers // pp)
        out = []
        for stage in range(pp):
            layers = range(stage * per, min((stage + 1) * per, self.num_layers))
            gdn = sum(1 for i in layers if self.is_gdn_layer(i))
            out.append((len(layers) - gdn, gdn))
        return out

    @property
    def gdn_qk_dim(self) -> int:
        """Gated DeltaNet query (and key) width: ``linear_num_key_heads x linear_key_head_dim``."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_v_dim(self) -> int:
        """Gated DeltaNet value (and output gate) width: ``linear_num_value_heads x linear_value_head_dim``."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the causal convolution (q, k and v): ``2 x qk_dim + v_dim``."""
        return 2 * self.gdn_qk_dim + self.gdn_v_dim

    @property
    def gdn_in_proj_dim(self) -> int:
        """Output width of Megatron's ``in_proj`` ``[q; k; v; z; beta; alpha]``:
        ``2 x qk_dim + 2 x v_dim + 2 x linear_num_value_heads``."""
        return 2 * self.gdn_qk_dim + 2 * self.gdn_v_dim + 2 * self.linear_num_value_heads

    def _gdn_params(self) -> int:
        """One Gated DeltaNet mixer: ``in_proj``, the convolution (no bias), ``A_log`` and
        ``dt_bias`` per value head, the gated ``out_norm`` (one value head wide), ``out_proj``."""
        h = self.hidden_size
        return (h * self.gdn_in_proj_dim + self.gdn_conv_dim * self.linear_conv_kernel_dim
                + 2 * self.linear_num_value_heads + self.linear_value_head_dim + self.gdn_v_dim * h)

    def gdn_param_delta(self) -> int:
        """What one Gated DeltaNet layer has more than an attention layer (negative: fewer)."""
        return self._gdn_params() - self._attention_params() if self.is_hybrid else 0

    @property
    def key_channels(self) -> int:
        """Width of one query/key head (MLA: ``qk_head_dim + qk_pos_emb_head_dim``)."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim if self.is_mla else self.kv_channels

    @property
    def value_channels(self) -> int:
        """Width of one value head (MLA: ``v_head_dim``)."""
        return self.v_head_dim if self.is_mla else self.kv_channels

    def _attention_params(self) -> int:
        h, d = self.hidden_size, self.kv_channels
        if not self.is_mla:
            gate = h * self.num_attention_heads * d if self.attention_output_gate else 0
            return (h * self.num_attention_heads * d + 2 * h * self.num_kv_heads * d + self.num_attention_heads * d * h
                    + gate)
        heads, q_rank, kv_rank = self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank
        # q: [q_a_proj, q_a_layernorm, q_b_proj] (or one q_proj); kv_a_proj_with_mqa (latent and the
        # shared RoPE key), kv_a_layernorm, kv_b_proj (per head: key without RoPE, value); o_proj
        q = h * q_rank + q_rank + q_rank * heads * self.key_channels if q_rank else h * heads * self.key_channels
        kv = h * (kv_rank + self.qk_pos_emb_head_dim) + kv_rank + kv_rank * heads * (self.qk_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h

    def active_params_per_layer(self) -> int:
        """Parameters one token runs through (a MoE's router and its top-k experts), in an
        attention layer (a Gated DeltaNet layer differs by its mixer: :meth:`layer_params`)."""
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
        routed = self.ffn_hidden_size - self.shared_expert_ffn_hidden_size
        return self.active_params_per_layer() - 3 * self.hidden_size * routed

    def params_per_layer(self) -> int:
        """One layer's parameters (of a MoE: a MoE layer, not one of the ``first_dense_layers``)."""
        if self.is_moe:
            return self.dense_params_per_layer() + self.expert_params_per_layer()
        return self.active_params_per_layer()

    def first_dense_layer_params(self) -> int:
        """One of the ``first_dense_layers``: attention, a dense MLP of ``ffn_hidden_size``, norms."""
        h = self.hidden_size
        return self._attention_params() + 3 * h * self.ffn_hidden_size + 2 * h

    def layer_params(self, layer: int) -> Tuple[int, int]:
        """``(dense, routed experts)`` parameters of global layer ``layer`` (a Gated DeltaNet
        layer's mixer in place of attention)."""
        mixer = self.gdn_param_delta() if self.is_gdn_layer(layer) else 0
        if layer < self.first_dense_layers:
            return self.first_dense_layer_params() + mixer, 0
        return self.dense_params_per_layer() + mixer, self.expert_params_per_layer()

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def num_params(self) -> int:
        layers = self.num_layers - self.first_dense_layers
        return (layers * self.params_per_layer() + self.first_dense_layers * self.first_dense_layer_params()
                + self.gdn_layers * self.gdn_param_delta() + self.embedding_params() + self.hidden_size)

    def active_params(self) -> int:
        """Parameters per token (equals :meth:`num_params` for a dense model)."""
        layers = self.num_layers - self.first_dense_layers
        return (layers * self.active_params_per_layer() + self.first_dense_layers * self.first_dense_layer_params()
                + self.gdn_layers * self.gdn_param_delta() + self.embedding_params() + self.hidden_size)


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
        # DeepSeek-V3: multi-latent attention (128 heads, query/key heads 128 + 64 RoPE, value
        # heads 128, latents q 1536 / kv 512); 3 dense layers of 18432 then 58 MoE layers of 256
        # experts of 2048, top-8, plus one shared expert (671B total, 37B active; the
        # multi-token-prediction module of the released checkpoint is not counted)
        ModelSpec("DeepSeek-V3", 61, 7168, 128, 128, 8 * 2048 + 2048, 129280, num_experts=256,
                  experts_per_token=8, moe_ffn_hidden_size=2048, shared_expert_ffn_hidden_size=2048,
                  first_dense_layers=3, kv_lora_rank=512, q_lora_rank=1536, qk_head_dim=128,
                  qk_pos_emb_head_dim=64, v_head_dim=128),
        # Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct config.json and module shapes):
        # 48 layers, 3 Gated DeltaNet then 1 gated full-attention layer, repeated
        # (full_attention_interval 4: 36 GDN + 12 attention); attention 16 heads, 2 KV heads of
        # 256 with an output gate (partial RoPE, factor 0.25: no effect on these counts); GDN 16
        # query/key heads and 32 value heads of 128, convolution of 4 taps (8192 channels,
        # in_proj 12288 + 64 wide); a MoE in every layer: 512 experts of 512, top-10, plus one
        # shared expert of 512; vocab 151936, untied. 79.7B parameters (card: 80B; the MTP
        # module, q/k norms and the shared-expert gate are not counted), 3.9B active with the
        # embeddings (card: 3B).
        ModelSpec("Qwen3-Next-80B-A3B", 48, 2048, 16, 2, 10 * 512 + 512, 151936, head_dim=256, num_experts=512,
                  experts_per_token=10, moe_ffn_hidden_size=512, shared_expert_ffn_hidden_size=512,
                  attention_output_gate=True, linear_attention_pattern=(1, 1, 1, 0) * 12, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4),
        # Qwen3.5-397B-A17B (model card: 60 layers as 15 x (3 GDN + 1 gated attention), hidden
        # 4096, attention 32 heads / 2 KV heads of 256, GDN 16 query/key and 64 value heads of
        # 128, 512 experts of 1024, top-10 plus one shared expert of 1024, vocab 248320). The
        # convolution width (4) and the untied embeddings are HF's Qwen3.5 defaults, not read
        # from the released config.json; the vision encoder is not counted. 396.4B parameters
        # (card: 397B), 17.3B active (card: 17B).
        ModelSpec("Qwen3.5-397B-A17B", 60, 4096, 32, 2, 10 * 1024 + 1024, 248320, head_dim=256, num_experts=512,
                  experts_per_token=10, moe_ffn_hidden_size=1024, shared_expert_ffn_hidden_size=1024,
                  attention_output_gate=True, linear_attention_pattern=(1, 1, 1, 0) * 15, linear_num_key_heads=16,
                  linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4),
        # GLM-4.5 (zai-org/GLM-4.5 config.json): 92 layers, hidden 5120, attention 96 heads / 8 KV
        # heads of 128 (partial RoPE, q/k norms and q/k/v biases: no effect on these counts beyond
        # the biases, not counted); 3 dense layers then 89 MoE layers of 160 experts of 1536, top-8,
        # plus one shared expert of 1536; vocab 151552, untied. The dense layers are counted at the
        # MoE layers' active width 13824 (theirs is 12288: +0.05B). 352.9B parameters (card: 355B;
        # the multi-token-prediction layer is not counted), 33.7B active with the embeddings (card: 32B).
        ModelSpec("GLM-4.5", 92, 5120, 96, 8, 8 * 1536 + 1536, 151552, head_dim=128, num_experts=160,
                  experts_per_token=8, moe_ffn_hidden_size=1536, shared_expert_ffn_hidden_size=1536,
                  first_dense_layers=3),
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


GDN_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim")


def _hf_gated_delta_net(path: str, cfg: dict) -> dict:
    """The Gated DeltaNet fields of a Qwen3-Next / Qwen3.5 ``config.json`` (``{}`` for a model
    without linear-attention layers): the per-layer pattern from ``layer_types`` (or, as HF
    builds it without them, attention every ``full_attention_interval``-th layer)."""
    types = cfg.get("layer_types")
    hybrid = any(k in cfg for k in GDN_FIELDS) or (isinstance(types, list) and "linear_attention" in types)
    if not hybrid:
        return {}
    missing = [k for k in GDN_FIELDS if not cfg.get(k)]
    if missing:
        raise ValueError(f"{path}: a Gated DeltaNet config.json lacks {', '.join(missing)}")
    layers = cfg["num_hidden_layers"]
    if types is None:
        interval = cfg.get("full_attention_interval")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{path}: without layer_types, full_attention_interval must be a positive integer, "
                             f"got {interval!r}")
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    unknown = sorted({t for t in types if t not in ("linear_attention", "full_attention")}, key=str)
    if len(types) != layers or unknown:
        raise ValueError(f"{path}: layer_types must list num_hidden_layers {layers} entries of linear_attention "
                         f"or full_attention, got {len(types)}{'; unknown ' + str(unknown) if unknown else ''}")
    # Qwen3-Next's attention is always gated; Qwen3.5 names it attn_output_gate
    gate = bool(cfg.get("attn_output_gate", str(cfg.get("model_type", "")).startswith("qwen3_next")))
    return dict(linear_attention_pattern=tuple(1 if t == "linear_attention" else 0 for t in types),
                attention_output_gate=gate, **{k: int(cfg[k]) for k in GDN_FIELDS})


def model_from_hf_config(path: str) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face ``config.json`` (Llama/Qwen-style, Qwen3-MoE,
    Mixtral, DeepSeek-V3-style multi-latent attention and MoE, Qwen3-Next and Qwen3.5
    Gated DeltaNet hybrids; a multimodal config's ``text_config``).

    Raises:
        ValueError: a required field is missing, or a layout the planner cannot represent.
    """
    with open(path) as f:
        top = json.load(f)
    cfg = top
    if "num_hidden_layers" not in top and isinstance(top.get("text_config"), dict):  # Qwen3.5: a VLM config
        cfg = dict(top["text_config"], _name_or_path=top.get("_name_or_path"))
    need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"{path}: config.json lacks {', '.join(missing)}")
    layers = cfg["num_hidden_layers"]
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    first_dense = int(cfg.get("first_k_dense_replace") or 0) if "n_routed_experts" in cfg else 0
    moe = {}
    if experts and first_dense < layers:  # Qwen3-MoE / DeepSeek (moe_intermediate_size), Mixtral (intermediate_size)
        width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        topk = cfg["num_experts_per_tok"]
        # DeepSeek: n_shared_experts of moe_intermediate_size; Qwen2-MoE / Qwen3-Next: one shared expert
        shared = int(cfg.get("n_shared_experts") or 0) * width or int(cfg.get("shared_expert_intermediate_size") or 0)
        if int(cfg.get("moe_layer_freq", 1)) != 1:
            raise ValueError(f"{path}: moe_layer_freq {cfg['moe_layer_freq']} is not supported (every layer after "
                             "first_k_dense_replace must be MoE)")
        if int(cfg.get("decoder_sparse_step") or 1) != 1 or cfg.get("mlp_only_layers"):
            raise ValueError(f"{path}: decoder_sparse_step {cfg.get('decoder_sparse_step')} / mlp_only_layers "
                             f"{cfg.get('mlp_only_layers')} are not supported (every layer must be MoE)")
        active = topk * width + shared
        if first_dense and cfg["intermediate_size"] != active:
            raise ValueError(f"{path}: the first_k_dense_replace={first_dense} dense layers' intermediate_size "
                             f"{cfg['intermediate_size']} differs from a MoE layer's active width {active} "
                             "(num_experts_per_tok and shared experts x moe_intermediate_size); the planner needs "
                             "them equal")
        moe = dict(num_experts=experts, experts_per_token=topk, moe_ffn_hidden_size=width,
                   shared_expert_ffn_hidden_size=shared, first_dense_layers=first_dense)
    mla = {}
    if cfg.get("kv_lora_rank"):  # DeepSeek-V2/V3: HF's head_dim is then the RoPE part only
        mla = dict(kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=cfg.get("q_lora_rank") or 0,
                   qk_head_dim=cfg["qk_nope_head_dim"], qk_pos_emb_head_dim=cfg["qk_rope_head_dim"],
                   v_head_dim=cfg["v_head_dim"])
    return ModelSpec(
        name=cfg.get("_name_or_path") or cfg.get("model_type", "hf-model"),
        num_layers=layers, hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        ffn_hidden_size=active if moe else cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        head_dim=None if mla else cfg.get("head_dim"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", top.get("tie_word_embeddings", False))), **moe, **mla,
        **_hf_gated_delta_net(path, cfg),
    )
