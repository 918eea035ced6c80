"""The prefix-activation cache: per-layer K/V of the stems on the current path.

Our own code. Streaming replay walks the tree depth first; the stems on its stack are
exactly the ancestors of the unit being run, root first. Their keys and values (after
RoPE) live in one contiguous buffer per layer, rows ``[0, length)``: a stem forward writes
its rows once, every unit below attends to all rows at once (one prefix piece, whatever
the number of stems), and popping a stem just shortens ``length``. The buffers are sized
once per step for the deepest stem path, so no view handed to autograd is ever
reallocated.

Gradients: the prefix handed to attention is a differentiable view
(:func:`PathCache.prefix`) whose backward adds ``dK``/``dV`` into per-layer accumulators
of the same shape (``O(rows used)`` work, no full-buffer gradient). When a stem's own
backward finally runs, an identity node on its K/V (:class:`InjectGrad`) adds the
accumulated rows — which also works when Megatron's activation recompute re-runs the
layer inside the backward, because the node is created in whichever forward builds the
graph. Under context parallelism every rank keeps only its shard of each stem (the
prefix attention is computed where the keys live, see :mod:`megatron_branch.attention.cascade`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from megatron_branch.attention.recurrent_path import RecurrentPath


@dataclass(frozen=True)
class StemRows:
    """One stem on the path: its id and its rows ``[lo, hi)`` in the cache (this rank's)."""

    stem_id: int
    lo: int
    hi: int


class PathCache:
    """K/V of the stems on the current path, per layer, in contiguous buffers.

    Args:
        capacity: most rows ever held at once (this rank's share of the deepest stem path).
        requires_grad: keep ``dK``/``dV`` accumulators (exact replay).
    """

    def __init__(self, capacity: int, requires_grad: bool):
        self.capacity = int(capacity)
        self.requires_grad = requires_grad
        self.kv: Dict[int, Tuple[Tensor, Tensor]] = {}
        self.grad: Dict[int, Tuple[Tensor, Tensor]] = {}
        self.length = 0  # rows of the stems on the path
        self.stems: List[StemRows] = []
        self.open: Optional[int] = None  # the stem whose forward is running
        self.open_rows = 0
        self._written: Dict[int, set] = {}  # stem id -> layers whose rows it has written
        self.rows_of: Dict[int, StemRows] = {}  # stem id -> its rows (kept after the pop)
        self._next_id = 0
        self.peak_bytes = 0
        # recurrent layers' convolution rows and final states (Gated DeltaNet)
        self.recurrent = RecurrentPath(self)

    # ------------------------------------------------------------------ stems
    def begin_stem(self, stem_id: Optional[int] = None) -> int:
        """Start a stem forward (a new stem, or re-run ``stem_id`` for its backward)."""
        if stem_id is None:
            stem_id, self._next_id = self._next_id, self._next_id + 1
        self.open, self.open_rows = stem_id, 0
        return stem_id

    def push(self) -> StemRows:
        """The open stem's rows join the path (after its forward)."""
        stem = StemRows(self.open, self.length, self.length + self.open_rows)
        self.stems.append(stem)
        self.rows_of[stem.stem_id] = stem
        self.length = stem.hi
        self.open = None
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        return stem

    def pop(self) -> StemRows:
        """Remove the deepest stem from the path; its rows are reused by the next stem."""
        stem = self.stems.pop()
        self.length = stem.lo
        return stem

    def release(self, stem: StemRows) -> None:
        """Clear the gradient rows of a stem whose backward has run."""
        for gk, gv in self.grad.values():
            gk[stem.lo:stem.hi].zero_()
            gv[stem.lo:stem.hi].zero_()
        self.recurrent.release(stem.stem_id)
        self.rows_of.pop(stem.stem_id, None)
        self._written.pop(stem.stem_id, None)

    @property
    def has_path(self) -> bool:
        """Some stem is on the path (on every CP rank alike, even one holding no rows)."""
        return bool(self.stems)

    # ------------------------------------------------------------------ layers
    def record(self, layer_number: int, key: Tensor, value: Tensor, rows: int, stem_id: int) -> None:
        """Write stem ``stem_id``'s K/V of one layer (``[s, 1, hk, d]``, first ``rows`` real).

        A recompute of the same stem (Megatron's activation recompute inside the stem's
        backward, or ``recompute_stem``) finds its rows written and leaves them.
        """
        if layer_number in self._written.get(stem_id, ()):
            return
        if self.open != stem_id:
            raise RuntimeError(f"PathCache.record: stem {stem_id} is not the stem being forwarded")
        self.open_rows = rows
        if layer_number not in self.kv:
            # K and V heads may differ in width (multi-latent attention)
            k_shape = (self.capacity,) + tuple(key.shape[2:])
            v_shape = (self.capacity,) + tuple(value.shape[2:])
            self.kv[layer_number] = (key.new_empty(k_shape), value.new_empty(v_shape))
            if self.requires_grad:
                self.grad[layer_number] = (key.new_zeros(k_shape, dtype=torch.float32),
                                           value.new_zeros(v_shape, dtype=torch.float32))
        if self.length + rows > self.capacity:
            raise RuntimeError(f"PathCache: {self.length + rows} rows exceed the planned capacity {self.capacity}")
        k, v = self.kv[layer_number]
        with torch.no_grad():
            # [s, 1, hk, d] -> [rows, hk, d]
            k[self.length:self.length + rows].copy_(key[:rows, 0])
            v[self.length:self.length + rows].copy_(value[:rows, 0])
        self._written.setdefault(stem_id, set()).add(layer_number)

    def prefix(self, layer_number: int) -> Tuple[Tensor, Tensor]:
        """``(k, v)`` ``[length, hk, d]`` of the whole path, differentiable into the
        accumulators (exact replay) or constant (tail-only, no grad)."""
        k, v = self.kv[layer_number]
        pk, pv = k[:self.length], v[:self.length]
        if not (self.requires_grad and torch.is_grad_enabled()):
            return pk.detach(), pv.detach()
        # detached leaves only mark the function's outputs as differentiable; its backward
        # writes into the accumulators and gives them nothing
        return _PathPrefix.apply(pk.detach().requires_grad_(), pv.detach().requires_grad_(), self, layer_number)

    def accumulated(self, layer_number: int, stem_id: int) -> Optional[Tuple[Tensor, Tensor]]:
        """The gradient rows accumulated for stem ``stem_id`` in one layer."""
        if layer_number not in self.grad or stem_id not in self.rows_of:
            return None
        stem = self.rows_of[stem_id]
        gk, gv = self.grad[layer_number]
        return gk[stem.lo:stem.hi], gv[stem.lo:stem.hi]

    def nbytes(self) -> int:
        """Bytes of K/V held for the current path (all layers)."""
        # per row: a K and a V row (a rank may hold no row of the path under CP: 0 bytes)
        return sum(self.length * (k[0].numel() * k.element_size() + v[0].numel() * v.element_size())
                   for k, v in self.kv.values() if k.shape[0]) + self.recurrent.nbytes()


class _PathPrefix(torch.autograd.Function):
    """The path's K/V as an attention input; the backward adds into the cache's accumulators."""

    @staticmethod
    def forward(ctx, pk: Tensor, pv: Tensor, cache: PathCache, layer_number: int):
        ctx.cache, ctx.layer, ctx.rows = cache, layer_number, pk.shape[0]
        return pk.view_as(pk), pv.view_as(pv)

    @staticmethod
    def backward(ctx, gk: Optional[Tensor], gv: Optional[Tensor]):
        acc_k, acc_v = ctx.cache.grad[ctx.layer]
        if gk is not None:
            acc_k[:ctx.rows] += gk.float()
        if gv is not None:
            acc_v[:ctx.rows] += gv.float()
        return None, None, None, None


class InjectGrad(torch.autograd.Function):
    """Identity on a stem's K/V whose backward adds the gradients accumulated for it
    (read at backward time) to the first rows (the rest is padding)."""

    @staticmethod
    def forward(ctx, x: Tensor, cache: PathCache, layer_number: int, index: int, stem_id: int) -> Tensor:
        ctx.cache, ctx.layer, ctx.index, ctx.stem_id = cache, layer_number, index, stem_id
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows = ctx.cache.accumulated(ctx.layer, ctx.stem_id)
        if rows is not None:
            extra = rows[ctx.index]
            # [rows, hk, d] -> [rows, 1, hk, d]
            grad = grad.clone()
            grad[: extra.shape[0]] += extra.unsqueeze(1).to(grad.dtype)
        return grad, None, None, None, None


def inject(key: Tensor, value: Tensor, cache: PathCache, layer_number: int, stem_id: int) -> Tuple[Tensor, Tensor]:
    """``key``/``value`` with the stem's accumulated ``dK``/``dV`` added in their backward."""
    return (InjectGrad.apply(key, cache, layer_number, 0, stem_id),
            InjectGrad.apply(value, cache, layer_number, 1, stem_id))
