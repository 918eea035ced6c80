"""Attention-piece kernels that return the log-sum-exp, and their backwards.

A *piece* is a dense attention of a query range on a key range, either unmasked or
causal on a square (the query and key ranges coincide). Every kernel here takes
Megatron's per-token layout ``[n, heads, head_dim]`` views (no copies) and returns
``out [nq, heads, head_dim]`` and ``lse [heads, nq]`` (float32). The backward takes the
*merged* output and log-sum-exp of all pieces of a query, as ring/cascade attention
requires: ``P = exp(S - lse_merged)``, ``D = rowsum(dO * O_merged)``.

* ``flash_cpu``: torch's fused CPU flash-attention kernel
  (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward) — the same
  kernel family torch's SDPA uses on CPU, memory O(n * head_dim).
* ``math``: plain matmuls in float32 on any device; memory O(nq * nk * heads), so the
  caller tiles keys as well as queries. The default off CPU until ``flash_cuda`` has
  passed ``tools/gpu_check.py`` on a GPU.
* ``flash_cuda``: torch's CUDA flash kernel with its log-sum-exp (bf16/fp16); opt in with
  ``get_branch_layer_spec(kernel="flash_cuda")``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def _bhsd(x: Tensor) -> Tensor:
    # [n, h, d] -> [1, h, n, d] (a view)
    return x.transpose(0, 1).unsqueeze(0)


def flash_cpu_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
    )
    # out [1, h, nq, d] -> [nq, h, d]; lse [1, h, nq] -> [h, nq]
    return out[0].transpose(0, 1), lse[0]


def flash_cpu_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.unsqueeze(0).contiguous(),
        0.0, causal, scale=scale,
    )
    return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    # [nq, h, d] x [nk, h, d] -> [h, nq, nk]
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        n = q.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # [h, nq]
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("hqk,khd->qhd", p, v.float())
    return out.to(q.dtype), lse


def math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.unsqueeze(-1))  # [h, nq, nk]
    do = dout.float()
    dv = torch.einsum("hqk,qhd->khd", p, do)
    dp = torch.einsum("qhd,khd->hqk", do, v.float())
    delta = (do * out.float()).sum(-1).transpose(0, 1)  # [h, nq]
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("hqk,khd->qhd", ds, k.float())
    dk = torch.einsum("hqk,qhd->khd", ds, q.float())
    return dq, dk, dv


def flash_cuda_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    # torch's CUDA flash kernel (bf16/fp16 only). Not yet exercised on a GPU in CI:
    # tools/gpu_check.py compares it with the dense reference before it becomes a default.
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale
    )[:2]
    return out[0].transpose(0, 1), lse[0, :, : q.shape[0]]


def flash_cuda_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _bhsd(dout).contiguous(), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out).contiguous(),
        lse.unsqueeze(0).contiguous(), empty, empty, q.shape[0], k.shape[0], 0.0, causal, empty, empty,
        scale=scale,
    )
    return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)


KERNELS = {
    "flash_cpu": (flash_cpu_forward, flash_cpu_backward),
    "flash_cuda": (flash_cuda_forward, flash_cuda_backward),
    "math": (math_forward, math_backward),
}


def default_kernel(device: torch.device, dtype: Optional[torch.dtype] = None) -> str:
    """The kernel used when none is named: the fused flash kernel on CPU, else ``math``."""
    return "flash_cpu" if device.type == "cpu" else "math"
