"""The path's recurrent state for streaming replay: what a stem hands to the units below it.

Our own code, the recurrent counterpart of the K/V rows of
:class:`~megatron_branch.attention.path_cache.PathCache`. For each recurrent layer (Gated
DeltaNet) and each stem on the path it keeps

* the stem's **convolution inputs**, one row per token in the same row range as the
  stem's K/V (``[capacity, channels]`` per layer): a unit below reads the last
  ``window - 1`` rows of the path, and
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
    """Per-layer convolution rows and per-stem final states of the stems on a path."""

    def __init__(self, cache):  # the PathCache that owns it (its rows, stems and capacity)
        self.cache = cache
        self.rows: Dict[int, Tensor] = {}
        self.rows_grad: Dict[int, Tensor] = {}
        self.state: Dict[Tuple[int, int], Tensor] = {}
        self.state_grad: Dict[Tuple[int, int], Tensor] = {}
        self._written: Dict[int, set] = {}  # stem id -> layers written

    # ----------------------------------------------------------------- writing
    def record(self, layer_number: int, x: Tensor, rows: int, state: Tensor, stem_id: int) -> None:
        """Stem ``stem_id``'s convolution inputs ``x [s, C]`` (first ``rows`` real) and its
        final state ``[H, dk, dv]`` for one layer; a recompute of the stem leaves them."""
        cache = self.cache
        if layer_number in self._written.get(stem_id, ()):
            return
        if cache.open != stem_id:
            raise RuntimeError(f"RecurrentPath.record: stem {stem_id} is not the stem being forwarded")
        cache.open_rows = rows
        if layer_number not in self.rows:
            self.rows[layer_number] = x.new_empty((cache.capacity, x.shape[-1]))
            if cache.requires_grad:
                self.rows_grad[layer_number] = x.new_zeros((cache.capacity, x.shape[-1]), dtype=_acc_dtype(x))
        if cache.length + rows > cache.capacity:
            raise RuntimeError(f"PathCache: {cache.length + rows} rows exceed the planned capacity {cache.capacity}")
        with torch.no_grad():
            self.rows[layer_number][cache.length:cache.length + rows].copy_(x[:rows])
        # the kernel's state dtype (float32 from Megatron's and FLA's kernels), never rounded
        self.state[(layer_number, stem_id)] = state.detach()
        if cache.requires_grad:
            self.state_grad[(layer_number, stem_id)] = torch.zeros_like(state, dtype=_acc_dtype(state))
        self._written.setdefault(stem_id, set()).add(layer_number)

    def release(self, stem_id: int, lo: int, hi: int) -> None:
        """Forget a stem whose backward has run (its rows are reused by the next stem)."""
        for grad in self.rows_grad.values():
            grad[lo:hi].zero_()
        for key in [k for k in self.state if k[1] == stem_id]:
            self.state.pop(key)
            self.state_grad.pop(key, None)
        self._written.pop(stem_id, None)

    # ----------------------------------------------------------------- reading
    def tail(self, layer_number: int, width: int) -> Optional[Tensor]:
        """The last ``<= width`` convolution inputs of the path ``[r, C]`` (None: none)."""
        cache = self.cache
        if layer_number not in self.rows or width <= 0 or cache.length == 0:
            return None
        lo = max(0, cache.length - width)
        rows = self.rows[layer_number][lo:cache.length]
        if not (cache.requires_grad and torch.is_grad_enabled()):
            return rows.detach()
        return _ReadRows.apply(rows.detach().requires_grad_(), self, layer_number, lo)

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
    def inject_rows(self, x: Tensor, layer_number: int, stem_id: int) -> Tensor:
        """``x [s, C]`` with the stem's accumulated row gradients added in its backward."""
        return _InjectRows.apply(x, self, layer_number, stem_id)

    def inject_state(self, out: Tensor, state: Tensor, layer_number: int, stem_id: int) -> Tensor:
        """``out`` unchanged; its backward also sends the stem's accumulated state gradient
        into ``state`` (which the stem's own outputs do not depend on)."""
        return _InjectState.apply(out, state, self, layer_number, stem_id)

    def nbytes(self) -> int:
        rows = sum(self.cache.length * r.shape[-1] * r.element_size() for r in self.rows.values())
        return rows + sum(s.numel() * s.element_size() for s in self.state.values())


def _acc_dtype(x: Tensor) -> torch.dtype:
    # gradients accumulate in float32 at least (bf16 rows), in the data's own wider dtype above
    return torch.promote_types(x.dtype, torch.float32)


class _ReadRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, path: RecurrentPath, layer_number: int, lo: int):
        ctx.path, ctx.layer, ctx.lo = path, layer_number, lo
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        acc = ctx.path.rows_grad[ctx.layer]
        acc[ctx.lo:ctx.lo + grad.shape[0]] += grad.to(acc.dtype)
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
    def forward(ctx, x: Tensor, path: RecurrentPath, layer_number: int, stem_id: int):
        ctx.path, ctx.layer, ctx.stem_id = path, layer_number, stem_id
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        path, cache = ctx.path, ctx.path.cache
        stem = cache.rows_of.get(ctx.stem_id)
        if stem is not None and ctx.layer in path.rows_grad:
            grad = grad.clone()
            grad[: stem.hi - stem.lo] += path.rows_grad[ctx.layer][stem.lo:stem.hi].to(grad.dtype)
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
