"""Mask-free tree attention: dense pieces per segment, merged by log-sum-exp.

Our own code: Megatron-Core has no tree attention. For every segment ``s`` of the
packed tree (a chain ``[start, end)`` whose subtree ends at ``subtree_end``):

* its own tokens attend to its own keys causally (a square causal piece), and
* every token of its descendants — the contiguous range ``[end, subtree_end)`` —
  attends to its keys with no mask (a rectangular piece).

Each query's pieces are merged by log-sum-exp; the backward of every piece is the
standard flash-attention backward given the *merged* output and log-sum-exp, summed
over pieces (as ring attention does). The cost is exactly the tree's attention work.
Pieces are tiled to at most ``q_block`` queries (and ``k_block`` keys for kernels that
materialise scores), which bounds the working memory; no ``U x U`` tensor is built.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from megatron_branch.attention.kernels import KERNELS
from megatron_branch.attention.pieces import (  # noqa: F401 - re-exported
    AttentionPiece,
    PieceBatch,
    plan_batches,
    plan_pieces,
    tile_rect,
)
from megatron_branch.attention.prefix import merge, merge_rows, prefix_backward, prefix_forward


class CascadeAttentionFunction(torch.autograd.Function):
    """Autograd function of :func:`cascade_attention` (saves q, k, v, the path K/V, merged
    out and lse). Pieces run in batches of equal shape (:func:`plan_batches`)."""

    @staticmethod
    def forward(ctx, q, k, v, batches, scale, kernel, blocks, prefix_cp, *prefix):
        fwd, _ = KERNELS[kernel]
        rep = q.shape[1] // k.shape[1]
        # GQA: repeat the (local, short) K/V heads so every piece is a plain attention.
        ke = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        ve = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        n, h, d = q.shape
        out = torch.zeros(n, h, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((h, n), float("-inf"), dtype=torch.float32, device=q.device)
        for b in batches:
            qb, kb, vb = _gather(q, b.q_index), _gather(ke, b.k_index), _gather(ve, b.k_index)
            o, l = fwd(qb, kb, vb, b.causal, scale)  # [B, nq, h, d], [B, h, nq]
            merge_rows(out, lse, b.rows.to(q.device), o[b.valid], l.transpose(1, 2)[b.valid])
        q_block, k_block = blocks
        if prefix:
            o, l = prefix_forward(q, prefix[0], prefix[1], scale, fwd, q_block, k_block, prefix_cp)
            merge(out, lse, 0, n, o, l)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        # The path K/V are rows of the prefix cache, which later stems write beyond them;
        # held by reference (the rows this graph reads never change while it lives).
        ctx.prefix = prefix
        ctx.batches, ctx.scale, ctx.kernel, ctx.rep, ctx.blocks = batches, scale, kernel, rep, blocks
        ctx.prefix_cp = prefix_cp
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        prefix = ctx.prefix
        _, bwd = KERNELS[ctx.kernel]
        rep = ctx.rep
        ke = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        ve = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(ke.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(ve.shape, dtype=torch.float32, device=q.device)
        lse_rows = lse.transpose(0, 1)  # [n, h]
        for b in ctx.batches:
            valid = b.valid.to(q.device)
            # padded queries: no output gradient and an infinite lse, so they move nothing
            do = _gather(dout, b.q_index) * valid[..., None, None]
            lb = torch.where(valid[..., None], _gather(lse_rows, b.q_index), float("inf")).transpose(1, 2)
            gq, gk, gv = bwd(do, _gather(q, b.q_index), _gather(ke, b.k_index), _gather(ve, b.k_index),
                             _gather(out, b.q_index), lb.contiguous(), b.causal, ctx.scale)
            dq.index_add_(0, b.rows.to(q.device), gq[valid].float())
            k_rows = b.k_index.reshape(-1).to(q.device)
            dk.index_add_(0, k_rows, gk.reshape(-1, *gk.shape[2:]).float())
            dv.index_add_(0, k_rows, gv.reshape(-1, *gv.shape[2:]).float())
        if rep > 1:
            # [n, h, d] -> [n, hk, rep, d] -> sum over the repeated heads
            dk = dk.view(dk.shape[0], -1, rep, dk.shape[-1]).sum(2)
            dv = dv.view(dv.shape[0], -1, rep, dv.shape[-1]).sum(2)
        prefix_grads = []
        if prefix:
            pk, pv = prefix
            q_block, k_block = ctx.blocks
            gq, gk, gv = prefix_backward(dout, q, out, lse, pk, pv, ctx.scale, bwd, q_block, k_block, ctx.prefix_cp)
            dq += gq
            prefix_grads = [gk.to(pk.dtype), gv.to(pv.dtype)]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, *prefix_grads)


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """Rows ``index [B, m]`` of ``x [n, ...]`` as ``[B, m, ...]``."""
    return x.index_select(0, index.reshape(-1).to(x.device)).view(*index.shape, *x.shape[1:])


def cascade_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pieces: Sequence[Union[AttentionPiece, PieceBatch]],
    scale: float,
    kernel: str = "flash_cpu",
    prefix: Optional[Tuple[Tensor, Tensor]] = None,
    q_block: Optional[int] = None,
    k_block: Optional[int] = None,
    prefix_cp=None,
) -> Tensor:
    """Tree attention of a packed sequence from its pieces.

    Args:
        q: ``[U, heads, head_dim]`` queries (after RoPE).
        k: ``[U, kv_heads, head_dim]`` keys (after RoPE); ``heads % kv_heads == 0``.
        v: ``[U, kv_heads, head_dim]`` values.
        pieces: from :func:`plan_pieces` (or already batched by :func:`plan_batches`);
            every query needs at least one piece or a prefix.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        kernel: a name in :data:`megatron_branch.attention.kernels.KERNELS`.
        prefix: the cached ``(k [P, kv_heads, d], v)`` of the path that *every* query
            sees unmasked (streaming replay's ancestors, :mod:`megatron_branch.attention.path_cache`);
            one piece however many stems it holds (:mod:`megatron_branch.attention.prefix`).
            Gradients flow to these tensors.
        q_block, k_block: tile sizes for the prefix piece.
        prefix_cp: the unit's :class:`~megatron_branch.attention.context_parallel.CPLayout` when the
            path K/V are sharded over context-parallel ranks (the prefix attention is then
            computed where the keys live and merged across ranks).

    Returns:
        ``[U, heads, head_dim]`` attention output, same dtype as ``q``.
    """
    flat = list(prefix) if prefix is not None else []
    batches = [p for p in pieces if isinstance(p, PieceBatch)]
    if len(batches) != len(pieces):
        batches = plan_batches(pieces)
    return CascadeAttentionFunction.apply(q, k, v, batches, scale, kernel, (q_block, k_block), prefix_cp, *flat)
