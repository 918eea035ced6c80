"""Per-step tree data that travels from ``GPTModel.forward`` down to every layer.

A :class:`BranchPackedSeqParams` is a Megatron ``PackedSeqParams`` (so GPTModel passes it
through unchanged) in the ``sbhd`` format, carrying the RoPE positions of the tokens this
rank runs, the unit's segments, the prefix cache (streaming replay) and the
context-parallel layout. No globals: each forward gets its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple, TypeVar

import torch
from torch import Tensor

from megatron_branch._megatron import PackedSeqParams
from megatron_branch.attention.context_parallel import CPLayout, clip_pieces, needed_shards, shard_bounds
from megatron_branch.attention.pieces import AttentionPiece, PieceBatch, plan_batches, plan_pieces
from megatron_branch.attention.varlen import VarlenCall
from megatron_branch.attention.varlen_cascade import varlen_calls
from megatron_branch.model import HOST
from megatron_branch.tree import BranchSegment, BranchTree

if TYPE_CHECKING:
    from megatron_branch.attention.path_cache import PathCache
    from megatron_branch.spec.moe.routing_replay import TreeRouting

T = TypeVar("T")


@dataclass
class BranchPackedSeqParams(PackedSeqParams):
    """Tree layout of one packed unit (batch size 1).

    Attributes:
        positions: ``[n_local]`` RoPE position (depth) of each token this rank runs.
        last: ``[n]`` unit-relative index of the last token of each token's subtree.
        segments: the unit's chains, unit-relative (padding is a chain of its own).
        num_real: tokens of the unit before padding.
        total: tokens of the unit after padding.
        cache: the K/V of the stems on the path above this unit, which every token here
            attends to (streaming replay), or None.
        stem_id: this forward is that stem's: it writes its K/V into ``cache``.
        stem_rows: a stem's chain, its first ``stem_rows`` tokens: what it caches for the
            units below (``None``: every real token; the rest are complete subtrees run
            with it, :mod:`megatron_branch.replay.plan`).
        inject: add the gradients accumulated for ``stem_id`` in the backward (exact replay).
        cp: the context-parallel split of the unit, or None.
        multiplicity: ``[n_local]`` rollouts containing each token this rank runs (0 on
            padding): how often the naive batch would see it (MoE router statistics).
        tree: the packed tree the unit belongs to (MoE statistics over rollouts).
        start: packed index of the unit's first token in ``tree``.
        routing: the experts every MoE router replays for the tree's tokens (rollout
            routing replay, :mod:`megatron_branch.spec.moe.routing_replay`), or None.
    """

    positions: Optional[Tensor] = None
    last: Optional[Tensor] = None
    segments: List[BranchSegment] = field(default_factory=list)
    num_real: int = 0
    total: int = 0
    cache: Optional["PathCache"] = None
    stem_id: Optional[int] = None
    stem_rows: Optional[int] = None
    inject: bool = False
    cp: Optional[CPLayout] = None
    multiplicity: Optional[Tensor] = None
    tree: Optional[BranchTree] = field(default=None, repr=False)
    start: int = 0
    routing: Optional["TreeRouting"] = field(default=None, repr=False)
    _pieces: Dict[tuple, list] = field(
        default_factory=dict, repr=False
    )
    _memo: Dict[object, object] = field(default_factory=dict, repr=False)

    @classmethod
    def from_tree(cls, tree: BranchTree, device=None) -> "BranchPackedSeqParams":
        """Params for running the whole ``tree`` as one packed sequence on one rank."""
        return cls.for_unit(tree, 0, tree.unique_positions, device)

    @classmethod
    def for_unit(
        cls,
        tree: BranchTree,
        start: int,
        end: int,
        device=None,
        *,
        multiple: int = 1,
        cp_group=None,
        cp_comm_type: str = "allgather",
        cp_linear_weight: float = 0.0,
        rope_group=None,
        **cache,
    ) -> "BranchPackedSeqParams":
        """Params for the packed range ``[start, end)`` of ``tree`` run on its own.

        The range must hold every descendant of its tokens up to ``end`` (a replay unit);
        ancestors outside it come from ``cache['prefix']``. The unit is padded at the end
        (a separate chain, never visible to real tokens) so its length is a multiple of
        ``multiple`` (sequence parallelism) and every CP shard gets tokens.

        Args:
            cp_group: context-parallel group; with more than one rank the unit is split
                by :func:`~megatron_branch.attention.context_parallel.shard_bounds`.
            cp_comm_type: ``"allgather"`` or ``"p2p"``.
            cp_linear_weight: per-token linear work in attention-pair units (balancing).
            rope_group: passed as ``cp_group`` to GPTModel's rotary embedding (a
                one-rank group keeps it from slicing its table for Megatron's CP).
        """
        n = end - start
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
        multiplicity = tree.multiplicity[start:end]
        last = tree.last[start:end].clamp(max=end - 1) - start
        cp_size = cp_group.size() if cp_group is not None else 1
        total = max(n, cp_size * multiple)
        total = -(-total // multiple) * multiple
        if total > n:
            pad = total - n
            positions = torch.cat([positions, torch.arange(pad, device=HOST)])  # host, like the tree
            multiplicity = torch.cat([multiplicity, multiplicity.new_zeros(pad)])
            last = torch.cat([last, torch.full((pad,), total - 1, dtype=last.dtype, device=HOST)])
            segments.append(BranchSegment(n, total, total, -1))
        layout = None
        if cp_size > 1:
            bounds = shard_bounds(positions, cp_size, cp_linear_weight, multiple)
            layout = CPLayout(cp_group, cp_group.rank(), bounds, cp_comm_type)
            if cp_comm_type == "p2p":
                layout.need = needed_shards(plan_pieces(segments), bounds)
            lo, hi = layout.local
            positions, multiplicity = positions[lo:hi], multiplicity[lo:hi]
        rope_len = int(positions.max()) + 1 if positions.numel() else 1
        if device is not None:
            positions, last, multiplicity = positions.to(device), last.to(device), multiplicity.to(device)
        return cls(
            qkv_format="sbhd", max_seqlen_q=rope_len, max_seqlen_kv=rope_len, cp_group=rope_group,
            positions=positions, last=last, segments=segments, num_real=n, total=total, cp=layout,
            multiplicity=multiplicity, tree=tree, start=start, **cache,
        )

    def memo(self, key, build: Callable[[], T]) -> T:
        """``build()`` once per forward: what every layer derives alike from these params
        (the gathered rotary table, the MoE layers' tree tokens) is computed by the first
        layer and shared by the rest (and by their recompute in the backward)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    @property
    def cached_rows(self) -> int:
        """Unit-relative end of the tokens a stem caches (its chain)."""
        return self.num_real if self.stem_rows is None else self.stem_rows

    @property
    def local(self) -> Tuple[int, int]:
        """Unit-relative range of the tokens this rank runs."""
        return self.cp.local if self.cp is not None else (0, self.total)

    def pieces(self, q_block: Optional[int], k_block: Optional[int], fuse: bool = False) -> List[AttentionPiece]:
        """Attention pieces of this rank's queries, planned once and shared by all layers
        (``fuse``: a segment and its descendants as one piece, for kernels whose causal
        mask is aligned top-left; not under CP, whose shards cut pieces as squares)."""
        fuse = fuse and self.cp is None
        key = (q_block, k_block, fuse)
        if key not in self._pieces:
            pieces = plan_pieces(self.segments, q_block, k_block, fuse)
            if self.cp is not None:
                pieces = clip_pieces(pieces, *self.cp.local)
            self._pieces[key] = pieces
        return self._pieces[key]

    def batches(self, q_block: Optional[int], k_block: Optional[int], device=None,
                fuse: bool = False) -> List[PieceBatch]:
        """The pieces grouped into batched kernel calls, planned once per forward (with
        ``k_block``, score-materialising kernels: a call holds at most one tile of scores)
        and moved to ``device`` once, not per layer."""
        key = ("batches", q_block, k_block, fuse)
        if key not in self._pieces:
            max_scores = q_block * k_block if q_block and k_block else None
            lo, hi = self.local
            self._pieces[key] = plan_batches(self.pieces(q_block, k_block, fuse), max_scores, num_rows=hi - lo)
        if device is None:
            return self._pieces[key]
        on = key + (str(device),)
        if on not in self._pieces:
            self._pieces[on] = [b.to(device) for b in self._pieces[key]]
        return self._pieces[on]

    def varlen_calls(self, num_keys: int, device=None) -> List[VarlenCall]:
        """This rank's pieces as varlen calls (``1 + depth`` of them) on ``device``, planned
        and copied once per forward, not per layer. ``num_keys``: the key rows the calls
        read (the unit, gathered under CP)."""
        key = ("varlen", num_keys, str(device))
        if key not in self._pieces:
            lo, hi = self.local
            self._pieces[key] = varlen_calls(self.pieces(None, None), hi - lo, num_keys, device)
        return self._pieces[key]
