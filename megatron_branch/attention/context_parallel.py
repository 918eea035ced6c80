"""Context parallelism for packed trees.

Our own code: Megatron-Core's context parallelism lives inside Transformer Engine's
attention and assumes causal sequences split in a 2·CP zigzag; a tree mask breaks that
balance. Here every CP rank holds the same tree; the packed sequence (or each replay
unit) is cut into ``C`` contiguous shards balanced by *work*: a query at depth ``p``
sees ``p + 1`` keys (its ancestors-or-self), and every token also costs
``linear_weight`` pairs' worth of GEMMs. Each rank runs the model on its shard;
attention is exact across shards:

* ``cp_comm_type="allgather"``: K/V all-gathered in the forward, ``dK/dV`` reduce-scattered
  in the backward (all-reduce + slice over gloo, which has no reduce-scatter);
* ``cp_comm_type="p2p"``: point-to-point transfers of only the K/V shards that hold a
  key visible to some query of the receiving shard (shard pairs with no visible pair
  are skipped), and the matching ``dK/dV`` sent back to the owner.

Per-token log-probs are computed on the rank holding the parent token and all-reduced,
so every CP rank ends with the same differentiable per-rollout log-probs; the
all-reduce's backward is the identity, so each rank's parameter gradients are its
shard's share and Megatron's ``finalize_model_grads`` (DDP over DP x CP) sums them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from megatron_branch.attention.pieces import AttentionPiece

CP_COMM_TYPES = ("allgather", "p2p")

# Bytes this process has sent for context-parallel attention (forward and backward).
_BYTES_SENT = [0]


def comm_bytes(reset: bool = False) -> int:
    """Bytes this rank sent for CP attention since the last reset."""
    value = _BYTES_SENT[0]
    if reset:
        _BYTES_SENT[0] = 0
    return value


def shard_bounds(
    positions: Tensor, cp_size: int, linear_weight: float = 0.0, multiple: int = 1
) -> List[Tuple[int, int]]:
    """Cut ``[0, n)`` into ``cp_size`` contiguous shards of about equal work.

    Args:
        positions: ``[n]`` depth of each packed token (its visible keys minus one,
            counting any cached prefix).
        cp_size: number of shards ``C``.
        linear_weight: per-token linear work in units of one (query, key) pair.
        multiple: every boundary is a multiple of this (sequence parallel needs the
            tensor-parallel size); the last shard takes the remainder.

    Returns:
        ``C`` ``(start, end)`` pairs; none is empty when ``n >= C * multiple``.
    """
    n = positions.numel()
    if cp_size < 1:
        raise ValueError(f"cp_size: must be >= 1, got {cp_size}")
    work = positions.double().cpu().numpy() + 1.0 + linear_weight
    cum = np.concatenate([[0.0], np.cumsum(work)])
    targets = cum[-1] * np.arange(1, cp_size) / cp_size
    cuts = np.searchsorted(cum, targets, side="left")
    cuts = np.round(cuts / multiple).astype(np.int64) * multiple
    if n >= cp_size * multiple:  # keep every shard non-empty
        idx = np.arange(1, cp_size)
        cuts = np.clip(cuts, idx * multiple, n - (cp_size - idx) * multiple)
    cuts = np.clip(np.maximum.accumulate(cuts), 0, n)
    edges = [0] + [int(c) for c in cuts] + [n]
    return [(edges[i], edges[i + 1]) for i in range(cp_size)]


def shard_work(positions: Tensor, bounds: Sequence[Tuple[int, int]]) -> Dict[str, List[float]]:
    """Per-shard tokens and attention work (visible (query, key) pairs)."""
    pairs = (positions.double() + 1.0).cpu()
    return {
        "tokens": [float(e - s) for s, e in bounds],
        "attention_pairs": [float(pairs[s:e].sum()) for s, e in bounds],
    }


def balance_report(positions: Tensor, bounds: Sequence[Tuple[int, int]]) -> str:
    """A printable per-rank table and the max/mean attention-work ratio."""
    work = shard_work(positions, bounds)
    pairs = work["attention_pairs"]
    mean = sum(pairs) / len(pairs)
    lines = [f"{'cp rank':>8s}{'tokens':>10s}{'attention pairs':>18s}"]
    for r, (t, p) in enumerate(zip(work["tokens"], pairs)):
        lines.append(f"{r:>8d}{int(t):>10d}{int(p):>18d}")
    lines.append(f"max/mean attention work: {max(pairs) / mean:.3f}")
    return "\n".join(lines)


def clip_pieces(pieces: Sequence[AttentionPiece], lo: int, hi: int) -> List[AttentionPiece]:
    """The pieces restricted to queries ``[lo, hi)``; query indices become shard-local.

    A causal square cut by the boundary becomes an unmasked rectangle on the keys before
    the first local query plus a smaller causal square. The pieces are squares and
    rectangles (``plan_pieces`` without ``fuse``).
    """
    out: List[AttentionPiece] = []
    for p in pieces:
        if p.causal and p.q_hi - p.q_lo != p.k_hi - p.k_lo:
            raise ValueError("pieces: a fused causal piece cannot be split over context-parallel shards")
        qa, qb = max(p.q_lo, lo), min(p.q_hi, hi)
        if qa >= qb:
            continue
        if not p.causal:
            out.append(AttentionPiece(qa - lo, qb - lo, p.k_lo, p.k_hi, False))
            continue
        if qa > p.q_lo:
            out.append(AttentionPiece(qa - lo, qb - lo, p.k_lo, qa, False))
        out.append(AttentionPiece(qa - lo, qb - lo, qa, qb, True))
    return out


def needed_shards(pieces: Sequence[AttentionPiece], bounds: Sequence[Tuple[int, int]]) -> List[List[bool]]:
    """``need[r][s]``: queries of shard ``r`` see some key of shard ``s``."""
    need = [[False] * len(bounds) for _ in bounds]
    for r, (lo, hi) in enumerate(bounds):
        for p in clip_pieces(pieces, lo, hi):
            for s, (ks, ke) in enumerate(bounds):
                if p.k_lo < ke and p.k_hi > ks:
                    need[r][s] = True
    return need


@dataclass
class CPLayout:
    """How one packed unit is split over the context-parallel group."""

    group: dist.ProcessGroup
    rank: int
    bounds: List[Tuple[int, int]]
    comm_type: str = "allgather"
    need: Optional[List[List[bool]]] = None

    def without_padding(self, num_real: int) -> "CPLayout":
        """The same split with the padding at the end of the unit cut off."""
        bounds = [(min(s, num_real), min(e, num_real)) for s, e in self.bounds]
        return CPLayout(self.group, self.rank, bounds, "allgather", None)

    @property
    def size(self) -> int:
        return len(self.bounds)

    @property
    def local(self) -> Tuple[int, int]:
        return self.bounds[self.rank]

    @property
    def lengths(self) -> List[int]:
        return [e - s for s, e in self.bounds]


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    pad = x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))
    return torch.cat([x, pad])


def all_gather_rows(x: Tensor, layout: CPLayout) -> Tensor:
    """``[n_local, ...] -> [n_unit, ...]``: every rank's rows, concatenated (not differentiable)."""
    lengths = layout.lengths
    width = max(lengths)
    parts = [torch.empty((width,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device) for _ in lengths]
    dist.all_gather(parts, _pad_rows(x, width), group=layout.group)
    _BYTES_SENT[0] += width * x[0:1].numel() * x.element_size() * (layout.size - 1)
    return torch.cat([p[:n] for p, n in zip(parts, lengths)])


def reduce_scatter_rows(x: Tensor, layout: CPLayout) -> Tensor:
    """``[n_unit, ...] -> [n_local, ...]``: the sum over ranks of this rank's rows
    (reduce-scatter on NCCL; all-reduce and slice on gloo, which has no reduce-scatter)."""
    x = x.contiguous()
    lo, hi = layout.local
    if dist.get_backend(layout.group) == "nccl":
        width = max(layout.lengths)
        padded = torch.cat([_pad_rows(x[s:e], width) for s, e in layout.bounds])
        out = x.new_empty((width,) + tuple(x.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=layout.group)
        _BYTES_SENT[0] += out.numel() * out.element_size() * (layout.size - 1)
        return out[: hi - lo]
    x = x.clone()
    dist.all_reduce(x, group=layout.group)  # a ring all-reduce sends 2 (C-1)/C of it
    _BYTES_SENT[0] += 2 * x.numel() * x.element_size() * (layout.size - 1) // layout.size
    return x[lo:hi].clone()


class _AllGatherRows(torch.autograd.Function):
    """Concatenate every rank's rows; backward sums the gradients and keeps own rows."""

    @staticmethod
    def forward(ctx, x: Tensor, layout: CPLayout) -> Tensor:
        ctx.layout = layout
        return all_gather_rows(x, layout)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_rows(grad, ctx.layout), None


def _group_rank(layout: CPLayout, r: int) -> int:
    return dist.get_global_rank(layout.group, r)


_P2P_READY: set = set()  # CP groups whose communicator a collective has set up


def _set_up_p2p(layout: CPLayout, device) -> None:
    """One all-reduce on the CP group before its first point-to-point batch.

    With NCCL, the first ``batch_isend_irecv`` on a group must involve every rank of it;
    a rank whose shard needs no other shard (and sends to none) makes no such call, and
    the others would hang there. Every rank runs this (it precedes the ops), once per group.
    """
    key = id(layout.group)
    if key not in _P2P_READY:
        dist.all_reduce(torch.zeros(1, device=device), group=layout.group)
        _P2P_READY.add(key)


class _ExchangeRows(torch.autograd.Function):
    """Point-to-point: receive only the shards this rank's queries can see."""

    @staticmethod
    def forward(ctx, x: Tensor, layout: CPLayout) -> Tensor:
        _set_up_p2p(layout, x.device)
        me, need = layout.rank, layout.need
        total = layout.bounds[-1][1]
        out = x.new_zeros((total,) + tuple(x.shape[1:]))
        lo, hi = layout.local
        out[lo:hi] = x
        ops = []
        for r in range(layout.size):
            if r != me and need[r][me] and hi > lo:
                ops.append(dist.P2POp(dist.isend, x.contiguous(), _group_rank(layout, r), layout.group))
                _BYTES_SENT[0] += x.numel() * x.element_size()
        recv = {}
        for s in range(layout.size):
            ks, ke = layout.bounds[s]
            if s != me and need[me][s] and ke > ks:
                recv[s] = x.new_empty((ke - ks,) + tuple(x.shape[1:]))
                ops.append(dist.P2POp(dist.irecv, recv[s], _group_rank(layout, s), layout.group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for s, buf in recv.items():
            ks, ke = layout.bounds[s]
            out[ks:ke] = buf
        ctx.layout = layout
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        layout = ctx.layout
        me, need = layout.rank, layout.need
        lo, hi = layout.local
        own = grad[lo:hi].clone()
        ops, recv = [], {}
        for s in range(layout.size):
            ks, ke = layout.bounds[s]
            if s != me and need[me][s] and ke > ks:
                ops.append(dist.P2POp(dist.isend, grad[ks:ke].contiguous(), _group_rank(layout, s), layout.group))
                _BYTES_SENT[0] += grad[ks:ke].numel() * grad.element_size()
        for r in range(layout.size):
            if r != me and need[r][me] and hi > lo:
                recv[r] = torch.empty_like(own)
                ops.append(dist.P2POp(dist.irecv, recv[r], _group_rank(layout, r), layout.group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for buf in recv.values():
            own += buf
        return own, None


def gather_rows(x: Tensor, layout: CPLayout, everything: bool = False) -> Tensor:
    """Rows of all shards (zeros where this rank needs none), differentiable.

    Args:
        x: ``[n_local, ...]`` this rank's rows.
        layout: the unit's CP layout.
        everything: always all-gather (cached prefixes are visible to every query).
    """
    if layout.size == 1:
        return x
    if everything or layout.comm_type == "allgather":
        return _AllGatherRows.apply(x, layout)
    return _ExchangeRows.apply(x, layout)


class _SumAcrossRanks(torch.autograd.Function):
    """All-reduce sum whose backward is the identity (every rank uses the same result)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def sum_across(x: Tensor, group) -> Tensor:
    """Differentiable all-reduce for per-token values each rank filled in part."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _SumAcrossRanks.apply(x, group)


_SINGLETON: Dict[int, dist.ProcessGroup] = {}


def singleton_group() -> dist.ProcessGroup:
    """A group holding only this rank: handed to GPTModel's rotary embedding so that it
    does not slice its table for Megatron's zigzag CP layout (tree positions are
    gathered per token instead)."""
    rank = dist.get_rank()
    if rank not in _SINGLETON:
        _SINGLETON[rank] = dist.new_group([rank], use_local_synchronization=True)
    return _SINGLETON[rank]
