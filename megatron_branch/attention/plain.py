"""Attention for batches without tree data, with the stock local spec's semantics.

A model built with the branch spec also serves ordinary batches (pretraining, SFT, eval,
inference). For every input Megatron's local ``DotProductAttention`` accepts, the result
here is the same, computed with torch's fused SDPA kernels instead of a materialised
``[b, h, sq, sk]`` score tensor:

* an explicit boolean ``attention_mask`` (True = masked out) broadcastable to
  ``[b, 1 or heads, sq, sk]`` is applied as given, whatever the mask type. A query row
  whose keys are all masked gets the plain mean of the values, as the stock softmax over
  scores filled with -10000 gives (and no gradient to its query or the keys);
* without a mask, ``AttnMaskType.causal`` (and ``causal_bottom_right``) is causal, aligned
  to the bottom right when ``sq != sk`` (a query block after cached keys, as in
  Megatron's inference: query ``i`` sees keys ``j <= i + sk - sq``); ``padding``,
  ``no_mask`` and ``arbitrary`` attend to every key; ``padding_causal`` without a mask is
  refused (the stock local attention would not mask at all).

THD packing (``PackedSeqParams(qkv_format="thd")``, tensors ``[t, heads, d]``), which the
stock local spec refuses, is computed exactly: each sequence ``[cu_seqlens[i],
cu_seqlens[i+1])`` attends to itself only, causally for the causal mask types, as
mask-free cascade pieces on the tree path's kernels (no ``[t, t]`` mask). Megatron's
RoPE restarts at 0 in every THD sequence; that is the stock ``SelfAttention``'s own code.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_branch._megatron import AttnMaskType
from megatron_branch.attention.cascade import AttentionPiece, cascade_attention, plan_batches, plan_pieces, tile_rect
from megatron_branch.attention.varlen import VARLEN_KERNELS
from megatron_branch.attention.varlen_cascade import varlen_calls, varlen_cascade_attention
from megatron_branch.tree import BranchSegment

CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.causal_bottom_right, AttnMaskType.padding_causal)


def _bhsd(x: Tensor) -> Tensor:
    # [s, b, h, d] -> [b, h, s, d]
    return x.permute(1, 2, 0, 3)


def check_mask(mask: Tensor, b: int, h: int, sq: int, sk: int) -> Tensor:
    """``mask`` as a bool tensor broadcastable to ``[b, h, sq, sk]``, or ``ValueError``."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        kind = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask: must be a bool tensor (True = masked out), got {kind}")
    if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, h) \
            or tuple(mask.shape[2:]) != (sq, sk):
        raise ValueError(
            f"attention_mask: shape {tuple(mask.shape)} does not broadcast to [b, 1, sq, sk] = "
            f"[{b}, 1, {sq}, {sk}]"
        )
    return mask


