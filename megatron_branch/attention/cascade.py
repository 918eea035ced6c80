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

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_branch.attention.kernels import KERNELS
from megatron_branch.tree import BranchSegment


@dataclass(frozen=True)
class AttentionPiece:
    """Queries ``[q_lo, q_hi)`` attend to keys ``[k_lo, k_hi)``; causal pieces are square."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool


def tile_rect(q_lo, q_hi, k_lo, k_hi, q_block, k_block, out):
    for qs in range(q_lo, q_hi, q_block):
        for ks in range(k_lo, k_hi, k_block):
            out.append(AttentionPiece(qs, min(qs + q_block, q_hi), ks, min(ks + k_block, k_hi), False))


def _tile_causal(lo, hi, q_block, k_block, out):
    block = min(q_block, k_block)
    for qs in range(lo, hi, block):
        qe = min(qs + block, hi)
        if qs > lo:
            tile_rect(qs, qe, lo, qs, q_block, k_block, out)
        out.append(AttentionPiece(qs, qe, qs, qe, True))


def plan_pieces(
    segments: Sequence[BranchSegment], q_block: Optional[int] = None, k_block: Optional[int] = None
) -> List[AttentionPiece]:
    """The attention pieces of a packed tree.

    Args:
        segments: the tree's segments (``BranchTree.segments``).
        q_block: most queries per piece (``None``: unbounded).
        k_block: most keys per piece (``None``: unbounded).

    Returns:
        Pieces that cover every visible (query, key) pair exactly once.
    """
    big = 1 << 62
    qb, kb = q_block or big, k_block or big
    pieces: List[AttentionPiece] = []
    for seg in segments:
        _tile_causal(seg.start, seg.end, qb, kb, pieces)
        if seg.subtree_end > seg.end:
            tile_rect(seg.end, seg.subtree_end, seg.start, seg.end, qb, kb, pieces)
    return pieces


def _merge(out: Tensor, lse: Tensor, q_lo: int, q_hi: int, o: Tensor, l: Tensor) -> None:
    """Fold a piece's (o [n, h, d], l [h, n]) into the running out [U, h, d] / lse [h, U]."""
    acc_l = lse[:, q_lo:q_hi]
    new_l = torch.logaddexp(acc_l, l)
    # [h, n] -> [n, h, 1]
    w_acc = torch.exp(acc_l - new_l).transpose(0, 1).unsqueeze(-1)
    w_new = torch.exp(l - new_l).transpose(0, 1).unsqueeze(-1)
    acc_o = out[q_lo:q_hi]
    acc_o.mul_(w_acc).add_(o.float() * w_new)
    lse[:, q_lo:q_hi] = new_l


