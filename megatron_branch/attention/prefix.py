"""Attention of a unit's queries to the cached path K/V (streaming replay): every query
sees every cached key, unmasked.

Our own code. One piece for the whole path, whatever the number of stems on it, tiled
to ``q_block`` x ``k_block``. GQA folds the query heads of a KV group into extra query
rows, so the cache is never repeated or copied.

Under context parallelism the path's K/V stay sharded where they were computed: the
unit's queries are all-gathered, every rank attends them to its own rows, and the
partial ``(out, lse)`` are merged across ranks by log-sum-exp (an all-reduce of the
``[heads, n]`` maxima and sums, a reduce-scatter of the weighted outputs). The backward
computes each rank's ``dK``/``dV`` where its rows live (no K/V ever moves) and
reduce-scatters the ``dQ`` partials. Per chunk and layer this moves
``O(chunk x heads x head_dim)``, never the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_branch.attention.context_parallel import all_gather_rows, reduce_scatter_rows

if TYPE_CHECKING:
    from megatron_branch.attention.context_parallel import CPLayout


def blocks(lo: int, hi: int, block: Optional[int]):
    step = block or max(hi - lo, 1)
    return [(s, min(s + step, hi)) for s in range(lo, hi, step)]


def _one_tile(n: int, keys: int, q_block: Optional[int], k_block: Optional[int]) -> bool:
    """The prefix piece is a single ``q_block`` x ``k_block`` tile over a non-empty path."""
    return n > 0 and keys > 0 and (q_block is None or n <= q_block) and (k_block is None or keys <= k_block)


def fold(x: Tensor, groups: int) -> Tensor:
    """GQA without repeating K/V: ``[n, hk * rep, d] -> [rep * n, hk, d]`` (query heads of a
    KV group become extra query rows; exact for unmasked attention)."""
    n, h, d = x.shape
    # [n, hk, rep, d] -> [hk, rep, n, d] -> [hk, rep * n, d] -> [rep * n, hk, d]
    return x.view(n, groups, h // groups, d).permute(1, 2, 0, 3).reshape(groups, -1, d).transpose(0, 1)


def unfold_out(o: Tensor, n: int) -> Tensor:
    # [rep * n, hk, d] -> [hk, rep, n, d] -> [n, hk, rep, d] -> [n, h, d]
    r_n, hk, d = o.shape
    return o.transpose(0, 1).reshape(hk, r_n // n, n, d).permute(2, 0, 1, 3).reshape(n, -1, d)


def unfold_lse(l: Tensor, n: int) -> Tensor:
    # [hk, rep * n] -> [h, n]
    return l.reshape(-1, n)


def fold_lse(l: Tensor, groups: int) -> Tensor:
    # [h, n] -> [hk, rep * n]
    return l.reshape(groups, -1)


def merge(out: Tensor, lse: Tensor, q_lo: int, q_hi: int, o: Tensor, l: Tensor) -> None:
    """Fold a piece's ``(o [n, h, d], l [h, n])`` into the running ``out [U, h, d]`` /
    ``lse [h, U]`` (float32, in place); rows still at ``-inf`` take the piece as is."""
    acc_l = lse[:, q_lo:q_hi]
    new_l = torch.logaddexp(acc_l, l)
    empty = torch.isinf(new_l) & (new_l < 0)
    safe = torch.where(empty, torch.zeros_like(new_l), new_l)
    # [h, n] -> [n, h, 1]
    w_acc = torch.exp(acc_l - safe).transpose(0, 1).unsqueeze(-1)
    w_new = torch.exp(l - safe).transpose(0, 1).unsqueeze(-1)
    acc_o = out[q_lo:q_hi]
    acc_o.mul_(w_acc).add_(o.float() * w_new)
    lse[:, q_lo:q_hi] = new_l


def local_forward(q: Tensor, pk: Tensor, pv: Tensor, scale: float, fwd, q_block, k_block) -> Tuple[Tensor, Tensor]:
    """``(out [n, h, d] float32, lse [h, n])`` of ``q`` on the path rows held here
    (``lse = -inf`` where there are none)."""
    n, h, _ = q.shape
    groups = pk.shape[1]
    if _one_tile(n, pk.shape[0], q_block, k_block):
        # the usual case: one kernel call, nothing to merge (a small unit's fixed cost)
        o, l = fwd(fold(q, groups), pk, pv, False, scale)
        return unfold_out(o, n).float(), unfold_lse(l, n).float()
    out = torch.zeros(n, h, pv.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((h, n), float("-inf"), dtype=torch.float32, device=q.device)
    for qs, qe in blocks(0, n, q_block) if pk.shape[0] else []:
        qf = fold(q[qs:qe], groups)
        for ks, ke in blocks(0, pk.shape[0], k_block):
            o, l = fwd(qf, pk[ks:ke], pv[ks:ke], False, scale)
            merge(out, lse, qs, qe, unfold_out(o, qe - qs), unfold_lse(l, qe - qs))
    return out, lse


def local_backward(dout, q, out, lse, pk, pv, scale, bwd, q_block, k_block) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dq [n, h, d], dk [P, hk, d], dv)`` float32 given the *merged* ``out``/``lse``."""
    n = q.shape[0]
    groups = pk.shape[1]
    if _one_tile(n, pk.shape[0], q_block, k_block):
        gq, gk, gv = bwd(fold(dout, groups), fold(q, groups), pk, pv, fold(out, groups),
                         fold_lse(lse, groups), False, scale)
        return unfold_out(gq, n).float(), gk.float(), gv.float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(pk.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(pv.shape, dtype=torch.float32, device=q.device)
    for qs, qe in blocks(0, n, q_block) if pk.shape[0] else []:
        qf, of, dof = (fold(x[qs:qe], groups) for x in (q, out, dout))
        lf = fold_lse(lse[:, qs:qe], groups)
        for ks, ke in blocks(0, pk.shape[0], k_block):
            gq, gk, gv = bwd(dof, qf, pk[ks:ke], pv[ks:ke], of, lf, False, scale)
            dq[qs:qe] += unfold_out(gq, qe - qs)
            dk[ks:ke] += gk
            dv[ks:ke] += gv
    return dq, dk, dv


def prefix_forward(q, pk, pv, scale, fwd, q_block, k_block, cp: Optional["CPLayout"] = None):
    """The path attention of this rank's queries: ``(out [n_local, h, d], lse [h, n_local])``."""
    if cp is None or cp.size == 1:
        return local_forward(q, pk, pv, scale, fwd, q_block, k_block)
    q_all = all_gather_rows(q.contiguous(), cp)  # [n_unit, h, d]
    o, l = local_forward(q_all, pk, pv, scale, fwd, q_block, k_block)
    m = l.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=cp.group)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # no key anywhere: weights stay 0
    s = torch.exp(l - m)
    dist.all_reduce(s, group=cp.group)
    total = m + torch.log(s)
    w = torch.exp(l - total).nan_to_num(0.0)  # [h, n_unit]
    # [n_unit, h, d] weighted by [h, n_unit] -> summed over ranks, this rank's rows
    out = reduce_scatter_rows(o * w.transpose(0, 1).unsqueeze(-1), cp)
    lo, hi = cp.local
    return out, total[:, lo:hi].contiguous()


def prefix_backward(dout, q, out, lse, pk, pv, scale, bwd, q_block, k_block, cp: Optional["CPLayout"] = None):
    """``(dq [n_local, h, d], dk [P_local, hk, d], dv)`` float32."""
    if cp is None or cp.size == 1:
        return local_backward(dout, q, out, lse, pk, pv, scale, bwd, q_block, k_block)
    q_all, do_all, o_all = (all_gather_rows(x.contiguous(), cp) for x in (q, dout, out))
    # [h, n_local] -> [n_local, h] rows -> [h, n_unit]
    lse_all = all_gather_rows(lse.transpose(0, 1).contiguous(), cp).transpose(0, 1).contiguous()
    dq_all, dk, dv = local_backward(do_all, q_all, o_all, lse_all, pk, pv, scale, bwd, q_block, k_block)
    return reduce_scatter_rows(dq_all, cp), dk, dv
