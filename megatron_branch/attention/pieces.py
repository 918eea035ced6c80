"""Attention pieces: the dense blocks a packed tree's attention splits into.

For every segment ``s`` of the packed tree (a chain ``[start, end)`` whose subtree ends
at ``subtree_end``): its own tokens attend to its own keys causally (a square causal
piece), and every token of its descendants — the contiguous range ``[end, subtree_end)``
— attends to its keys with no mask (a rectangular piece). Together the pieces cover
every visible (query, key) pair exactly once, with no ``U x U`` mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

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
