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

from megatron_branch.attention.kernels import KERNELS, takes_gqa
from megatron_branch.attention.pieces import (  # noqa: F401 - re-exported
    AttentionPiece,
    PieceBatch,
    plan_batches,
    plan_pieces,
    tile_rect,
)
from megatron_branch.attention.prefix import merge, prefix_backward, prefix_forward


class CascadeAttentionFunction(torch.autograd.Function):
    """Autograd function of :func:`cascade_attention` (saves q, k, v, the path K/V, merged
    out and lse). Pieces run in batches of equal shape (:func:`plan_batches`); every
    piece's ``(out, lse)`` is kept and all are merged at once (:func:`_merge`)."""

    @staticmethod
    def forward(ctx, q, k, v, batches, scale, kernel, blocks, prefix_cp, *prefix):
        fwd, _ = KERNELS[kernel]
        # GQA: the CPU flash kernel groups the heads itself; for the others repeat the
        # (local, short) K/V heads so every piece is a plain attention.
        rep = 1 if takes_gqa(kernel) else q.shape[1] // k.shape[1]
        ke = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        ve = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        n, h, _ = q.shape
        outs, lses, dests = [], [], []
        for b in batches:
            qb, kb, vb = _rows(q, b, True), _rows(ke, b, False), _rows(ve, b, False)
            o, lse_b = fwd(qb, kb, vb, b.causal, scale)  # [B, nq, h, d], [B, h, nq]
            outs.append(o.reshape(-1, h, o.shape[-1]))
            lses.append(lse_b.transpose(1, 2).reshape(-1, h))
            dests.append(b.dest)
        q_block, k_block = blocks
        if prefix:
            o, lse_p = prefix_forward(q, prefix[0], prefix[1], scale, fwd, q_block, k_block, prefix_cp)
            outs.append(o)
            lses.append(lse_p.transpose(0, 1))
            dests.append(torch.arange(n, device=q.device))
        rows = _rows_once(n, batches, outs, lses, dests)
        if rows is not None:
            out, lse = _merge_two(*rows, outs[-1], lses[-1]) if prefix else (rows[0], rows[1].transpose(0, 1))
        else:
            merged = _merge_runs(n, batches, outs, lses)
            if merged is None:
                out, lse = _merge(n, outs, lses, dests)
            else:
                out, lse = merged
                if prefix:
                    merge(out, lse, 0, n, outs[-1], lses[-1].transpose(0, 1))
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
        n = q.shape[0]
        lse_rows = lse.transpose(0, 1)  # [n, h]
        if len(ctx.batches) == 1 and _in_order(ctx.batches[0], n, ke.shape[0]):
            # one call over every row and key, in order: its gradients are the whole ones
            b = ctx.batches[0]
            lb = _rows(lse_rows, b, True).transpose(1, 2).contiguous()  # [1, h, n]
            gq, gk, gv = bwd(_rows(dout, b, True), _rows(q, b, True), _rows(ke, b, False), _rows(ve, b, False),
                             _rows(out, b, True), lb, b.causal, ctx.scale)
            dq, dk, dv = gq.reshape(q.shape).float(), gk.reshape(ke.shape).float(), gv.reshape(ve.shape).float()
        else:
            dq, dk, dv = _batch_grads(ctx.batches, bwd, dout, q, ke, ve, out, lse_rows, ctx.scale)
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


