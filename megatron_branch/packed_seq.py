"""Per-step tree data that travels from ``GPTModel.forward`` down to every layer.

A :class:`BranchPackedSeqParams` is a Megatron ``PackedSeqParams`` (so GPTModel passes it
through unchanged) in the ``sbhd`` format, carrying the tree's RoPE positions, subtree
ends and segments. No globals: each call gets its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from torch import Tensor

from megatron_branch._megatron import PackedSeqParams
from megatron_branch.attention.cascade import AttentionPiece, plan_pieces
from megatron_branch.tree import BranchSegment, BranchTree

if TYPE_CHECKING:
    from megatron_branch.prefix_cache import StemCache


@dataclass
class BranchPackedSeqParams(PackedSeqParams):
    """Tree layout of one packed micro-batch (batch size 1, sequence ``U``).

    Attributes:
        positions: ``[U]`` RoPE position (depth) of each packed token.
        last: ``[U]`` packed index of the last token in each token's subtree.
        segments: the tree's chains (see :class:`megatron_branch.tree.BranchSegment`).
        prefix: stems whose cached K/V every token here attends to (streaming replay).
        record: the stem this forward records its K/V into, or None.
        inject: add the cached K/V gradients of ``record`` in the backward (exact replay).
    """

    positions: Optional[Tensor] = None
    last: Optional[Tensor] = None
    segments: List[BranchSegment] = field(default_factory=list)
    prefix: List["StemCache"] = field(default_factory=list)
    record: Optional["StemCache"] = None
    inject: bool = False
    _pieces: Dict[Tuple[Optional[int], Optional[int]], List[AttentionPiece]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def from_tree(cls, tree: BranchTree, device=None) -> "BranchPackedSeqParams":
        """Params for running ``tree`` packed; tensors moved to ``device``."""
        positions = tree.positions.to(device) if device is not None else tree.positions
        last = tree.last.to(device) if device is not None else tree.last
        rope_len = tree.max_position + 1
        return cls(
            qkv_format="sbhd",
            max_seqlen_q=rope_len,
            max_seqlen_kv=rope_len,
            positions=positions,
            last=last,
            segments=tree.segments,
        )

    @classmethod
    def for_unit(cls, tree: BranchTree, start: int, end: int, device=None, **cache) -> "BranchPackedSeqParams":
        """Params for the packed range ``[start, end)`` of ``tree`` run on its own.

        The range must be closed under "descendant of a token in it, up to ``end``":
        segments are clipped to it; ancestors outside it come from ``cache['prefix']``.
        """
        segments: List[BranchSegment] = []
        local = {}  # global segment -> local index, for parent links inside the unit
        for seg in tree.segments_in(start, end):
            lo, hi = max(seg.start, start), min(seg.end, end)
            local[id(seg)] = len(segments)
            parent = tree.segments[seg.parent] if seg.parent >= 0 else None
            segments.append(BranchSegment(
                lo - start, hi - start, min(seg.subtree_end, end) - start,
                local.get(id(parent), -1) if lo == seg.start else -1,
            ))
        positions = tree.positions[start:end]
        last = tree.last[start:end].clamp(max=end - 1) - start
        rope_len = int(positions.max()) + 1
        if device is not None:
            positions, last = positions.to(device), last.to(device)
        return cls(
            qkv_format="sbhd", max_seqlen_q=rope_len, max_seqlen_kv=rope_len,
            positions=positions, last=last, segments=segments, **cache,
        )

    def pieces(self, q_block: Optional[int], k_block: Optional[int]) -> List[AttentionPiece]:
        """Attention pieces for this tree, planned once and shared by all layers."""
        key = (q_block, k_block)
        if key not in self._pieces:
            self._pieces[key] = plan_pieces(self.segments, q_block, k_block)
        return self._pieces[key]