def masked_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of ``[sq, b, h, d]`` queries under an explicit bool mask; ``[sq, b, h * d]``."""
    sq, b, h, d = query.shape
    sk, hk = key.shape[0], key.shape[2]
    mask = check_mask(mask, b, h, sq, sk)
    empty = mask.all(-1, keepdim=True)  # [mb, mh, sq, 1]: rows with no visible key
    q, k, v = _bhsd(query), _bhsd(key), _bhsd(value)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask | empty, scale=scale, enable_gqa=hk != h)
    if bool(empty.any()):
        # stock: every score of the row is -10000, so the softmax is uniform over the keys
        mean = v.mean(dim=2, keepdim=True)  # [b, hk, 1, d]
        if hk != h:
            mean = mean.repeat_interleave(h // hk, dim=1)
        out = torch.where(empty, mean, out)
    # [b, h, sq, d] -> [sq, b, h * d]
    return out.permute(2, 0, 1, 3).reshape(sq, b, h * v.shape[-1])


def unmasked_attention(query: Tensor, key: Tensor, value: Tensor, mask_type: Optional[AttnMaskType],
                       scale: float) -> Tensor:
    """Attention without a mask, by mask type (see the module docstring); ``[sq, b, h * d]``."""
    sq, b, h, d = query.shape
    sk, hk = key.shape[0], key.shape[2]
    q, k, v = _bhsd(query), _bhsd(key), _bhsd(value)
    if mask_type == AttnMaskType.padding_causal:
        raise ValueError(
            "attention_mask: AttnMaskType.padding_causal needs the padding mask (the stock local "
            "attention would attend to every key without it); pass attention_mask or use causal"
        )
    if mask_type in CAUSAL_TYPES and sq > 1:
        if sq > sk:
            raise ValueError(f"query: {sq} queries but only {sk} keys under a causal mask")
        if sq == sk:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=hk != h)
        else:  # bottom-right: query i sees keys j <= i + sk - sq
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=hk != h)
    else:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=hk != h)
    # [b, h, sq, d] -> [sq, b, h * d]
    return out.permute(2, 0, 1, 3).reshape(sq, b, h * v.shape[-1])


def thd_pieces(packed_seq_params, total: int, causal: bool, q_block: Optional[int] = None,
               k_block: Optional[int] = None) -> List[AttentionPiece]:
    """The pieces of every non-empty THD sequence (tiled to ``q_block`` x ``k_block``),
    after checking ``cu_seqlens``."""
    p = packed_seq_params
    cu = p.cu_seqlens_q
    if cu is None:
        raise ValueError("packed_seq_params.cu_seqlens_q: THD packing needs cu_seqlens_q")
    if p.cu_seqlens_kv is not None and not torch.equal(p.cu_seqlens_kv.cpu(), cu.cpu()):
        raise ValueError("packed_seq_params.cu_seqlens_kv: must equal cu_seqlens_q in self-attention")
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        padded = getattr(p, name, None)
        if padded is not None and not torch.equal(padded.cpu(), cu.cpu()):
            raise ValueError(
                f"packed_seq_params.{name}: padded THD layouts are not supported by the branch spec; "
                "put the padding in a sequence of its own (as Megatron-RL's bins do)"
            )
    bounds = [int(x) for x in cu.cpu().tolist()]
    if cu.dim() != 1 or len(bounds) < 2 or bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"packed_seq_params.cu_seqlens_q: must start at 0 and never decrease, got {bounds}")
    if bounds[-1] != total:
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q: ends at {bounds[-1]} but the packed batch has {total} tokens; "
            "every token must belong to a sequence"
        )
    spans = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    if causal:
        return plan_pieces([BranchSegment(lo, hi, hi, -1) for lo, hi in spans], q_block, k_block)
    pieces: List[AttentionPiece] = []
    for lo, hi in spans:
        tile_rect(lo, hi, lo, hi, q_block or hi - lo, k_block or hi - lo, pieces)
    return pieces


# The varlen calls of a THD batch, planned by its first layer and reused by the others:
# checking and reading cu_seqlens on the host is a device sync, once per batch, not per layer.
# Keyed by the params object's id while it lives (a PackedSeqParams is not hashable).
_THD_CALLS: Dict[tuple, Tuple[weakref.ref, list]] = {}


def _thd_calls(params, t: int, causal: bool, device) -> list:
    key = (id(params), t, causal, str(device))
    hit = _THD_CALLS.get(key)
    if hit is not None and hit[0]() is params:
        return hit[1]
    calls = varlen_calls(thd_pieces(params, t, causal), t, t, device)
    _THD_CALLS[key] = (weakref.ref(params), calls)
    weakref.finalize(params, _THD_CALLS.pop, key, None)
    return calls


def thd_attention(query: Tensor, key: Tensor, value: Tensor, packed_seq_params, mask_type: Optional[AttnMaskType],
                  scale: float, kernel: str, q_block: Optional[int] = None, k_block: Optional[int] = None) -> Tensor:
    """Per-sequence attention of THD-packed ``[t, heads, d]`` tensors; returns ``[t, heads * d]``."""
    if query.dim() != 3:
        raise ValueError(f"query: THD packing expects [t, heads, head_dim], got {tuple(query.shape)}")
    t, h, _ = query.shape
    causal = mask_type is None or mask_type in CAUSAL_TYPES
    if kernel in VARLEN_KERNELS:  # the sequences as they are: one call
        calls = _thd_calls(packed_seq_params, t, causal, query.device)
        return varlen_cascade_attention(query, key, value, calls, scale, kernel).reshape(t, -1)
    pieces = thd_pieces(packed_seq_params, t, causal, q_block, k_block)
    batches = plan_batches(pieces, q_block * k_block if q_block and k_block else None, num_rows=t)
    out = cascade_attention(query, key, value, batches, scale, kernel)
    # [t, h, d] -> [t, h * d]
    return out.reshape(t, -1)
