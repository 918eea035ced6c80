"""The path's recurrent state for streaming replay: what a stem hands to the units below it.

Our own code, the recurrent counterpart of the K/V rows of
:class:`~megatron_branch.attention.path_cache.PathCache`. For each recurrent layer (Gated
DeltaNet) and each stem on the path it keeps

* the stem's last ``window - 1`` **convolution inputs** (``[window - 1, channels]``):
  a unit below reads the last ``window - 1`` inputs of the path (across stems when they
  are short), and
* the stem's **final recurrent state** ``[heads, d_k, d_v]``: a unit below (or the next
  stem) starts its top segments from the deepest stem's state.

Gradients mirror the K/V ones: what a unit reads is a differentiable view whose backward
adds into per-stem accumulators (:class:`_ReadRows`, :class:`_ReadState`); when the
stem's own backward runs, :class:`_InjectRows` adds the accumulated rows to its
convolution inputs and :class:`_InjectState` feeds the accumulated state gradient into
the final state it computed, from where it flows on into the stem's parameters and into
the state of the stem above (read through the same kind of view).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor


class RecurrentPath:
    """Per layer and stem on the path: the stem's last convolution inputs and final state."""

    def __init__(self, cache):  # the PathCache that owns it (its stems and grad mode)
        self.cache = cache
        self.rows: Dict[Tuple[int, int], Tensor] = {}  # (layer, stem) -> [<= window - 1, C]
        self.rows_grad: Dict[Tuple[int, int], Tensor] = {}
        self.state: Dict[Tuple[int, int], Tensor] = {}  # (layer, stem) -> [H, dk, dv]
        self.state_grad: Dict[Tuple[int, int], Tensor] = {}

    # ----------------------------------------------------------------- writing
    def record(self, layer_number: int, x: Tensor, rows: int, window: int, state: Tensor, stem_id: int) -> None:
        """Stem ``stem_id``'s last ``window - 1`` convolution inputs (of ``x [s, C]``, first
        ``rows`` real) and its final state ``[H, dk, dv]`` for one layer. Only what a unit
        below can read is kept: ``O(window * C)`` per stem, whatever its length. A
        recompute of the stem leaves them."""
        cache = self.cache
        key = (layer_number, stem_id)
        if key in self.state:
            return
        if cache.open != stem_id:
            raise RuntimeError(f"RecurrentPath.record: stem {stem_id} is not the stem being forwarded")
        cache.open_rows = rows
        keep = min(rows, max(window - 1, 0))
        self.rows[key] = x[rows - keep:rows].detach().clone()
        # the kernel's state dtype (float32 from Megatron's and FLA's kernels), never rounded
        self.state[key] = state.detach()
        if cache.requires_grad:
            self.rows_grad[key] = torch.zeros_like(self.rows[key], dtype=_acc_dtype(x))
            self.state_grad[key] = torch.zeros_like(state, dtype=_acc_dtype(state))

    def release(self, stem_id: int) -> None:
        """Forget a stem whose backward has run."""
        for store in (self.rows, self.rows_grad, self.state, self.state_grad):
            for key in [k for k in store if k[1] == stem_id]:
                store.pop(key)

    # ----------------------------------------------------------------- reading
    def tail(self, layer_number: int, width: int) -> Optional[Tensor]:
        """The last ``<= width`` convolution inputs of the path ``[r, C]``, deepest stem
        last (several stems when they are short), or None."""
        parts = []
        have = 0
        for stem in reversed(self.cache.stems):
            if have >= width:
                break
            key = (layer_number, stem.stem_id)
            if key not in self.rows:
                break
            rows = self.rows[key][-(width - have):] if width - have < self.rows[key].shape[0] else self.rows[key]
            if rows.shape[0]:
                parts.append(self._read(rows, key, self.rows[key].shape[0] - rows.shape[0]))
                have += rows.shape[0]
        if not parts:
            return None
        return torch.cat(parts[::-1])

    def _read(self, rows: Tensor, key, offset: int) -> Tensor:
        if not (self.cache.requires_grad and torch.is_grad_enabled()):
            return rows
        return _ReadRows.apply(rows.detach().requires_grad_(), self, key, offset)

    def path_state(self, layer_number: int) -> Optional[Tensor]:
        """The deepest stem's final state ``[H, dk, dv]``, or None."""
        cache = self.cache
        if not cache.stems:
            return None
        key = (layer_number, cache.stems[-1].stem_id)
        if key not in self.state:
            return None
        state = self.state[key]
        if not (cache.requires_grad and torch.is_grad_enabled()):
            return state
        return _ReadState.apply(state.detach().requires_grad_(), self, key)

    # ----------------------------------------------------------------- injecting
    def inject_rows(self, x: Tensor, rows: int, layer_number: int, stem_id: int) -> Tensor:
        """``x [s, C]`` with the stem's accumulated gradients of its last inputs (before
        row ``rows``) added in its backward."""
        return _InjectRows.apply(x, self, (layer_number, stem_id), rows)

    def inject_state(self, out: Tensor, state: Tensor, layer_number: int, stem_id: int) -> Tensor:
        """``out`` unchanged; its backward also sends the stem's accumulated state gradient
        into ``state`` (which the stem's own outputs do not depend on)."""
        return _InjectState.apply(out, state, self, layer_number, stem_id)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for store in (self.rows, self.state) for t in store.values())


def _acc_dtype(x: Tensor) -> torch.dtype:
    # gradients accumulate in float32 at least (bf16 rows), in the data's own wider dtype above
    return torch.promote_types(x.dtype, torch.float32)


class _ReadRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, path: RecurrentPath, key, offset: int):
        ctx.path, ctx.key, ctx.offset = path, key, offset
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        acc = ctx.path.rows_grad[ctx.key]
        acc[ctx.offset:ctx.offset + grad.shape[0]] += grad.to(acc.dtype)
        return None, None, None, None


class _ReadState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: Tensor, path: RecurrentPath, key):
        ctx.path, ctx.key = path, key
        return state.view_as(state)

    @staticmethod
    def backward(ctx, grad: Tensor):
        acc = ctx.path.state_grad[ctx.key]
        acc += grad.to(acc.dtype)
        return None, None, None


class _InjectRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, path: RecurrentPath, key, rows: int):
        ctx.path, ctx.key, ctx.rows = path, key, rows
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        acc = ctx.path.rows_grad.get(ctx.key)
        if acc is not None and acc.shape[0]:
            grad = grad.clone()
            grad[ctx.rows - acc.shape[0]:ctx.rows] += acc.to(grad.dtype)
        return grad, None, None, None


class _InjectState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: Tensor, state: Tensor, path: RecurrentPath, layer_number: int, stem_id: int):
        ctx.path, ctx.key = path, (layer_number, stem_id)
        ctx.state_meta = (state.shape, state.dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        acc = ctx.path.state_grad.get(ctx.key)
        state_grad = acc.to(ctx.state_meta[1]) if acc is not None else None
        return grad, state_grad, None, None, None
