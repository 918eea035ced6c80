"""Tree attention in Megatron's ``core_attention`` slot.

Our own code (Megatron-Core has no tree attention). Fills
``SelfAttentionSubmodules.core_attention`` with the constructor and call contract of
Megatron's ``DotProductAttention``, so the linear layers around it (and with them TE's
FP8 GEMMs) are untouched.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

from torch import Tensor

from megatron_branch._megatron import AttnMaskType, MegatronModule, TransformerConfig
from megatron_branch.attention.cascade import cascade_attention
from megatron_branch.attention.context_parallel import gather_rows
from megatron_branch.attention.dense import dense_tree_attention
from megatron_branch.attention.kernels import KERNELS, default_kernel, top_left_causal
from megatron_branch.attention.path_cache import inject
from megatron_branch.attention.plain import masked_attention, thd_attention, unmasked_attention
from megatron_branch.attention.repeat_kv import repeated_kv_attention
from megatron_branch.attention.varlen import VARLEN_KERNELS
from megatron_branch.attention.varlen_cascade import varlen_cascade_attention
from megatron_branch.spec.packed_seq import BranchPackedSeqParams

# The math kernel materialises a [heads, q, k] float32 score block per piece; without a
# chunk_size its pieces are tiled to this many queries and keys (8 MiB per head).
MATH_TILE = 1024

Backend = Literal["cascade", "dense", "repeat_kv"]
BACKENDS = ("cascade", "dense", "repeat_kv")


class BranchCoreAttention(MegatronModule):
    """Each packed token attends to exactly its ancestors-or-self in the tree.

    Backends:

    * ``"cascade"`` (default): mask-free pieces per segment merged by log-sum-exp
      (:mod:`megatron_branch.attention.cascade`); cost = the tree's attention work,
      working memory bounded by ``chunk_size`` queries per piece.
    * ``"dense"``: a ``[U, U]`` boolean mask and plain softmax; O(U^2) memory; reference.
    * ``"repeat_kv"``: per segment, one SDPA call over a copy of its ancestors' K/V
      (the Prefix-Grouper-style baseline; single pass only).

    Without tree data (``packed_seq_params`` not a :class:`BranchPackedSeqParams`) the
    layer computes what Megatron's local ``DotProductAttention`` computes — explicit masks,
    every ``AttnMaskType``, a query block after cached keys — and THD-packed batches, which
    the stock local attention refuses (:mod:`megatron_branch.attention.plain`). So a model
    built with the branch spec also serves pretraining, SFT packing, eval and inference.

    Args:
        config: the model's TransformerConfig (``attention_dropout`` must be 0).
        layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
            cp_comm_type, pg_collection: as for Megatron's ``DotProductAttention``.
        k_channels, v_channels: query/key and value head sizes where they differ from
            ``config.kv_channels`` (multi-latent attention passes both, as to TE's attention).
        backend: ``"cascade"`` or ``"dense"``.
        chunk_size: most queries per cascade piece (``None``: whole segments; the ``math``
            kernel then tiles queries and keys to :data:`MATH_TILE`). The varlen kernels
            hold no scores and run whole segments.
        kernel: ``"flash_varlen"`` / ``"efficient_varlen"`` (a tree in ``1 + depth`` varlen
            calls, :mod:`megatron_branch.attention.varlen_cascade`), or a piece kernel
            ``"flash_cpu"``, ``"flash_cuda"``, ``"math"``; default by device and dtype
            (:func:`~megatron_branch.attention.kernels.default_kernel`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        backend: Backend = "cascade",
        chunk_size: Optional[int] = None,
        kernel: Optional[str] = None,
    ):
        super().__init__(config=config)
        if backend not in BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
        if kernel is not None and kernel not in KERNELS and kernel not in VARLEN_KERNELS:
            raise ValueError(f"kernel: {kernel!r} is not one of {tuple(KERNELS) + tuple(VARLEN_KERNELS)}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size: must be a positive number of tokens, got {chunk_size}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"attention_dropout: branch replay is exact only without dropout, got {dropout}"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type: only 'vanilla' is supported, got {config.softmax_type!r}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("window_size: sliding-window attention is not supported in a tree")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.backend = backend
        self.chunk_size = chunk_size
        self.kernel = kernel
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        head_dim = self.k_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        """Attention over a packed tree, or over an ordinary batch.

        Args:
            query: ``[sq, b, heads, head_dim]`` after RoPE (local heads under TP);
                ``[t, heads, head_dim]`` for THD packing.
            key, value: ``[sk, b, kv_heads, head_dim]`` (``[t, kv_heads, head_dim]``);
                the value's head size may differ (``v_head_dim`` of multi-latent attention).
            attention_mask: ignored with tree data (the tree defines visibility); else a
                bool mask broadcastable to ``[b, 1, sq, sk]``, True = masked out.
            attn_mask_type: overrides the constructor's mask type for this call.
            packed_seq_params: a :class:`BranchPackedSeqParams` (then ``b == 1``), a THD
                ``PackedSeqParams``, or None.

        Returns:
            ``[sq, b, heads * v_head_dim]`` (``[t, heads * v_head_dim]`` for THD).

        Raises:
            ValueError: an attention bias, a malformed mask or ``cu_seqlens``, or an
                ordinary batch under context parallelism.
        """
        if attention_bias is not None:
            raise ValueError("attention_bias: not supported by tree attention")
        if not isinstance(packed_seq_params, BranchPackedSeqParams):
            return self._plain(query, key, value, attention_mask, attn_mask_type, packed_seq_params)
        s, b = query.shape[:2]
        if b != 1:
            raise ValueError(f"query: a packed tree has batch size 1, got {b}")
        params = packed_seq_params
        cache = params.cache
        if params.stem_id is not None:
            # Streaming replay: this forward is a stem; cache its chain's K/V (after RoPE).
            lo, hi = params.local
            rows = max(0, min(hi, params.cached_rows) - lo)  # this rank's tokens of the chain
            cache.record(self.layer_number, key, value, rows, params.stem_id)
            if params.inject:
                key, value = inject(key, value, cache, self.layer_number, params.stem_id)
        prefix = cache.prefix(self.layer_number) if cache is not None and cache.has_path else None
        q, k, v = query[:, 0], key[:, 0], value[:, 0]  # [s, 1, h, d] -> [s, h, d]
        if params.cp is not None:
            if self.backend != "cascade":
                raise ValueError(f"backend: context parallelism needs 'cascade', got {self.backend!r}")
            # [n_local, hk, d] -> [n_unit, hk, d]: keys of every shard this rank's queries see
            k, v = gather_rows(k, params.cp), gather_rows(v, params.cp)
        if self.backend == "repeat_kv":
            if prefix is not None:
                raise ValueError("backend: 'repeat_kv' does not support streaming replay")
            out = repeated_kv_attention(q, k, v, params.segments, self.softmax_scale)
        elif self.backend == "dense":
            out = dense_tree_attention(q, k, v, params.last, self.softmax_scale, prefix=prefix)
        elif (kernel := self.kernel or default_kernel(q.device, q.dtype)) in VARLEN_KERNELS:
            calls = params.varlen_calls(k.shape[0], q.device)
            out = varlen_cascade_attention(q, k, v, calls, self.softmax_scale, kernel, prefix=prefix,
                                           prefix_cp=params.cp)
        else:
            q_block, k_block = self._blocks(kernel)
            pieces = params.batches(q_block, k_block, q.device, fuse=top_left_causal(kernel))
            out = cascade_attention(
                q, k, v, pieces, self.softmax_scale, kernel, prefix=prefix,
                q_block=q_block, k_block=k_block, prefix_cp=params.cp,
            )
        # [s, h, d] -> [s, 1, h * d]
        return out.reshape(s, 1, -1)

    def _blocks(self, kernel: str):
        """(queries, keys) per piece: ``chunk_size`` for both on kernels that materialise
        scores (``math``, bounded by :data:`MATH_TILE` by default), queries only otherwise."""
        if kernel == "math":
            tile = self.chunk_size or MATH_TILE
            return tile, tile
        return self.chunk_size, None

    def _plain(self, query, key, value, attention_mask, attn_mask_type, packed_seq_params) -> Tensor:
        if self.config.context_parallel_size > 1:
            raise ValueError(
                "context_parallel_size: the branch spec splits only trees over context-parallel ranks; "
                "pass the batch as a BranchTree (rollout_logprobs / replay_step / pipeline), or use "
                "Megatron's Transformer Engine spec for ordinary sequences under CP"
            )
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        fmt = getattr(packed_seq_params, "qkv_format", None) if packed_seq_params is not None else None
        if fmt == "thd":
            if attention_mask is not None:
                raise ValueError("attention_mask: THD packing takes no mask (cu_seqlens defines the sequences)")
            kernel = self.kernel or default_kernel(query.device, query.dtype)
            q_block, k_block = self._blocks(kernel)
            return thd_attention(query, key, value, packed_seq_params, mask_type, self.softmax_scale, kernel,
                                 q_block, k_block)
        if fmt not in (None, "sbhd"):
            raise ValueError(f"packed_seq_params.qkv_format: {fmt!r} is not supported (use 'sbhd' or 'thd')")
        if attention_mask is not None:
            return masked_attention(query, key, value, attention_mask, self.softmax_scale)
        return unmasked_attention(query, key, value, mask_type, self.softmax_scale)
