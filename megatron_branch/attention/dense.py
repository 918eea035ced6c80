"""Dense boolean-mask tree attention: the simple reference backend.

Builds the ``[U, U]`` visibility mask ``j <= i <= last[j]`` and runs attention with it:
float32 inputs through torch's fused SDPA with the boolean mask (the fastest exact form of
a dense mask; on CPU the flash kernel), other dtypes as a plain softmax in float32 with
ordinary autograd. O(U^2) mask memory: meant for tests, small trees and the benchmark's
dense-mask baseline; the default backend is :mod:`megatron_branch.attention.cascade`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


# SDPA groups query heads over fewer K/V heads itself from torch 2.5 (``enable_gqa``).
SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def visibility_mask(last: Tensor) -> Tensor:
    """``[U, U]`` bool, True where query ``i`` may attend to key ``j`` (``j <= i <= last[j]``)."""
    idx = torch.arange(last.numel(), device=last.device)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] <= last[None, :])


def dense_tree_attention(
    q: Tensor, k: Tensor, v: Tensor, last: Tensor, scale: float, prefix: Optional[Tuple[Tensor, Tensor]] = None
) -> Tensor:
    """Tree attention with an explicit mask.

    Args:
        q: ``[U, heads, head_dim]``; k, v: ``[U, kv_heads, head_dim]`` (GQA repeated here).
        last: ``[U]`` packed index of the last token of each token's subtree.
        scale: softmax scale.
        prefix: the cached path ``(k, v)`` every query sees (streaming replay).

    Returns:
        ``[U, heads, head_dim]`` in the dtype of ``q``.
    """
    n = q.shape[0]
    mask = visibility_mask(last)
    if prefix is not None:
        k = torch.cat([prefix[0], k])
        v = torch.cat([prefix[1], v])
        mask = torch.cat([torch.ones(n, k.shape[0] - n, dtype=torch.bool, device=mask.device), mask], 1)
    rep = q.shape[1] // k.shape[1]
    fused = q.dtype == torch.float32 and k.shape[-1] == v.shape[-1]
    if rep > 1 and not (fused and SDPA_GQA):
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if fused:
        # float32: torch's fused SDPA with the boolean mask (on CPU the flash kernel), the
        # fastest exact form of a dense mask; [n, h, d] -> [1, h, n, d]
        gqa = {"enable_gqa": True} if rep > 1 and SDPA_GQA else {}
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
            **gqa)
        return out[0].transpose(0, 1)
    # [n, h, d] x [P + n, h, d] -> [h, n, P + n]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
