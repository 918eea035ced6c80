"""Attention pieces: the dense blocks a packed tree's attention splits into.

For every segment ``s`` of the packed tree (a chain ``[start, end)`` whose subtree ends
at ``subtree_end``): its own tokens attend to its own keys causally (a square causal
piece), and every token of its descendants — the contiguous range ``[end, subtree_end)``
— attends to its keys with no mask (a rectangular piece). Together the pieces cover
every visible (query, key) pair exactly once, with no ``U x U`` mask.

Where the kernel's causal mask is aligned top-left (query ``i`` of a piece sees its keys
``0..i``, whatever the piece's shape), a segment's square and its descendants' rectangle
are one piece instead: queries ``[start, subtree_end)`` on keys ``[start, end)``, causal
(``plan_pieces(..., fuse=True)``). The pairs are the same; one kernel call and one merge
entry per segment fewer, and every piece is then a contiguous run of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_branch.tree import BranchSegment


@dataclass(frozen=True)
class AttentionPiece:
    """Queries ``[q_lo, q_hi)`` attend to keys ``[k_lo, k_hi)``.

    A causal piece starts its queries and keys at the same row (``q_lo == k_lo``) and
    is aligned top-left: query ``q_lo + i`` sees keys ``k_lo .. k_lo + i``. It is square,
    or (fused, :func:`plan_pieces`) taller than wide: a segment and its descendants,
    which see every key of the segment.
    """

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
    segments: Sequence[BranchSegment], q_block: Optional[int] = None, k_block: Optional[int] = None,
    fuse: bool = False,
) -> List[AttentionPiece]:
    """The attention pieces of a packed tree.

    Args:
        segments: the tree's segments (``BranchTree.segments``).
        q_block: most queries per piece (``None``: unbounded).
        k_block: most keys per piece (``None``: unbounded).
        fuse: a segment with descendants is one causal piece over its subtree's queries
            (if it fits the blocks), for kernels whose causal mask is aligned top-left
            (:func:`~megatron_branch.attention.kernels.top_left_causal`).

    Returns:
        Pieces that cover every visible (query, key) pair exactly once.
    """
    big = 1 << 62
    qb, kb = q_block or big, k_block or big
    pieces: List[AttentionPiece] = []
    for seg in segments:
        below = seg.subtree_end > seg.end
        if fuse and below and seg.subtree_end - seg.start <= qb and seg.end - seg.start <= kb:
            pieces.append(AttentionPiece(seg.start, seg.subtree_end, seg.start, seg.end, True))
            continue
        _tile_causal(seg.start, seg.end, qb, kb, pieces)
        if below:
            tile_rect(seg.end, seg.subtree_end, seg.start, seg.end, qb, kb, pieces)
    return pieces


def bucket(n: int) -> int:
    """``n`` rounded up to a small set of sizes (at most 12.5% larger, and to 16 below
    that), so that pieces of nearly equal size share one batched kernel call."""
    if n <= 16:
        return n
    step = 1 << max(n.bit_length() - 4, 0)
    return -(-n // step) * step


@dataclass
class PieceBatch:
    """Equally shaped pieces run as one batched kernel call.

    Causal squares are padded at their end (a padded query's output is dropped; no real
    query sees a padded key, which comes after it); rectangles and fused causal pieces
    (taller than wide) pad only queries, never keys (an extra key would change every
    softmax).

    Attributes:
        causal: the pieces are causal (aligned top-left; square unless fused).
        q_index: ``[B, nq]`` query row of each batch entry (padding repeats a real row).
        k_index: ``[B, nk]`` key row of each batch entry.
        valid: ``[B, nq]`` the entry is a real query of its piece.
        dest: ``[B * nq]`` the output row of each entry; padding goes to the spare row
            ``num_rows`` (one past the last query), which the merge drops.
        view: ``(q_lo, q_step, k_lo, k_step)`` when entry ``b`` is exactly the rows
            ``[q_lo + b * q_step, + nq)`` and keys ``[k_lo + b * k_step, + nk)`` with no
            padding and no row shared by two entries: the batch is then a strided view of
            the packed tensors (no gather, and its gradients are added in place).
        num_valid: the real queries (``valid.sum()``, counted on the host when planned).
    """

    causal: bool
    q_index: torch.Tensor
    k_index: torch.Tensor
    valid: torch.Tensor
    dest: torch.Tensor
    view: Optional[Tuple[int, int, int, int]] = None
    num_valid: int = -1

    def to(self, device) -> "PieceBatch":
        """The same batch with its index tensors on ``device``."""
        return PieceBatch(self.causal, self.q_index.to(device), self.k_index.to(device), self.valid.to(device),
                          self.dest.to(device), self.view, self.num_valid)


MAX_BATCH_ROWS = 1 << 16  # most query rows gathered for one batched call
# A piece of at least this many queries runs as its own call on views of the packed
# tensors rather than gathered into a batch: at that size one more kernel call costs
# less than gathering its rows (forward and backward) and scattering their gradients.
SOLO_ROWS = 512


def plan_batches(pieces: Sequence[AttentionPiece], max_scores: Optional[int] = None,
                 num_rows: Optional[int] = None) -> List[PieceBatch]:
    """Group pieces into batched calls: causal squares by bucketed length, rectangles and
    fused causal pieces by key count and bucketed query count; a group is split so a call
    gathers at most :data:`MAX_BATCH_ROWS` query rows and, for kernels that materialise
    scores, at most ``max_scores`` (query, key) pairs per head.

    Args:
        pieces: from :func:`plan_pieces`.
        max_scores: the score-tile bound of kernels that materialise scores.
        num_rows: the number of query rows (default: one past the last piece's queries);
            padded entries write to row ``num_rows``.
    """
    if num_rows is None:
        num_rows = max((p.q_hi for p in pieces), default=0)
    groups: dict = {}
    for p in pieces:
        nq, nk = p.q_hi - p.q_lo, p.k_hi - p.k_lo
        # a fused piece has fewer keys than queries, so its key never equals a square's
        key = (True, bucket(nq), bucket(nq)) if p.causal and nq == nk else (p.causal, bucket(nq), nk)
        groups.setdefault(key, []).append(p)
    batches: List[PieceBatch] = []
    for (causal, nq_b, nk_b), members in sorted(groups.items(), key=lambda kv: kv[0]):
        if len(members) > 1 and nq_b >= SOLO_ROWS and _batch(members, causal, nq_b, nk_b, num_rows).view is None:
            for p in members:  # each on views: no gather
                nq = p.q_hi - p.q_lo
                batches.append(_batch([p], causal, nq, nq if _square(p) else nk_b, num_rows))
            continue
        if len(members) == 1:  # nothing to share a call with: its exact size (a view, no padding)
            nq_b = members[0].q_hi - members[0].q_lo
            nk_b = nq_b if _square(members[0]) else nk_b
        per_call = max(1, MAX_BATCH_ROWS // nq_b)
        if max_scores is not None:
            per_call = max(1, min(per_call, max_scores // (nq_b * nk_b)))
        for first in range(0, len(members), per_call):
            batches.append(_batch(members[first:first + per_call], causal, nq_b, nk_b, num_rows))
    return batches


def _square(p: AttentionPiece) -> bool:
    return p.causal and p.q_hi - p.q_lo == p.k_hi - p.k_lo


def _steps(starts: List[int], width: int) -> Optional[int]:
    """The common step between consecutive ``starts`` if ranges of ``width`` from them are
    evenly spaced and disjoint (``width`` for a single range), else ``None``."""
    if len(starts) == 1:
        return width
    step = starts[1] - starts[0]
    if step < width or any(b - a != step for a, b in zip(starts, starts[1:])):
        return None
    return step


def _batch(members: Sequence[AttentionPiece], causal: bool, nq_b: int, nk_b: int, num_rows: int) -> PieceBatch:
    # planned on the host (numpy: a handful of tiny arrays per batch, every step);
    # BranchPackedSeqParams moves each batch to the device once per forward
    steps = np.arange(nq_b)
    q_los = [p.q_lo for p in members]
    q_lens = [p.q_hi - p.q_lo for p in members]
    k_los = [p.k_lo for p in members]
    q_lo = np.asarray(q_los)[:, None]
    q_len = np.asarray(q_lens)[:, None]
    valid = steps[None, :] < q_len
    q_index = q_lo + np.minimum(steps[None, :], q_len - 1)
    k_lo = np.asarray(k_los)[:, None]
    if causal and nk_b == nq_b:  # a square: keys follow the queries (shard-local queries under CP)
        k_index = k_lo + np.minimum(steps[None, :], q_len - 1)
    else:
        k_index = k_lo + np.arange(nk_b)[None, :]
    dest = np.where(valid, q_index, num_rows).reshape(-1)
    view = None
    if all(n == nq_b for n in q_lens):
        q_step, k_step = _steps(q_los, nq_b), _steps(k_los, nk_b)
        if q_step is not None and k_step is not None:
            view = (q_los[0], q_step, k_los[0], k_step)
    return PieceBatch(causal, _host(q_index), _host(k_index), torch.from_numpy(valid), _host(dest), view,
                      int(sum(q_lens)))


def _host(index: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
