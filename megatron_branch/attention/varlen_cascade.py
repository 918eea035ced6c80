"""Tree attention as a few varlen kernel calls (the CUDA path's cascade).

Our own code: Megatron-Core has no tree attention. The pieces of a packed tree
(:func:`~megatron_branch.attention.pieces.plan_pieces` without ``fuse``: every segment's
causal square, and its descendants' rectangle on its keys) are grouped into calls of the
varlen contract (:mod:`megatron_branch.attention.varlen`): pieces whose query ranges and
key ranges are both disjoint and in order are sequences of one call. Every segment's
square lies on the diagonal, so all squares are one causal call; the rectangles of the
segments of one tree depth are disjoint and ordered, so each depth is one unmasked call
(:func:`plan_calls`): ``1 + depth`` calls per layer, whatever the number of segments (the
headline tree, a prompt and its answers, is two). Gaps between a call's pieces are
sequences without keys (rows) or without queries (keys), so every call reads the packed
``q``/``k``/``v`` as they are, no gather and no copy.

The calls' ``(out, lse)`` are merged by log-sum-exp (:func:`~megatron_branch.attention.prefix.merge`),
the cached path of streaming replay is one more piece (:mod:`megatron_branch.attention.prefix`,
through :func:`~megatron_branch.attention.varlen.piece_kernel`), and the backward runs
every call's backward given the *merged* output and log-sum-exp, summed (as ring
attention does). Under context parallelism the pieces are this rank's (clipped to its
queries, keys of the gathered unit: a cut square is a smaller square and a rectangle).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_branch.attention.pieces import AttentionPiece
from megatron_branch.attention.prefix import merge, prefix_backward, prefix_forward
from megatron_branch.attention.varlen import (
    VarlenCall,
    check_inputs,
    lse_for_merge,
    piece_kernel,
    varlen_backward,
    varlen_forward,
)


def plan_calls(pieces: Sequence[AttentionPiece], num_q: int, num_k: int) -> List[List[AttentionPiece]]:
    """Group ``pieces`` into calls: the pieces of a call have the same masking and
    disjoint, increasing query and key ranges (greedy, in query order: each piece joins
    the first call it fits). Causal pieces must be squares (``plan_pieces`` without
    ``fuse``; context parallelism's clipped pieces are), where the pieces' top-left
    alignment and the contract's bottom-right one agree."""
    calls: List[List[AttentionPiece]] = []
    for p in sorted(pieces, key=lambda p: (p.q_lo, p.k_lo)):
        if p.q_hi <= p.q_lo or p.k_hi <= p.k_lo:
            continue
        if p.causal and p.q_hi - p.q_lo != p.k_hi - p.k_lo:
            # pieces align causal masks top-left, the varlen contract bottom-right: equal on squares only
            raise ValueError(f"pieces: causal piece {p} is not square; plan the pieces without fuse for varlen kernels")
        if p.q_hi > num_q or p.k_hi > num_k:
            raise ValueError(f"pieces: {p} lies outside {num_q} query and {num_k} key rows")
        for call in calls:
            last = call[-1]
            if last.causal == p.causal and last.q_hi <= p.q_lo and last.k_hi <= p.k_lo:
                call.append(p)
                break
        else:
            calls.append([p])
    return calls


def spans(call: Sequence[AttentionPiece], num_q: int, num_k: int) -> List[Tuple[int, int, int, int]]:
    """The call's sequences ``(q_lo, q_hi, k_lo, k_hi)``: its pieces, with the gaps before,
    between and after them as sequences without keys (query rows) or without queries (keys)."""
    out: List[Tuple[int, int, int, int]] = []
    q_at = k_at = 0
    for p in call:
        if p.q_lo > q_at:
            out.append((q_at, p.q_lo, k_at, k_at))
        if p.k_lo > k_at:
            out.append((p.q_lo, p.q_lo, k_at, p.k_lo))
        out.append((p.q_lo, p.q_hi, p.k_lo, p.k_hi))
        q_at, k_at = p.q_hi, p.k_hi
    if q_at < num_q:
        out.append((q_at, num_q, k_at, k_at))
    if k_at < num_k:
        out.append((num_q, num_q, k_at, num_k))
    return out


def varlen_calls(pieces: Sequence[AttentionPiece], num_q: int, num_k: int, device=None) -> List[VarlenCall]:
    """The pieces as :class:`~megatron_branch.attention.varlen.VarlenCall` s on ``device``."""
    return [VarlenCall.from_spans(spans(c, num_q, num_k), c[0].causal, num_q, num_k, device)
            for c in plan_calls(pieces, num_q, num_k)]


class VarlenCascadeFunction(torch.autograd.Function):
    """Autograd function of :func:`varlen_cascade_attention` (saves q, k, v, the merged
    output and log-sum-exp, and the path K/V)."""

    @staticmethod
    def forward(ctx, q, k, v, calls, scale, kernel, prefix_cp, *prefix):
        n, h, _ = q.shape
        out = torch.zeros((n, h, v.shape[-1]), dtype=torch.float32, device=q.device)
        lse = torch.full((h, n), float("-inf"), dtype=torch.float32, device=q.device)
        for call in calls:
            o, call_lse = varlen_forward(kernel, q, k, v, call, scale)  # [n, h, dv], [h, n]
            merge(out, lse, 0, n, o, lse_for_merge(call_lse))
        if prefix:
            o, path_lse = prefix_forward(q, prefix[0], prefix[1], scale, piece_kernel(kernel)[0], None, None,
                                         prefix_cp)
            merge(out, lse, 0, n, o, path_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        # the path K/V are rows of the prefix cache (held by reference, as in cascade.py)
        ctx.prefix, ctx.calls, ctx.scale, ctx.kernel, ctx.prefix_cp = prefix, calls, scale, kernel, prefix_cp
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for call in ctx.calls:
            gq, gk, gv = varlen_backward(ctx.kernel, dout, q, k, v, out, lse, call, ctx.scale)
            dq += gq
            dk += gk
            dv += gv
        prefix_grads = []
        if ctx.prefix:
            pk, pv = ctx.prefix
            gq, gk, gv = prefix_backward(dout, q, out, lse, pk, pv, ctx.scale, piece_kernel(ctx.kernel)[1], None,
                                         None, ctx.prefix_cp)
            dq += gq
            prefix_grads = [gk.to(pk.dtype), gv.to(pv.dtype)]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, *prefix_grads)


def varlen_cascade_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    calls: Sequence[VarlenCall],
    scale: float,
    kernel: str = "flash_varlen",
    prefix: Optional[Tuple[Tensor, Tensor]] = None,
    prefix_cp=None,
) -> Tensor:
    """Tree attention of a packed sequence in a few varlen calls.

    Args:
        q: ``[n, heads, head_dim]`` queries (after RoPE; this rank's under CP).
        k: ``[m, kv_heads, head_dim]`` keys (after RoPE; the gathered unit under CP).
        v: ``[m, kv_heads, v_head_dim]`` values.
        calls: from :func:`varlen_calls` on the unit's pieces; every query needs a key in
            some call or in ``prefix``.
        scale: softmax scale.
        kernel: ``"flash_varlen"`` or ``"efficient_varlen"``.
        prefix: the cached path ``(k [P, kv_heads, d], v)`` every query sees (streaming
            replay); gradients flow to it.
        prefix_cp: the unit's CP layout when the path K/V are sharded over CP ranks.

    Returns:
        ``[n, heads, v_head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: a kernel, dtype or head size the kernel cannot run.
    """
    check_inputs(kernel, q, k, v)
    flat = list(prefix) if prefix is not None else []
    return VarlenCascadeFunction.apply(q, k, v, list(calls), scale, kernel, prefix_cp, *flat)
