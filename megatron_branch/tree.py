"""The prefix tree of a batch of rollouts, packed in DFS preorder.

Rollouts (token-id sequences) are inserted into a token trie; the unique tokens are laid
out in depth-first preorder as one packed sequence of length ``U``. Because a preorder
lays every subtree out contiguously, key ``j`` is visible to query ``i`` iff
``j <= i <= last[j]`` (``j`` is an ancestor-or-self of ``i``), so the tree needs no
``U x U`` mask. Several prompts form a forest in the same packed sequence.

Construction is sort-based and vectorised: rollouts are sorted lexicographically, the
longest common prefix (LCP) of sorted neighbours decides where each rollout leaves the
trie, and each rollout contributes the suffix after that point. Python loops run over
rollouts (and the branch points along each), never over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

Rollout = Union[Sequence[int], torch.Tensor, np.ndarray]


@dataclass(frozen=True)
class BranchSegment:
    """A maximal run of packed tokens that forms a chain in the tree.

    Attributes:
        start: packed index of the first token.
        end: packed index one past the last token.
        subtree_end: packed index one past the last descendant (``last + 1``).
        parent: index of the parent segment, ``-1`` for a root.
    """

    start: int
    end: int
    subtree_end: int
    parent: int


def _as_token_array(seq: Rollout, index: int) -> np.ndarray:
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1:
            raise ValueError(f"rollout {index}: tokens must be 1-D, got shape {tuple(seq.shape)}")
        if seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
            raise ValueError(f"rollout {index}: tokens must be integers, got dtype {seq.dtype}")
        arr = seq.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(seq)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"rollout {index}: tokens must be a flat list of integers ({exc})") from None
        if arr.dtype == object:
            raise ValueError(f"rollout {index}: tokens must be integers (ragged or mixed input)")
        if arr.ndim != 1:
            raise ValueError(f"rollout {index}: tokens must be 1-D, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"rollout {index}: tokens must be integers, got dtype {arr.dtype}")
    if arr.size == 0:
        raise ValueError(f"rollout {index}: tokens is empty")
    arr = arr.astype(np.int64, copy=False)
    if (arr < 0).any():
        bad = int(arr[arr < 0][0])
        raise ValueError(f"rollout {index}: tokens contains negative token id {bad}")
    return arr


_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def _as_token_arrays(sequences: Sequence[Rollout]) -> Tuple[List[np.ndarray], np.ndarray]:
    """Every rollout as a checked int64 array (:func:`_as_token_array`), and all of them
    joined: the vocabulary check, the padded matrix and the sort keys read the join, made
    once here.

    A batch of non-empty 1-D integer tensors (what a trainer passes, every step) is
    converted and checked in one go: a check and a conversion per rollout were a quarter
    of building the bench's 256-rollout forest. Anything else, or a batch with a negative
    id, is checked rollout by rollout, so the error names the rollout.
    """
    if all(isinstance(s, torch.Tensor) and s.dim() == 1 and s.dtype in _INT_DTYPES and s.numel() for s in sequences):
        flat = torch.cat([s.cpu() for s in sequences]).to(torch.int64).numpy()  # int tensors carry no grad
        if not (flat < 0).any():
            ends = np.cumsum([s.numel() for s in sequences]).tolist()
            return [flat[start:end] for start, end in zip([0] + ends[:-1], ends)], flat
    arrays = [_as_token_array(s, i) for i, s in enumerate(sequences)]
    return arrays, np.concatenate(arrays)


def _lexicographic_order(arrays: List[np.ndarray], flat: np.ndarray) -> np.ndarray:
    """Stable lexicographic order of rollouts (non-negative ids), a prefix before its extensions.

    Each rollout's key is its ids as big-endian unsigned bytes, whose byte order is the
    numeric order, and a prefix's bytes sort before its extensions': one memcmp per
    comparison. (``np.lexsort`` over the padded matrix makes one pass per column, tens of
    milliseconds on 16 rollouts of 4K tokens, inside every step.) ``flat``: the arrays
    joined (:func:`_as_token_arrays` makes the join once per build).
    """
    data = flat.astype(">u8").tobytes()  # one conversion, then byte slices
    ends = (8 * np.cumsum([a.size for a in arrays])).tolist()
    keys = [data[start:end] for start, end in zip([0] + ends[:-1], ends)]
    return np.array(sorted(range(len(arrays)), key=keys.__getitem__), dtype=np.int64)


def _unique_loss_mask(tree: "BranchTree", arrays: List[np.ndarray], loss_masks: Sequence[Rollout]) -> torch.Tensor:
    """``[U]`` bool loss mask per unique token, checked for agreement on shared tokens."""
    if len(loss_masks) != len(arrays):
        raise ValueError(f"loss_masks: {len(loss_masks)} masks for {len(arrays)} rollouts")
    flat_mask, flat_rows = [], []
    for r, (tokens, mask) in enumerate(zip(arrays, loss_masks)):
        m = np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask)
        if m.ndim != 1 or m.size != tokens.size:
            raise ValueError(f"rollout {r}: loss_masks has {m.size if m.ndim == 1 else m.shape} entries for "
                             f"{tokens.size} tokens")
        bad = np.nonzero((m != 0) & (m != 1))[0]
        if bad.size:
            raise ValueError(f"rollout {r}: loss_masks position {int(bad[0])} is {m[bad[0]]}, not 0 or 1")
        flat_mask.append(m.astype(bool))
        flat_rows.append(tree.rows[r, : tokens.size].numpy())
    rows, values = np.concatenate(flat_rows), np.concatenate(flat_mask)
    unique = np.zeros(tree.unique_positions, dtype=bool)
    unique[rows[values]] = True
    conflict = np.nonzero(unique[rows] != values)[0]  # marked 0 where another rollout says 1
    if conflict.size:
        offsets = np.cumsum([0] + [t.size for t in arrays])
        r = int(np.searchsorted(offsets, conflict[0], side="right") - 1)
        t = int(conflict[0] - offsets[r])
        token = rows[conflict[0]]
        other = next(s for s in range(len(arrays))
                     if t < flat_mask[s].size and tree.rows[s, t] == token and flat_mask[s][t])
        raise ValueError(
            f"rollout {r}: loss_masks position {t} is 0 but rollout {other} marks the same shared token 1; "
            "a token shared by rollouts has one origin (policy or environment)"
        )
    return torch.from_numpy(unique)


class BranchTree:
    """Rollouts deduplicated into a prefix tree and packed in DFS preorder.

    Build with :meth:`from_sequences`. Per packed token ``i`` (all ``[U]`` LongTensors):
    ``tokens[i]`` (token id), ``positions[i]`` (depth in its rollout, the RoPE position),
    ``parents[i]`` (packed index of the previous token, ``-1`` for a root) and
    ``last[i]`` (packed index of the last token of the subtree of ``i``). Per rollout:
    ``rows[r, t]`` is the packed index of token ``t`` of rollout ``r`` (``[R, max_len]``,
    ``-1`` past the end) and ``lengths[r]`` its length. ``segments`` lists the chains
    used by the cascade attention.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        parents: torch.Tensor,
        last: torch.Tensor,
        rows: torch.Tensor,
        lengths: torch.Tensor,
        segments: List[BranchSegment],
    ):
        self.tokens = tokens
        self.positions = positions
        self.parents = parents
        self.last = last
        self.rows = rows
        self.lengths = lengths
        self.segments = segments

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Rollout],
        vocab_size: Optional[int] = None,
        share_limit: Optional[Union[int, Sequence[int]]] = None,
        loss_masks: Optional[Sequence[Rollout]] = None,
    ) -> "BranchTree":
        """Build the tree of a batch of rollouts.

        Args:
            sequences: ``R`` rollouts, each a list / 1-D LongTensor / 1-D integer array of
                token ids (prompt and response together). Identical rollouts, rollouts that
                are prefixes of others and single-token rollouts are all allowed.
            vocab_size: if given, every token id must be ``< vocab_size``.
            share_limit: tokens at depth ``>= share_limit[r]`` of rollout ``r`` are never
                shared (an int applies to all). ``0`` packs without deduplication; the
                prompt length shares only prompts. For baselines and benchmarks.
            loss_masks: per rollout, a 0/1 mask of its tokens (same length as the
                rollout): 1 where the loss reads the token's log-prob (the policy's
                tokens), 0 where it does not (the prompt, tool or environment output in an
                agentic rollout). A token shared by rollouts has one origin, so every
                rollout containing it must give it the same value. Stored per unique
                token as ``loss_mask [U]``; :meth:`rollout_loss_mask` gives the
                ``[R, max_len - 1]`` mask a loss takes.

        Returns:
            The packed tree.

        Raises:
            ValueError: no rollouts, an empty/non-1-D/non-integer rollout, a token id
                outside ``[0, vocab_size)``, a ``loss_masks`` entry of the wrong length or
                not 0/1, or a shared token that rollouts mask differently; the message
                names the rollout (and position).
        """
        if isinstance(sequences, torch.Tensor) and sequences.dim() == 2:
            sequences = list(sequences)
        if sequences is None or len(sequences) == 0:
            raise ValueError("sequences: no rollouts given")
        arrays, flat = _as_token_arrays(sequences)
        if vocab_size is not None and flat.max() >= vocab_size:
            for i, a in enumerate(arrays):
                if a.max() >= vocab_size:
                    raise ValueError(
                        f"rollout {i}: tokens contains id {int(a.max())} outside the "
                        f"vocabulary of size {vocab_size}"
                    )
        limits = None
        if share_limit is not None:
            limits = np.asarray(share_limit, dtype=np.int64)
            if limits.ndim == 0:
                limits = np.full(len(arrays), int(limits), dtype=np.int64)
            if limits.shape != (len(arrays),):
                raise ValueError(f"share_limit: needs one entry per rollout ({len(arrays)}), got {limits.shape}")
        tree = cls._build(arrays, limits, flat)
        if loss_masks is not None:
            tree.loss_mask = _unique_loss_mask(tree, arrays, loss_masks)
        return tree

    @classmethod
    def _build(cls, arrays: List[np.ndarray], limits: Optional[np.ndarray], flat: np.ndarray) -> "BranchTree":
        num = len(arrays)
        lengths = np.array([a.size for a in arrays], dtype=np.int64)
        max_len = int(lengths.max())
        mat = np.full((num, max_len), -1, dtype=np.int64)
        # one masked fill (row-major order is the rollouts' order), not a slice per rollout
        mat[np.arange(max_len)[None, :] < lengths[:, None]] = flat
        order = _lexicographic_order(arrays, flat)
        smat, slen = mat[order], lengths[order]

        # lcp[k]: common prefix of sorted rollouts k-1 and k (lcp[0] = 0).
        lcp = np.zeros(num, dtype=np.int64)
        if num > 1:
            diff = smat[1:] != smat[:-1]  # [R-1, max_len]
            first = np.where(diff.any(axis=1), diff.argmax(axis=1), max_len)
            lcp[1:] = np.minimum(first, np.minimum(slen[1:], slen[:-1]))
            if limits is not None:
                slim = limits[order]
                lcp[1:] = np.minimum(lcp[1:], np.minimum(slim[1:], slim[:-1]))
        new = slen - lcp  # tokens each sorted rollout adds to the trie
        offset = np.zeros(num + 1, dtype=np.int64)
        np.cumsum(new, out=offset[1:])
        total = int(offset[-1])

        # rows in sorted order: (k, d) is new where d >= lcp[k], else it is the row of
        # (k - 1, d), i.e. of the last rollout k' <= k for which depth d was new
        depth = np.arange(max_len)[None, :]
        new_here = lcp[:, None] <= depth  # row 0 is new everywhere (lcp[0] = 0)
        owner = np.maximum.accumulate(np.where(new_here, np.arange(num)[:, None], 0), axis=0)
        inside = depth < slen[:, None]
        srows = np.where(inside, offset[owner] + depth - lcp[owner], -1)

        # the new tokens in row-major order are the packed rows offset[k] + d - lcp[k]
        fresh = new_here & inside
        tokens = smat[fresh]
        positions = np.broadcast_to(depth, smat.shape)[fresh]
        parents = np.concatenate([np.full((num, 1), -1, dtype=np.int64), srows[:, :-1]], axis=1)[fresh]

        # The walks below are scalar: Python ints, not numpy scalars (indexing a numpy
        # array per step made them most of the build: 256 rollouts, 343 segments).
        lcp_l, slen_l, new_l, offset_l = lcp.tolist(), slen.tolist(), new.tolist(), offset.tolist()
        # next_smaller[k]: first k' > k with lcp[k'] < lcp[k] (monotonic stack).
        next_smaller = [num] * (num + 1)
        stack: List[int] = []
        for k in range(num):
            while stack and lcp_l[k] < lcp_l[stack[-1]]:
                next_smaller[stack.pop()] = k
            stack.append(k)

        # Split each rollout's new chain where a later rollout branches off it. Walking
        # the "staircase" of prefix minima of lcp after k gives, from deep to shallow,
        # the depth at which each later group leaves, and where the subtree ends.
        raw_segments: List[tuple] = []  # (start, end, subtree_end)
        for k in range(num):
            if new_l[k] == 0:
                continue
            lo_depth, upper = lcp_l[k], slen_l[k]
            pieces = []  # (first depth, end depth, subtree end), deep to shallow
            s = k + 1
            while s < num and lcp_l[s] > lo_depth:
                # tokens at depth >= lcp[s] have a subtree ending where rollout s begins
                if lcp_l[s] < upper:
                    pieces.append((lcp_l[s], upper, offset_l[s]))
                    upper = lcp_l[s]
                s = next_smaller[s]
            if lo_depth < upper:
                pieces.append((lo_depth, upper, offset_l[s] if s < num else total))
            base = offset_l[k] - lo_depth
            raw_segments.extend((base + d0, base + d1, sub_end) for d0, d1, sub_end in reversed(pieces))
        raw_segments.sort()
        # A chain continued by a rollout that extends it (prefix-of-another) is one segment.
        merged: List[tuple] = []
        for start, end, sub_end in raw_segments:
            if merged and merged[-1][1] == start and merged[-1][2] == sub_end:
                merged[-1] = (merged[-1][0], end, sub_end)
            else:
                merged.append((start, end, sub_end))
        # the sorted segments tile [0, total): every token's segment and subtree end at once
        seg_arr = np.array(merged, dtype=np.int64).reshape(-1, 3)
        sizes = seg_arr[:, 1] - seg_arr[:, 0]
        last = np.repeat(seg_arr[:, 2] - 1, sizes)
        seg_of = np.repeat(np.arange(len(merged)), sizes)
        first_parent = parents[seg_arr[:, 0]]
        parent_seg = np.where(first_parent >= 0, seg_of[np.maximum(first_parent, 0)], -1).tolist()
        segments = [BranchSegment(start, end, sub_end, par)
                    for (start, end, sub_end), par in zip(merged, parent_seg)]

        rows = np.full((num, max_len), -1, dtype=np.int64)
        rows[order] = srows
        return cls(
            tokens=torch.from_numpy(tokens),
            positions=torch.from_numpy(positions),
            parents=torch.from_numpy(parents),
            last=torch.from_numpy(last),
            rows=torch.from_numpy(rows),
            lengths=torch.from_numpy(lengths),
            segments=segments,
        )

    loss_mask: Optional[torch.Tensor] = None

    def rollout_loss_mask(self) -> torch.Tensor:
        """``[R, max_len - 1]`` float mask of the positions whose log-prob a loss reads:
        ``mask[r, t]`` is the loss mask of token ``t + 1`` of rollout ``r`` (0 past its end).

        Raises:
            ValueError: the tree was built without ``loss_masks``.
        """
        if self.loss_mask is None:
            raise ValueError("loss_masks: this tree was built without loss masks (BranchTree.from_sequences)")
        rows = self.rows[:, 1:]
        return torch.where(rows >= 0, self.loss_mask[rows.clamp(min=0)], torch.zeros((), dtype=torch.bool)).float()

    # ------------------------------------------------------------------ properties
    @property
    def num_rollouts(self) -> int:
        """Number of rollouts ``R``."""
        return int(self.lengths.numel())

    @property
    def naive_positions(self) -> int:
        """Token positions a per-rollout trainer computes: ``sum(len(rollout))``."""
        return int(self.lengths.sum())

    @property
    def unique_positions(self) -> int:
        """Packed length ``U``: the number of trie nodes."""
        return int(self.tokens.numel())

    @property
    def multiplicity(self) -> torch.Tensor:
        """``[U]`` number of rollouts that contain each packed token (1 for an unshared
        token, ``G`` for a prompt token shared by ``G`` rollouts): the weight a per-token
        statistic of the naive batch gives each unique position."""
        cached = getattr(self, "_multiplicity", None)
        if cached is None:
            rows = self.rows[self.rows >= 0]
            cached = self._multiplicity = torch.bincount(rows, minlength=self.unique_positions)
        return cached

    @property
    def max_len(self) -> int:
        """Length of the longest rollout."""
        return int(self.lengths.max())

    @property
    def max_position(self) -> int:
        """Largest depth (RoPE position) in the tree."""
        return int(self.positions.max())

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first rollout with a token id ``>= vocab_size``."""
        if not self.unique_positions or int(self.tokens.max()) < vocab_size:
            return
        bad = int(self.tokens.max())
        packed = int((self.tokens == bad).nonzero()[0])
        rollout = int((self.rows == packed).any(1).nonzero()[0])
        raise ValueError(f"rollout {rollout}: tokens contains id {bad} outside the vocabulary of size {vocab_size}")

    def sequence(self, r: int) -> torch.Tensor:
        """Token ids of rollout ``r`` (reconstructed from the packed tree)."""
        return self.tokens[self.rows[r, : int(self.lengths[r])]]

    def visibility_mask(self) -> torch.Tensor:
        """Dense ``[U, U]`` bool mask, True where query ``i`` may attend to key ``j``.

        O(U^2) memory: for references and tests only.
        """
        idx = torch.arange(self.unique_positions)
        return (idx[None, :] <= idx[:, None]) & (idx[:, None] <= self.last[None, :])

    def attention_pairs(self) -> int:
        """Number of visible (query, key) pairs: the tree's real attention work."""
        return int(sum((s.end - s.start) * (s.end - s.start + 1) // 2
                       + (s.end - s.start) * (s.subtree_end - s.end) for s in self.segments))

    def segments_in(self, start: int, end: int) -> List[BranchSegment]:
        """Segments overlapping the packed range ``[start, end)`` (binary search)."""
        ends = getattr(self, "_segment_ends", None)
        if ends is None:
            ends = self._segment_ends = np.array([s.end for s in self.segments], dtype=np.int64)
        first = int(np.searchsorted(ends, start, side="right"))
        out = []
        for seg in self.segments[first:]:
            if seg.start >= end:
                break
            out.append(seg)
        return out

    def to(self, device: Union[str, torch.device]) -> "BranchTree":
        """Copy of the tree with its tensors on ``device``."""
        out = BranchTree(
            self.tokens.to(device), self.positions.to(device), self.parents.to(device),
            self.last.to(device), self.rows.to(device), self.lengths.to(device), self.segments,
        )
        out.loss_mask = None if self.loss_mask is None else self.loss_mask.to(device)
        return out

    def __repr__(self) -> str:
        return (
            f"BranchTree(rollouts={self.num_rollouts}, naive_positions={self.naive_positions}, "
            f"unique_positions={self.unique_positions}, segments={len(self.segments)})"
        )
