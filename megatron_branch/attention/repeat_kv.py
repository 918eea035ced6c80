"""Tree attention with repeated K/V: the "prompt once, K/V repeated" baseline.

Each segment's queries attend to a *copy* of the K/V of all its ancestors followed by
its own keys (causal on its own part), one fused SDPA call per segment. On a tree that
shares only prompts this is how Prefix Grouper computes attention; it is exact, but
copies the shared K/V once per branch. Kept for benchmarks and as a third reference.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_branch.tree import BranchSegment


def ancestor_ranges(segments: Sequence[BranchSegment]) -> List[List[range]]:
    """For each segment, the packed ranges of its ancestor segments, root first."""
    out = []
    for seg in segments:
        chain, p = [], seg.parent
        while p >= 0:
            chain.append(range(segments[p].start, segments[p].end))
            p = segments[p].parent
        out.append(chain[::-1])
    return out


def repeated_kv_attention(
    q: Tensor, k: Tensor, v: Tensor, segments: Sequence[BranchSegment], scale: float
) -> Tensor:
    """Args/returns as :func:`~megatron_branch.attention.dense.dense_tree_attention`."""
    outs = []
    heads = q.shape[1]
    for seg, ancestors in zip(segments, ancestor_ranges(segments)):
        idx = torch.cat([torch.arange(r.start, r.stop) for r in ancestors]
                        + [torch.arange(seg.start, seg.end)]).to(q.device)
        n, ctx = seg.end - seg.start, idx.numel()
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device)
        mask[:, ctx - n:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # [n, h, d] -> [1, h, n, d]; repeated K/V [ctx, hk, d] -> [1, hk, ctx, d]
        qs = q[seg.start:seg.end].transpose(0, 1).unsqueeze(0)
        ks = k.index_select(0, idx).transpose(0, 1).unsqueeze(0)
        vs = v.index_select(0, idx).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                           enable_gqa=ks.shape[1] != heads)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)