def _batch_grads(batches, bwd, dout, q, ke, ve, out, lse_rows, scale) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dq [n, h, d], dk, dv)`` float32: every batch's backward, added into its rows."""
    n = q.shape[0]
    # One spare row at n for padded entries: zero dO (and zero out, infinite lse, so
    # P = 0): a padded query moves no gradient anywhere.
    spare = lambda x, fill: torch.cat([x, x.new_full((1, *x.shape[1:]), fill)])  # noqa: E731
    padded = any(b.view is None for b in batches)
    dout_x, out_x = (spare(dout, 0.0), spare(out, 0.0)) if padded else (dout, out)
    lse_x = spare(lse_rows, float("inf")) if padded else lse_rows
    dq = torch.zeros((n + 1, *q.shape[1:]), dtype=torch.float32, device=q.device)
    dk = torch.zeros(ke.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(ve.shape, dtype=torch.float32, device=q.device)
    for b in batches:
        lb = _out_rows(lse_x, b).transpose(1, 2).contiguous()  # [B, h, nq]
        gq, gk, gv = bwd(_out_rows(dout_x, b), _rows(q, b, True), _rows(ke, b, False), _rows(ve, b, False),
                         _out_rows(out_x, b), lb, b.causal, scale)
        if b.view is not None:  # disjoint strided rows: add in place
            _rows(dq, b, True).add_(gq)
            _rows(dk, b, False).add_(gk)
            _rows(dv, b, False).add_(gv)
            continue
        dq.index_add_(0, b.dest, gq.reshape(-1, *gq.shape[2:]).float())
        k_rows = b.k_index.reshape(-1)
        dk.index_add_(0, k_rows, gk.reshape(-1, *gk.shape[2:]).float())
        dv.index_add_(0, k_rows, gv.reshape(-1, *gv.shape[2:]).float())
    return dq[:n], dk, dv


def _strided(x: Tensor, lo: int, step: int, count: int, width: int) -> Tensor:
    """Rows ``[lo + b * step, + width)`` of ``x [n, ...]`` for ``b < count`` as a
    ``[count, width, ...]`` view."""
    s0 = x.stride(0)
    return x.as_strided((count, width, *x.shape[1:]), (step * s0, s0, *x.stride()[1:]), x.storage_offset() + lo * s0)


def _rows(x: Tensor, b: PieceBatch, queries: bool) -> Tensor:
    """The batch's query (or key) rows of ``x`` as ``[B, m, ...]``: a view where the
    batch is strided, else a gather."""
    index = b.q_index if queries else b.k_index
    if b.view is not None:
        q_lo, q_step, k_lo, k_step = b.view
        lo, step = (q_lo, q_step) if queries else (k_lo, k_step)
        return _strided(x, lo, step, *index.shape)
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def _out_rows(x: Tensor, b: PieceBatch) -> Tensor:
    """Per-query rows (``dO``, ``O``, lse) of the batch's entries, the spare row for padding."""
    if b.view is not None:
        return _rows(x, b, True)
    return x.index_select(0, b.dest).view(*b.q_index.shape, *x.shape[1:])


def _in_order(b: PieceBatch, n: int, num_keys: Optional[int] = None) -> bool:
    """The batch's entries are exactly the query rows ``0..n-1`` in order (and, given
    ``num_keys``, the key rows ``0..num_keys-1``): a view of the whole tensors."""
    if b.view is None or b.num_valid != n:
        return False
    q_lo, q_step, k_lo, k_step = b.view
    in_order = q_lo == 0 and q_step == b.q_index.shape[1]
    if num_keys is not None:
        in_order = in_order and k_lo == 0 and k_step == b.k_index.shape[1] and b.k_index.numel() == num_keys
    return in_order


def _rows_once(n: int, batches: Sequence[PieceBatch], outs, lses, dests) -> Optional[Tuple[Tensor, Tensor]]:
    """``(out [n, h, d] float32, lse [n, h])`` in row order when the batches cover every
    query row exactly once, else ``None`` (the general log-sum-exp merge is needed).

    That is the case when every batch is causal: a causal piece is a segment's own square,
    segments are disjoint, and every row lies in one; rectangles (descendants reading an
    ancestor's keys, or a tiled square) cover rows a second time. Streaming's leaf chunks
    and chains without branches are such units: their pieces need no merge, only the
    path's prefix piece (:func:`_merge_two`). The row count is checked, not assumed.
    """
    if not batches or not all(b.causal and b.num_valid >= 0 for b in batches):
        return None
    if sum(b.num_valid for b in batches) != n:
        return None
    pieces = len(batches)
    o, lse = outs[:pieces], lses[:pieces]
    if pieces == 1 and _in_order(batches[0], n):
        return o[0].float(), lse[0].float()  # rows 0..n-1 in order already
    h, d = o[0].shape[1], o[0].shape[2]
    dest = torch.cat(dests[:pieces])
    # padded entries all write to the spare row n, which is dropped
    out = torch.empty((n + 1, h, d), dtype=torch.float32, device=o[0].device)
    out.index_copy_(0, dest, torch.cat([x.float() for x in o]))
    lse_rows = torch.empty((n + 1, h), dtype=torch.float32, device=o[0].device)
    lse_rows.index_copy_(0, dest, torch.cat([x.float() for x in lse]))
    return out[:n], lse_rows[:n]


def _runs(batches: Sequence[PieceBatch]) -> Optional[list]:
    """The row range ``[lo, hi)`` of each batch when every batch is a view of consecutive
    query rows (its pieces side by side, no padding), else ``None``."""
    runs = []
    for b in batches:
        if b.view is None:
            return None
        count, width = b.q_index.shape
        q_lo, q_step = b.view[:2]
        if count > 1 and q_step != width:
            return None
        runs.append((q_lo, q_lo + count * width))
    return runs


def _merge_runs(n: int, batches: Sequence[PieceBatch], outs, lses) -> Optional[Tuple[Tensor, Tensor]]:
    """``(out [n, h, d] float32, lse [h, n])`` merged run by run when every batch covers
    consecutive rows (:func:`_runs`; fused pieces make every piece such a run), else
    ``None``. Runs are taken by first row: rows no earlier run reached are copied, the
    rest folded in elementwise by :func:`~megatron_branch.attention.prefix.merge`; no
    scatter, and the piece covering a subtree's rows is copied, not merged."""
    runs = _runs(batches) if batches else None
    if runs is None:
        return None
    order = sorted(range(len(runs)), key=lambda i: (runs[i][0], -runs[i][1]))
    reach = 0
    for i in order:
        if runs[i][0] > reach:  # a row no piece covers: leave it to the general merge
            return None
        reach = max(reach, runs[i][1])
    if reach != n:
        return None
    h, d = outs[0].shape[1:]
    out = torch.empty((n, h, d), dtype=torch.float32, device=outs[0].device)
    lse = torch.empty((h, n), dtype=torch.float32, device=outs[0].device)
    reach = 0
    for i in order:
        lo, hi = runs[i]
        o, l = outs[i], lses[i].transpose(0, 1)  # [m, h, d], [h, m]
        if lo == reach:  # rows no run has reached yet
            out[lo:hi] = o
            lse[:, lo:hi] = l
            reach = hi
            continue
        if hi > reach:  # partly new rows: neutral before the merge (no keys yet)
            out[reach:hi] = 0.0
            lse[:, reach:hi] = float("-inf")
            reach = hi
        merge(out, lse, lo, hi, o, l)
    return out, lse


def _merge_two(out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> Tuple[Tensor, Tensor]:
    """The unit's own pieces ``(out [n, h, d] float32, lse [n, h])``, covering every row once,
    and the prefix piece ``(o, l)`` of the same shapes, merged by the prefix's own
    :func:`~megatron_branch.attention.prefix.merge` (into ``out``):
    ``(out [n, h, d] float32, lse [h, n])``."""
    lse = lse.transpose(0, 1).contiguous()  # [h, n]
    merge(out, lse, 0, out.shape[0], o, l.transpose(0, 1))
    return out, lse


def _merge(n: int, outs, lses, dests) -> Tuple[Tensor, Tensor]:
    """Every piece's ``(o [m, h, d], l [m, h])`` for output rows ``dests [m]`` (repeats
    allowed; row ``n`` is the spare row of padded entries) merged by one log-sum-exp:
    ``(out [n, h, d] float32, lse [h, n])``."""
    o = torch.cat([x.float() for x in outs])
    lse, d = torch.cat([x.float() for x in lses]), torch.cat(dests)
    h = lse.shape[1]
    top = torch.full((n + 1, h), float("-inf"), device=lse.device)
    top = top.scatter_reduce_(0, d[:, None].expand_as(lse), lse, "amax")
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # rows with no key (the spare row)
    w = torch.exp(lse - top.index_select(0, d))  # [m, h]
    total = torch.zeros_like(top).index_add_(0, d, w)
    acc = torch.zeros((n + 1, h, o.shape[-1]), device=o.device).index_add_(0, d, o.mul_(w.unsqueeze(-1)))
    total = total[:n]
    out = acc[:n].div_(total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1))
    return out, (top[:n] + torch.log(total)).transpose(0, 1)


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
        batches = plan_batches(pieces, num_rows=q.shape[0])
    return CascadeAttentionFunction.apply(q, k, v, batches, scale, kernel, (q_block, k_block), prefix_cp, *flat)
