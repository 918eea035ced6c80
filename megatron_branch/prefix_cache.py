"""The prefix-activation cache: per-layer K/V of the stems along the current path.

Our own code. A stem unit's attention records its keys and values (after RoPE) as leaf
tensors; the units below attend to them, so their backwards accumulate the stem's
``dK``/``dV`` in the leaves' ``.grad``. When the stem's own backward finally runs, an
identity node on its K/V (:class:`InjectGrad`) adds those accumulated gradients — this
also works when Megatron's activation recompute re-runs the layer inside the backward,
because the node is created in whichever forward builds the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor


@dataclass(eq=False)
class StemCache:
    """K/V of one stem unit: ``layer_number -> (k [n, kv_heads, d], v [n, kv_heads, d])``."""

    start: int
    end: int
    requires_grad: bool = False
    kv: Dict[int, Tuple[Tensor, Tensor]] = field(default_factory=dict)
    cp: Optional[object] = None  # the CPLayout the K/V are sharded by, if any

    def record(self, layer_number: int, key: Tensor, value: Tensor, rows: int) -> Tuple[Tensor, Tensor]:
        """Store the layer's K/V once (a recompute of the same forward keeps the first).

        Only the first ``rows`` rows are kept (the rest is padding). The stored tensors
        are leaves (``requires_grad`` in exact replay) that collect the ``dK``/``dV`` of
        every unit below the stem.
        """
        if layer_number not in self.kv:
            # [s, 1, hk, d] -> [rows, hk, d]
            k = key[:rows, 0].detach().requires_grad_(self.requires_grad)
            v = value[:rows, 0].detach().requires_grad_(self.requires_grad)
            self.kv[layer_number] = (k, v)
        return self.kv[layer_number]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kv.values() for t in pair)


class _LeafRef:
    """Holds a leaf without making it an autograd input of :class:`InjectGrad`."""

    __slots__ = ("leaf",)

    def __init__(self, leaf: Tensor):
        self.leaf = leaf


class InjectGrad(torch.autograd.Function):
    """Identity whose backward adds ``leaf.grad`` (read at backward time) to the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, ref: _LeafRef) -> Tensor:
        ctx.ref = ref
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        extra = ctx.ref.leaf.grad
        if extra is not None:
            # leaf [rows, hk, d] -> [rows, 1, hk, d], added to the first rows (no padding)
            grad = grad.clone()
            grad[: extra.shape[0]] += extra.unsqueeze(1).to(grad.dtype)
        return grad, None


def inject(x: Tensor, leaf: Tensor) -> Tensor:
    """``x`` with the gradient accumulated in ``leaf.grad`` added in its backward."""
    return InjectGrad.apply(x, _LeafRef(leaf))


def prefix_kv(stems: List[StemCache], layer_number: int) -> List[Tuple[Tensor, Tensor]]:
    """The cached (k, v) of ``layer_number`` for every stem on the path, root first.

    Under context parallelism each stem's K/V are sharded; they are all-gathered here
    (differentiably: the backward sends each shard's ``dK``/``dV`` back to its owner).
    """
    from megatron_branch.context_parallel import gather_rows

    out = []
    for s in stems:
        k, v = s.kv[layer_number]
        if s.cp is not None:
            k, v = gather_rows(k, s.cp, everything=True), gather_rows(v, s.cp, everything=True)
        out.append((k, v))
    return out