def _fold(x: Tensor, groups: int) -> Tensor:
    """GQA without repeating K/V: ``[n, hk * rep, d] -> [rep * n, hk, d]`` (query heads of a
    KV group become extra query rows; exact for unmasked attention)."""
    n, h, d = x.shape
    # [n, hk, rep, d] -> [hk, rep, n, d] -> [hk, rep * n, d] -> [rep * n, hk, d]
    return x.view(n, groups, h // groups, d).permute(1, 2, 0, 3).reshape(groups, -1, d).transpose(0, 1)


def _unfold_out(o: Tensor, n: int) -> Tensor:
    # [rep * n, hk, d] -> [hk, rep, n, d] -> [n, hk, rep, d] -> [n, h, d]
    r_n, hk, d = o.shape
    return o.transpose(0, 1).reshape(hk, r_n // n, n, d).permute(2, 0, 1, 3).reshape(n, -1, d)


def _unfold_lse(l: Tensor, n: int) -> Tensor:
    # [hk, rep * n] -> [h, n]
    return l.reshape(-1, n)


def _fold_lse(l: Tensor, groups: int) -> Tensor:
    # [h, n] -> [hk, rep * n]
    return l.reshape(groups, -1)


def _blocks(lo: int, hi: int, block: Optional[int]):
    step = block or max(hi - lo, 1)
    return [(s, min(s + step, hi)) for s in range(lo, hi, step)]


class CascadeAttentionFunction(torch.autograd.Function):
    """Autograd function of :func:`cascade_attention` (saves q, k, v, prefix, merged out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, pieces, scale, kernel, blocks, *prefix):
        fwd, _ = KERNELS[kernel]
        rep = q.shape[1] // k.shape[1]
        # GQA: repeat the (local, short) K/V heads so every piece is a plain attention.
        ke = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        ve = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        n, h, d = q.shape
        out = torch.zeros(n, h, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((h, n), float("-inf"), dtype=torch.float32, device=q.device)
        fresh = torch.ones(n, dtype=torch.bool)  # queries no piece has written yet
        for p in pieces:
            o, l = fwd(q[p.q_lo:p.q_hi], ke[p.k_lo:p.k_hi], ve[p.k_lo:p.k_hi], p.causal, scale)
            if bool(fresh[p.q_lo:p.q_hi].all()):  # first piece of these queries: no merge
                out[p.q_lo:p.q_hi] = o
                lse[:, p.q_lo:p.q_hi] = l
                fresh[p.q_lo:p.q_hi] = False
            else:
                _merge(out, lse, p.q_lo, p.q_hi, o, l)
        q_block, k_block = blocks
        groups = k.shape[1]
        for pk, pv in zip(prefix[0::2], prefix[1::2]):
            for qs, qe in _blocks(0, n, q_block):
                qf = _fold(q[qs:qe], groups)
                for ks, ke_ in _blocks(0, pk.shape[0], k_block):
                    o, l = fwd(qf, pk[ks:ke_], pv[ks:ke_], False, scale)
                    _merge(out, lse, qs, qe, _unfold_out(o, qe - qs), _unfold_lse(l, qe - qs))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *prefix)
        ctx.pieces, ctx.scale, ctx.kernel, ctx.rep, ctx.blocks = pieces, scale, kernel, rep, blocks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *prefix = ctx.saved_tensors
        _, bwd = KERNELS[ctx.kernel]
        rep = ctx.rep
        ke = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        ve = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(ke.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(ve.shape, dtype=torch.float32, device=q.device)
        for p in ctx.pieces:
            qs, ks = slice(p.q_lo, p.q_hi), slice(p.k_lo, p.k_hi)
            gq, gk, gv = bwd(dout[qs], q[qs], ke[ks], ve[ks], out[qs], lse[:, qs], p.causal, ctx.scale)
            dq[qs] += gq
            dk[ks] += gk
            dv[ks] += gv
        if rep > 1:
            # [n, h, d] -> [n, hk, rep, d] -> sum over the repeated heads
            dk = dk.view(dk.shape[0], -1, rep, dk.shape[-1]).sum(2)
            dv = dv.view(dv.shape[0], -1, rep, dv.shape[-1]).sum(2)
        prefix_grads = []
        q_block, k_block = ctx.blocks
        groups, n = k.shape[1], q.shape[0]
        for pk, pv in zip(prefix[0::2], prefix[1::2]):
            gk_all = torch.zeros(pk.shape, dtype=torch.float32, device=q.device)
            gv_all = torch.zeros(pv.shape, dtype=torch.float32, device=q.device)
            for qs, qe in _blocks(0, n, q_block):
                qf, of, dof = (_fold(x[qs:qe], groups) for x in (q, out, dout))
                lf = _fold_lse(lse[:, qs:qe], groups)
                for ks, ke_ in _blocks(0, pk.shape[0], k_block):
                    gq, gk, gv = bwd(dof, qf, pk[ks:ke_], pv[ks:ke_], of, lf, False, ctx.scale)
                    dq[qs:qe] += _unfold_out(gq, qe - qs)
                    gk_all[ks:ke_] += gk
                    gv_all[ks:ke_] += gv
            prefix_grads += [gk_all.to(pk.dtype), gv_all.to(pv.dtype)]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, *prefix_grads)


def cascade_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pieces: Sequence[AttentionPiece],
    scale: float,
    kernel: str = "flash_cpu",
    prefix: Sequence[Tuple[Tensor, Tensor]] = (),
    q_block: Optional[int] = None,
    k_block: Optional[int] = None,
) -> Tensor:
    """Tree attention of a packed sequence from its pieces.

    Args:
        q: ``[U, heads, head_dim]`` queries (after RoPE).
        k: ``[U, kv_heads, head_dim]`` keys (after RoPE); ``heads % kv_heads == 0``.
        v: ``[U, kv_heads, head_dim]`` values.
        pieces: from :func:`plan_pieces`; every query needs at least one piece or a prefix.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        kernel: a name in :data:`megatron_branch.attention.kernels.KERNELS`.
        prefix: cached ``(k [P_i, kv_heads, d], v)`` pairs that *every* query sees
            unmasked (the ancestors held in a prefix-activation cache). GQA is handled by
            folding query heads into rows, so the prefix is never repeated or copied;
            gradients flow to these tensors.
        q_block, k_block: tile sizes for the prefix pieces.

    Returns:
        ``[U, heads, head_dim]`` attention output, same dtype as ``q``.
    """
    flat = [t for pair in prefix for t in pair]
    return CascadeAttentionFunction.apply(q, k, v, list(pieces), scale, kernel, (q_block, k_block), *flat)
